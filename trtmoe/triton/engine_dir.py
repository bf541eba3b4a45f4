"""Read an engine directory's own config: the limits a Triton repository must agree with.

Two layouts are accepted:

* **TensorRT-LLM engine dir** (``trtllm-build`` output): ``config.json`` with ``version``,
  ``pretrained_config`` (the checkpoint config, including ``mapping``) and ``build_config``, plus one
  ``rank{N}.engine`` per rank.
* **Embedded engine dir** (``trtmoe build --backend embedded``): ``config.json`` with
  ``"backend": "embedded"``, ``"checkpoint"`` (a path relative to the engine dir, or absolute) and
  ``build_config``; the checkpoint is a TensorRT-LLM checkpoint dir (``config.json`` +
  ``rank{N}.safetensors``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError

EMBEDDED = "embedded"
TENSORRT_LLM = "tensorrtllm"

# TensorRT-LLM's logits_dtype names -> Triton data types.
_TRITON_DTYPE = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}


@dataclass(frozen=True)
class EngineInfo:
    """What a Triton repository needs to know about an engine. Lengths are in tokens."""

    path: Path
    backend: str  # EMBEDDED or TENSORRT_LLM
    architecture: str
    dtype: str
    vocab_size: int
    num_layers: int
    num_experts: int
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_beam_width: int
    tokens_per_block: int
    tp_size: int = 1
    pp_size: int = 1
    world_size: int = 1
    logits_dtype: str = "float32"
    max_num_tokens: int | None = None
    trtllm_version: str | None = None
    checkpoint_dir: Path | None = None
    gather_context_logits: bool = False
    gather_generation_logits: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    rank_files: tuple[str, ...] = field(default_factory=tuple)

    @property
    def logits_triton_dtype(self) -> str:
        return _TRITON_DTYPE.get(self.logits_dtype, "TYPE_FP32")

    @property
    def launch_world_size(self) -> int:
        """Processes ``tritonserver`` must run as: one per rank for TensorRT engines, one otherwise."""
        return self.world_size if self.backend == TENSORRT_LLM else 1

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        d["checkpoint_dir"] = str(self.checkpoint_dir) if self.checkpoint_dir else None
        d["rank_files"] = list(self.rank_files)
        return d


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


def _model_facts(pretrained: dict, where: str) -> dict[str, Any]:
    """Architecture facts from a TensorRT-LLM checkpoint/pretrained config."""
    moe = pretrained.get("moe") or {}
    num_experts = moe.get("num_experts", pretrained.get("moe_num_experts", 0)) or 0
    mapping = pretrained.get("mapping") or {}
    tp = _int(mapping, "tp_size", f"{where}: mapping", default=1)
    pp = _int(mapping, "pp_size", f"{where}: mapping", default=1)
    world = _int(mapping, "world_size", f"{where}: mapping", default=tp * pp)
    if world != tp * pp * int(mapping.get("cp_size", 1) or 1):
        raise InputError(f"mapping.world_size {world} != tp_size {tp} x pp_size {pp}", where=where)
    extra = pretrained.get("trtmoe") or {}
    return dict(
        architecture=str(pretrained.get("architecture") or ""),
        dtype=str(pretrained.get("dtype") or ""),
        vocab_size=_int(pretrained, "vocab_size", where),
        num_layers=_int(pretrained, "num_hidden_layers", where),
        num_experts=int(num_experts),
        tp_size=tp, pp_size=pp, world_size=world,
        logits_dtype=str(pretrained.get("logits_dtype") or "float32"),
        bos_token_id=extra.get("bos_token_id"),
        eos_token_id=extra.get("eos_token_id"),
    )


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
        facts = _model_facts(ck_cfg, str(ck_dir / "config.json"))
        ranks = tuple(f"rank{r}.safetensors" for r in range(facts["world_size"]))
        missing = [r for r in ranks if not (ck_dir / r).is_file()]
        if missing:
            raise InputError(f"checkpoint is missing {', '.join(missing)}", where=str(ck_dir))
        limits = _build_limits(build, where, max_position_embeddings=ck_cfg.get("max_position_embeddings"))
        return EngineInfo(path=root, backend=EMBEDDED, checkpoint_dir=ck_dir, rank_files=ranks,
                          trtllm_version=cfg.get("version"), **facts, **limits)

    if "backend" in cfg and cfg["backend"] not in (TENSORRT_LLM, "tensorrt-llm", "tensorrt_llm"):
        raise InputError(f"unknown engine backend {cfg['backend']!r}", where=where,
                         hint="expected 'embedded' or a trtllm-build engine directory")
    pretrained = cfg.get("pretrained_config")
    if not isinstance(pretrained, dict):
        raise InputError("missing pretrained_config", where=where,
                         hint="not a trtllm-build engine directory")
    facts = _model_facts(pretrained, where)
    ranks = tuple(f"rank{r}.engine" for r in range(facts["world_size"]))
    missing = [r for r in ranks if not (root / r).is_file()]
    if missing:
        raise InputError(f"engine is missing {', '.join(missing)} for mapping.world_size "
                         f"{facts['world_size']}", where=str(root))
    limits = _build_limits(build, where, max_position_embeddings=pretrained.get("max_position_embeddings"))
    return EngineInfo(path=root, backend=TENSORRT_LLM, rank_files=ranks,
                      trtllm_version=str(cfg.get("version")) if cfg.get("version") else None,
                      gather_context_logits=bool(build.get("gather_context_logits", False)),
                      gather_generation_logits=bool(build.get("gather_generation_logits", False)),
                      **facts, **limits)
