"""Read an engine directory's own config: the limits a Triton repository must agree with.

Two layouts are accepted:

* **TensorRT-LLM engine dir** (``trtllm-build`` output): ``config.json`` with ``version``,
  ``pretrained_config`` (the checkpoint config, including ``mapping``) and ``build_config``, plus one
  ``rank{N}.engine`` per rank.
* **Embedded engine dir** (``trtmoe build --backend embedded``): ``config.json`` with
  ``"backend": "embedded"``, ``"checkpoint"`` (a path relative to the engine dir, or absolute) and
  ``build_config``; the checkpoint is a TensorRT-LLM checkpoint dir (``config.json`` +
  ``rank{N}.safetensors``), or a unified-HF checkpoint (``trtmoe.runtime.unified_load``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..matmul import CPU_ACTIVATIONS, CPU_MATMUL_MODES
from ..parallel.mapping import Mapping
from ..runtime.checkpoint_reader import CheckpointConfig, parse_config
from ..runtime.unified_load import is_unified_checkpoint, unified_model_config

EMBEDDED = "embedded"
TENSORRT_LLM = "tensorrtllm"

# TensorRT-LLM's logits_dtype names -> Triton data types.
_TRITON_DTYPE = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}


@dataclass(frozen=True)
class EngineInfo:
    """What a Triton repository needs to know about an engine. Lengths are in tokens.

    ``model`` is the model the engine runs, read from its TensorRT-LLM checkpoint config (the
    checkpoint's ``config.json`` for an embedded engine, ``pretrained_config`` for a trtllm-build
    one) by the same reader every other stage uses; it carries the ``mapping``. The other fields
    are the engine's own build facts.
    """

    path: Path
    backend: str  # EMBEDDED or TENSORRT_LLM
    model: CheckpointConfig
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_beam_width: int
    tokens_per_block: int
    logits_dtype: str = "float32"  # what the engine outputs logits as (the checkpoint config's logits_dtype)
    max_num_tokens: int | None = None
    trtllm_version: str | None = None
    checkpoint_dir: Path | None = None  # embedded: the checkpoint whose rank files hold the weights
    gather_context_logits: bool = False
    gather_generation_logits: bool = False
    rank_files: tuple[str, ...] = field(default_factory=tuple)
    cpu_matmul: str = "auto"  # embedded: the CPU library choice it was built with (trtmoe.matmul)
    cpu_activations: str = "float32"  # embedded: float32, or model (the checkpoint's dtype) on CPU

    @property
    def mapping(self) -> Mapping:
        return self.model.mapping

    @property
    def architecture(self) -> str:
        """The TensorRT-LLM architecture name the config records (e.g. ``MixtralForCausalLM``)."""
        return self.model.architecture

    @property
    def eos_token_id(self) -> int | None:
        """The model's end-of-sequence id (the Python ``tensorrt_llm`` model of existing repositories reads it here)."""
        return self.model.eos_token_id

    @property
    def logits_triton_dtype(self) -> str:
        return _TRITON_DTYPE.get(self.logits_dtype, "TYPE_FP32")

    @property
    def launch_world_size(self) -> int:
        """Processes ``tritonserver`` must run as: one per rank for TensorRT engines, one otherwise."""
        return self.mapping.world_size if self.backend == TENSORRT_LLM else 1

    def to_json(self) -> dict[str, Any]:
        """The engine as the repository manifest records it: the build facts, plus a summary of the
        model and mapping under the keys the manifest has always used."""
        m, mp = self.model, self.mapping
        return {
            "path": str(self.path), "backend": self.backend,
            "architecture": self.architecture, "dtype": m.source_dtype, "vocab_size": m.vocab_size,
            "num_layers": m.num_layers, "num_experts": m.num_experts,
            "max_batch_size": self.max_batch_size, "max_input_len": self.max_input_len,
            "max_seq_len": self.max_seq_len, "max_beam_width": self.max_beam_width,
            "tokens_per_block": self.tokens_per_block,
            "tp_size": mp.tp_size, "pp_size": mp.pp_size, "world_size": mp.world_size,
            "logits_dtype": self.logits_dtype, "max_num_tokens": self.max_num_tokens,
            "trtllm_version": self.trtllm_version,
            "checkpoint_dir": str(self.checkpoint_dir) if self.checkpoint_dir else None,
            "gather_context_logits": self.gather_context_logits,
            "gather_generation_logits": self.gather_generation_logits,
            "bos_token_id": m.bos_token_id, "eos_token_id": m.eos_token_id,
            "rank_files": list(self.rank_files),
        }


def _load_json(path: Path) -> dict:
    if not path.is_file():
        raise InputError("missing config.json", where=str(path.parent),
                         hint="pass an engine directory from `trtmoe build` or `trtllm-build`")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"unreadable JSON: {e}", where=str(path)) from None
    if not isinstance(data, dict):
        raise InputError("expected a JSON object", where=str(path))
    return data


def _int(block: dict, key: str, where: str, *, default: int | None = None, minimum: int = 1) -> int:
    value = block.get(key, default)
    if value is None:
        raise InputError(f"missing field {key}", where=where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"field {key} must be an integer, got {value!r}", where=where)
    if value < minimum:
        raise InputError(f"field {key} must be >= {minimum}, got {value}", where=where)
    return value


def _read_model(pretrained: dict, where: str) -> CheckpointConfig:
    """The model of a TensorRT-LLM checkpoint/pretrained config, after checking the sizes a
    repository depends on (each failure names its field)."""
    _int(pretrained, "vocab_size", where)
    _int(pretrained, "num_hidden_layers", where)
    mapping = pretrained.get("mapping") or {}
    tp = _int(mapping, "tp_size", f"{where}: mapping", default=1)
    pp = _int(mapping, "pp_size", f"{where}: mapping", default=1)
    world = _int(mapping, "world_size", f"{where}: mapping", default=tp * pp)
    if world != tp * pp * int(mapping.get("cp_size", 1) or 1):
        raise InputError(f"mapping.world_size {world} != tp_size {tp} x pp_size {pp}", where=where)
    return parse_config(pretrained, where=where)


def _build_limits(build: dict, where: str, *, max_position_embeddings: int | None) -> dict[str, Any]:
    where = f"{where}: build_config"
    max_seq_len = build.get("max_seq_len")
    if max_seq_len is None and max_position_embeddings:
        max_seq_len = max_position_embeddings  # trtllm-build's own default
    limits = dict(
        max_batch_size=_int(build, "max_batch_size", where),
        max_input_len=_int(build, "max_input_len", where),
        max_seq_len=_int({"max_seq_len": max_seq_len}, "max_seq_len", where),
        max_beam_width=_int(build, "max_beam_width", where, default=1),
        tokens_per_block=_int(build, "tokens_per_block", where, default=32),
    )
    mnt = build.get("max_num_tokens")
    limits["max_num_tokens"] = int(mnt) if isinstance(mnt, int) and not isinstance(mnt, bool) else None
    if limits["max_input_len"] > limits["max_seq_len"]:
        raise InputError(f"max_input_len {limits['max_input_len']} > max_seq_len {limits['max_seq_len']}",
                         where=where)
    return limits


def read_engine_dir(path: str | Path) -> EngineInfo:
    """Read and check an embedded or TensorRT-LLM engine directory; raises InputError naming the field."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise InputError("engine directory not found", where=str(root))
    cfg = _load_json(root / "config.json")
    where = str(root / "config.json")
    build = cfg.get("build_config")
    if not isinstance(build, dict):
        raise InputError("missing build_config", where=where,
                         hint="this looks like a checkpoint dir; build an engine from it first")

    if cfg.get("backend") == EMBEDDED:
        ck = cfg.get("checkpoint")
        if not isinstance(ck, str) or not ck:
            raise InputError("missing field checkpoint", where=where)
        ck_dir = (root / ck).resolve()
        ck_cfg = _load_json(ck_dir / "config.json")
        if is_unified_checkpoint(ck_dir):  # one set of Hugging Face-named shards, no rank files
            model = unified_model_config(ck_dir)
            ranks = ()
            ck_cfg = {"max_position_embeddings": model.max_position_embeddings}
        else:
            model = _read_model(ck_cfg, str(ck_dir / "config.json"))
            ranks = tuple(f"rank{r}.safetensors" for r in model.mapping.ranks())
        missing = [r for r in ranks if not (ck_dir / r).is_file()]
        if missing:
            raise InputError(f"checkpoint is missing {', '.join(missing)}", where=str(ck_dir))
        limits = _build_limits(build, where, max_position_embeddings=ck_cfg.get("max_position_embeddings"))
        cpu_matmul = build.get("cpu_matmul", "auto")  # absent in engine dirs built before it was recorded
        if cpu_matmul not in CPU_MATMUL_MODES:
            raise InputError(f"build_config.cpu_matmul is {cpu_matmul!r}, not one of {', '.join(CPU_MATMUL_MODES)}",
                             where=where)
        cpu_activations = build.get("cpu_activations", "float32")  # absent in engine dirs built before it
        if cpu_activations not in CPU_ACTIVATIONS:
            raise InputError(f"build_config.cpu_activations is {cpu_activations!r}, not one of "
                             f"{', '.join(CPU_ACTIVATIONS)}", where=where)
        return EngineInfo(path=root, backend=EMBEDDED, model=model, checkpoint_dir=ck_dir, rank_files=ranks,
                          trtllm_version=cfg.get("version"), logits_dtype=_logits_dtype(ck_cfg),
                          cpu_matmul=cpu_matmul, cpu_activations=cpu_activations, **_gather_flags(build), **limits)

    if "backend" in cfg and cfg["backend"] not in (TENSORRT_LLM, "tensorrt-llm", "tensorrt_llm"):
        raise InputError(f"unknown engine backend {cfg['backend']!r}", where=where,
                         hint="expected 'embedded' or a trtllm-build engine directory")
    pretrained = cfg.get("pretrained_config")
    if not isinstance(pretrained, dict):
        raise InputError("missing pretrained_config", where=where,
                         hint="not a trtllm-build engine directory")
    model = _read_model(pretrained, where)
    ranks = tuple(f"rank{r}.engine" for r in model.mapping.ranks())
    missing = [r for r in ranks if not (root / r).is_file()]
    if missing:
        raise InputError(f"engine is missing {', '.join(missing)} for mapping.world_size "
                         f"{model.mapping.world_size}", where=str(root))
    limits = _build_limits(build, where, max_position_embeddings=pretrained.get("max_position_embeddings"))
    return EngineInfo(path=root, backend=TENSORRT_LLM, model=model, rank_files=ranks,
                      trtllm_version=str(cfg.get("version")) if cfg.get("version") else None,
                      logits_dtype=_logits_dtype(pretrained),
                      **_gather_flags(build), **limits)


def _gather_flags(build: dict) -> dict[str, bool]:
    """build_config's gather_context_logits / gather_generation_logits (trtllm-build records both;
    ``gather_all_token_logits`` is its shorthand for the two), False when absent."""
    both = bool(build.get("gather_all_token_logits", False))
    return {k: both or bool(build.get(k, False)) for k in ("gather_context_logits", "gather_generation_logits")}


def _logits_dtype(pretrained: dict) -> str:
    return str(pretrained.get("logits_dtype") or "float32")
