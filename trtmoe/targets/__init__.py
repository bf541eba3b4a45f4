"""Deployment targets, one object each, registered by name.

``convert --target NAME``, ``inspect --target NAME``, ``calibrate --target NAME``, planning and the
build stage ask :func:`target_for` for the object and call it; adding a target is one class (or one
instance of an existing class) and one :func:`register` call.

* ``embedded``: the embedded PyTorch engine (TensorRT-LLM checkpoint, ``build --backend embedded``);
* ``tensorrt-llm``: TensorRT-LLM 1.2's engine builder (TensorRT-LLM checkpoint, ``trtllm-build``);
* ``trtllm-pytorch``, ``vllm``, ``sglang``: the unified-HF checkpoint those engines load directly.
"""

from __future__ import annotations

from ..errors import UnsupportedError
from .base import Target
from .engine_checkpoint import EngineCheckpoint, Embedded, TensorRTLLMEngine
from .unified_hf import UnifiedHF

TARGETS: dict[str, Target] = {}


def register(target: Target) -> Target:
    """Add ``target`` to the registry under its name (a name taken is an error)."""
    if not target.name or target.name in TARGETS:
        raise ValueError(f"target name {target.name!r} is empty or taken")
    TARGETS[target.name] = target
    return target


def unregister(name: str) -> None:
    """Remove a target added with :func:`register`."""
    TARGETS.pop(name, None)


def target_for(name: str) -> Target:
    """The registered target called ``name``; UnsupportedError naming the choices otherwise."""
    try:
        return TARGETS[name]
    except KeyError:
        raise UnsupportedError(f"unknown target {name!r}", hint="choose from " + ", ".join(TARGETS)) from None


def names(*, unified: bool | None = None, calibrates: bool | None = None) -> tuple[str, ...]:
    """Registered names in registration order, optionally only the unified-HF ones (or only the
    others), or only those ``calibrate`` scores plans for."""
    return tuple(n for n, t in TARGETS.items()
                 if (unified is None or t.unified == unified) and (calibrates is None or t.calibrates == calibrates))


for _t in (Embedded(), TensorRTLLMEngine(), UnifiedHF("trtllm-pytorch"), UnifiedHF("vllm"), UnifiedHF("sglang")):
    register(_t)

__all__ = ["TARGETS", "Target", "EngineCheckpoint", "Embedded", "TensorRTLLMEngine", "UnifiedHF", "register",
           "unregister", "target_for", "names"]
