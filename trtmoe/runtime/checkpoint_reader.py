"""Read a TensorRT-LLM checkpoint directory back into whole-model tensors, undoing the TP/EP/PP split
with the same Mapping that made it. This is the inverse of ``checkpoint.layout``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError, InputError
from ..hf.safetensors_io import SafetensorsFile
from ..parallel.mapping import Mapping


@dataclass
class CheckpointConfig:
    raw: dict
    mapping: Mapping
    dtype: torch.dtype
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    normalization_mode: int
    expert_intermediate_size: int
    dense_intermediate_size: int
    shared_expert_intermediate_size: int
    shared_expert_gate: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    norm_eps: float
    max_position_embeddings: int
    moe_layers: list[bool]
    eos_token_id: int | None
    bos_token_id: int | None
    tie_word_embeddings: bool = False


_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_config(ckpt_dir: str | Path) -> CheckpointConfig:
    d = Path(ckpt_dir)
    f = d / "config.json"
    if not f.is_file():
        raise InputError("no config.json; not a TensorRT-LLM checkpoint directory", where=str(d))
    raw = json.loads(f.read_text())
    try:
        ours = raw.get("trtmoe") or {}
        arch = raw["architecture"]
        family = ours.get("family") or {"MixtralForCausalLM": "mixtral", "DeepseekForCausalLM": "deepseek_v1"}.get(
            arch) or raw.get("qwen_type")
        if family not in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v1"):
            raise InputError(f"checkpoint architecture {arch!r} is not one the embedded engine runs", where=str(f))
        moe = raw["moe"]
        L = raw["num_hidden_layers"]
        if "moe_layers" in ours:
            moe_layers = list(ours["moe_layers"])
        elif family == "deepseek_v1":
            moe_layers = [l > 0 for l in range(L)]  # TensorRT-LLM's DeepSeek-V1 makes layer 0 dense
        else:
            dense = set(raw.get("mlp_only_layers") or [])
            moe_layers = [l not in dense for l in range(L)]
        I = raw.get("moe_intermediate_size") or raw["intermediate_size"]
        return CheckpointConfig(
            raw=raw, mapping=Mapping.from_config(raw["mapping"]), dtype=_DT[raw["dtype"]], family=family,
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_layers=L,
            num_heads=raw["num_attention_heads"],
            num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_size") or raw["hidden_size"] // raw["num_attention_heads"],
            num_experts=moe["num_experts"], top_k=moe["top_k"], normalization_mode=moe["normalization_mode"],
            expert_intermediate_size=I,
            dense_intermediate_size=raw.get("intermediate_size", 0) if family != "mixtral" else 0,
            shared_expert_intermediate_size=moe.get("shared_expert_intermediate_size", 0)
            or raw.get("moe_shared_expert_intermediate_size", 0),
            shared_expert_gate=family == "qwen2_moe",
            qkv_bias=bool(raw.get("attn_bias")), qk_norm=bool(raw.get("qk_layernorm")),
            rope_theta=float(raw.get("rotary_base", 10000.0)), norm_eps=float(raw.get("norm_epsilon", 1e-5)),
            max_position_embeddings=raw.get("max_position_embeddings") or 2048,
            moe_layers=moe_layers, eos_token_id=ours.get("eos_token_id"), bos_token_id=ours.get("bos_token_id"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r}", where=str(f)) from None


class RankFiles:
    """All rank files of a checkpoint, opened lazily, with name lookup per (tp_rank, pp_rank)."""

    def __init__(self, ckpt_dir: str | Path, cfg: CheckpointConfig):
        self.dir = Path(ckpt_dir)
        self.cfg = cfg
        self.mp = cfg.mapping
        self._files: dict[int, SafetensorsFile] = {}
        for r in self.mp.ranks():
            if not (self.dir / f"rank{r}.safetensors").is_file():
                raise CheckpointError(f"rank{r}.safetensors is missing for world size {self.mp.world_size}",
                                      where=str(self.dir))

    def file(self, rank: int) -> SafetensorsFile:
        f = self._files.get(rank)
        if f is None:
            f = self._files[rank] = SafetensorsFile(self.dir / f"rank{rank}.safetensors")
        return f

    def has(self, name: str, tp_rank: int = 0, pp_rank: int = 0) -> bool:
        return name in self.file(self.mp.rank(tp_rank, pp_rank)).tensors

    def get(self, name: str, tp_rank: int = 0, pp_rank: int = 0) -> torch.Tensor:
        f = self.file(self.mp.rank(tp_rank, pp_rank))
        if name not in f.tensors:
            raise CheckpointError(f"tensor {name!r} missing", where=str(f.path))
        return f.read(name)

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()


def gather_qkv(files: RankFiles, prefix: str, suffix: str, pp_rank: int) -> tuple[torch.Tensor, ...]:
    """Rebuild full q, k, v (weights or biases) from the per-rank [q_r; k_r; v_r] blocks, dropping the
    duplicated KV heads TensorRT-LLM makes when num_kv_heads < tp."""
    c, mp = files.cfg, files.mp
    hd = c.head_dim
    nh_loc = c.num_heads // mp.tp_size
    qs, ks, vs = [], {}, {}
    for r in range(mp.tp_size):
        t = files.get(f"{prefix}attention.qkv.{suffix}", r, pp_rank)
        kvr = mp.kv_head_range(c.num_kv_heads, r)
        nq, nkv = nh_loc * hd, len(kvr) * hd
        q, k, v = t[:nq], t[nq:nq + nkv], t[nq + nkv:nq + 2 * nkv]
        qs.append(q)
        for i, h in enumerate(kvr):
            ks.setdefault(h, k[i * hd:(i + 1) * hd])
            vs.setdefault(h, v[i * hd:(i + 1) * hd])
    return torch.cat(qs), torch.cat([ks[h] for h in sorted(ks)]), torch.cat([vs[h] for h in sorted(vs)])
