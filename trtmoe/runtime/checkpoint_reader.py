"""Read a TensorRT-LLM checkpoint directory back into whole-model tensors, undoing the TP/EP/PP split
with the same Mapping that made it: the architecture registry's rule table (``trtmoe.hf.adapters``)
applied in reverse. This is the inverse of ``checkpoint.layout``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError, InputError, LayoutError
from ..hf.adapters import ADAPTERS, EP, KV_HEADS, REPLICATED, TP, VOCAB, Rule, adapter_for_checkpoint
from ..hf.safetensors_io import SafetensorsFile
from ..model.description import ModelSpec
from ..parallel.mapping import Mapping


@dataclass(frozen=True)
class CheckpointConfig(ModelSpec):
    """The model a checkpoint holds (the same facts as ``ModelSpec``, read back from config.json), with
    the layout that split it, its weight dtype and the raw config."""

    mapping: Mapping = field(default_factory=Mapping)
    dtype: torch.dtype = torch.float32
    # The TensorRT-LLM model class the config names (``architecture``, e.g. MixtralForCausalLM): what
    # trtllm-build instantiates, so what a repository or report names the engine by.
    architecture: str = ""
    raw: dict = field(default_factory=dict, compare=False, repr=False)


_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_config(ckpt_dir: str | Path) -> CheckpointConfig:
    d = Path(ckpt_dir)
    f = d / "config.json"
    if not f.is_file():
        raise InputError("no config.json; not a TensorRT-LLM checkpoint directory", where=str(d))
    return parse_config(json.loads(f.read_text()), where=str(f))


def parse_config(raw: dict, *, where: str) -> CheckpointConfig:
    """The model a TensorRT-LLM checkpoint config describes (a checkpoint's config.json, or the
    ``pretrained_config`` a trtllm-build engine keeps); ``where`` names it in errors."""
    try:
        adapter = adapter_for_checkpoint(raw) or ADAPTERS.get(raw.get("qwen_type"))
        if adapter is None:
            known = ", ".join(sorted({a.trtllm_architecture for a in ADAPTERS.values()}))
            raise InputError(f"checkpoint architecture {raw['architecture']!r} is not one trtmoe knows", where=where,
                             hint=f"trtmoe reads {known}")
        ours = raw.get("trtmoe") or {}
        moe = raw["moe"]
        L = raw["num_hidden_layers"]
        moe_layers = ours["moe_layers"] if "moe_layers" in ours else adapter.trtllm_moe_layers(raw, L)
        facts = dict(
            family=adapter.family, hf_architecture=adapter.hf_architectures[0],
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_layers=L,
            num_heads=raw["num_attention_heads"],
            num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_size") or raw["hidden_size"] // raw["num_attention_heads"],
            num_experts=moe["num_experts"], top_k=moe["top_k"], normalization_mode=moe["normalization_mode"],
            sparse_mixer_epsilon=float(moe.get("sparse_mixer_epsilon", 0.01)),
            expert_intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
            dense_intermediate_size=raw.get("intermediate_size", 0) if adapter.dense_layers else 0,
            shared_expert_intermediate_size=moe.get("shared_expert_intermediate_size", 0)
            or raw.get("moe_shared_expert_intermediate_size", 0),
            shared_expert_gate=adapter.shared_expert_gate,
            qkv_bias=bool(raw.get("attn_bias")), qk_norm=bool(raw.get("qk_layernorm")),
            moe_layers=tuple(moe_layers), eos_token_id=ours.get("eos_token_id"), bos_token_id=ours.get("bos_token_id"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            source_dtype=raw["dtype"],
        )
        for key, name in (("rope_theta", "rotary_base"), ("norm_eps", "norm_epsilon"),
                          ("max_position_embeddings", "max_position_embeddings")):
            if raw.get(name) is not None:
                facts[key] = raw[name]
        facts.update(adapter.from_trtllm(raw))
        try:
            mapping = Mapping.from_config(raw["mapping"])
        except LayoutError as e:
            raise LayoutError(f"mapping: {e.what}", where=e.where or where, hint=e.hint) from None
        return CheckpointConfig(mapping=mapping, dtype=_DT[raw["dtype"]],
                                architecture=str(raw.get("architecture") or adapter.trtllm_architecture),
                                raw=raw, **facts)
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r}", where=where) from None


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
    nh_loc = mp.heads_per_rank(c.num_heads)
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


def unshard(parts: list[torch.Tensor], n_roles: int, axis: int) -> torch.Tensor:
    """Undo a split along ``axis`` of a tensor made of ``n_roles`` equal role blocks concatenated
    along it (each role split, then the slices concatenated, on every part): the whole tensor, roles
    in order."""
    if len(parts) == 1:
        return parts[0]
    blocks = [p.chunk(n_roles, axis) for p in parts]
    return torch.cat([torch.cat([b[i] for b in blocks], axis) for i in range(n_roles)], axis)


def whole(files: RankFiles, rule: Rule, prefix: str, pp_rank: int) -> torch.Tensor:
    """The whole tensor of one (non-expert) rule: its HF roles concatenated in the rule's order."""
    c, mp = files.cfg, files.mp
    name = prefix + rule.name
    if rule.shard in (REPLICATED, EP):
        return files.get(name, 0, pp_rank)
    parts = [files.get(name, r, pp_rank) for r in range(mp.tp_size)]
    if rule.shard == TP:
        return unshard(parts, len(rule.roles), rule.axis)
    if rule.shard == KV_HEADS:
        return torch.cat(gather_qkv(files, prefix, rule.name.rsplit(".", 1)[1], pp_rank))
    if rule.shard == VOCAB:
        return torch.cat(parts)[: c.vocab_size]
    raise AssertionError(f"no whole tensor for shard kind {rule.shard!r}")
