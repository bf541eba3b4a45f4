"""Open what the embedded engine runs: a TensorRT-LLM checkpoint dir or an embedded engine dir,
and the tokenizer that goes with it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .engine import EmbeddedEngine
from .unified_load import is_unified_checkpoint, load_unified_engine


def checkpoint_dir_of(path: str | Path) -> tuple[Path, dict]:
    """Resolve an embedded engine directory to its checkpoint; a checkpoint dir (TensorRT-LLM or
    unified-HF) resolves to itself. Returns (checkpoint_dir, build_config)."""
    p = Path(path)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise InputError("no config.json here", where=str(p),
                         hint="pass a `trtmoe convert` checkpoint or a `trtmoe build --backend embedded` engine dir")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("backend") == "embedded":
        ck = p / cfg.get("checkpoint", "checkpoint")
        return ck, cfg.get("build_config", {})
    if "pretrained_config" in cfg:
        raise InputError("this is a TensorRT-LLM engine directory; the embedded engine runs checkpoints",
                         where=str(p), hint="serve it with Triton's tensorrtllm backend instead")
    return p, {}


def load_engine(path: str | Path, device: str | None = None, pack_experts: bool = True,
                cpu_activations: str | None = None, weights: str = "checkpoint") -> EmbeddedEngine:
    """The embedded engine for a checkpoint (TensorRT-LLM, or unified-HF: ``trtmoe.runtime.unified_load``)
    or embedded engine dir. ``pack_experts=False``: routed experts in the checkpoint's own layout,
    quantized ones on their formats' reference path (see ``EmbeddedEngine.from_checkpoint``), for measurements that must not depend on the CPU's kernels.
    ``cpu_activations`` overrides what an engine dir records (a checkpoint dir: float32). ``weights``:
    weight matrices held in the checkpoint's dtype ("checkpoint") or the compute dtype ("compute"), see
    ``EmbeddedEngine.from_checkpoint``."""
    ck, build = checkpoint_dir_of(path)
    if device is None and build.get("device") not in (None, "auto"):
        device = build["device"]
    # An engine built before cpu_matmul was recorded runs with the default.
    load = load_unified_engine if is_unified_checkpoint(ck) else EmbeddedEngine.from_checkpoint
    return load(ck, device=device, max_seq_len=build.get("max_seq_len"), cpu_matmul=build.get("cpu_matmul", "auto"),
                pack_experts=pack_experts, cpu_activations=cpu_activations or build.get("cpu_activations", "float32"),
                weights=weights)


@dataclass
class TextTokenizer:
    """A thin wrapper over a `tokenizers` tokenizer.json with BOS/EOS from the HF side files."""

    tok: object
    bos_id: int | None
    eos_id: int | None
    add_bos: bool

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def find_tokenizer_dir(path: str | Path) -> Path:
    p = Path(path)
    for cand in (p, p / "tokenizer", p / "checkpoint" / "tokenizer"):
        if (cand / "tokenizer.json").is_file():
            return cand
    raise InputError("no tokenizer.json found", where=str(p), hint="pass --tokenizer DIR")


def load_tokenizer(path: str | Path) -> TextTokenizer:
    from tokenizers import Tokenizer

    d = find_tokenizer_dir(path)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    conf = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        f = d / name
        if f.is_file():
            conf.update({k: v for k, v in json.loads(f.read_text()).items() if v is not None})

    def tid(key):
        v = conf.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return tok.token_to_id(v) if isinstance(v, str) else None

    return TextTokenizer(tok, tid("bos_token"), tid("eos_token"), bool(conf.get("add_bos_token", False)))
