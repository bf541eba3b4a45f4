"""The engine's weights as it holds them: the embedding, one ``Layer`` per decoder layer and the head,
read from a checkpoint through the architecture's rule table (trtmoe.hf.adapters) in reverse.

Tensors are looked up by *role* (the first HF role a rule reads, e.g. ``input_norm``, ``q``,
``router``), never by their TensorRT-LLM names: the rule table is the one place that spells those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checkpoint.layout import layer_prefix
from ..hf.adapters import FIRST, LAST, MOE_TP, global_rules, layer_rules
from ..matmul import Dense, dense
from .attention import attention_for
from .checkpoint_reader import RankFiles, whole
from .experts import ExpertBank, expert_bytes, load_expert_bank
from .upcast import Upcast


@dataclass
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: object  # an attention kind (trtmoe.runtime.attention)
    input_norm_b: torch.Tensor | None = None  # LayerNorm biases
    post_norm_b: torch.Tensor | None = None
    router: Dense | None = None  # [E, H] float32
    experts: ExpertBank | None = None
    shared_fc: Dense | None = None  # [2S, H] = [up; gate]
    shared_proj: Dense | None = None
    shared_gate: Dense | None = None  # [1, H]
    dense_gate: Dense | None = None  # TRT mlp.fc (activated)
    dense_up: Dense | None = None  # TRT mlp.gate
    dense_down: Dense | None = None


@dataclass
class Weights:
    embedding: torch.Tensor
    final_norm: torch.Tensor
    final_norm_b: torch.Tensor | None
    lm_head: Dense
    lm_head_b: torch.Tensor | None
    layers: list[Layer] = field(default_factory=list)
    expert_bytes: dict[int, list[int]] = field(default_factory=dict)  # MoE layer -> bytes of each expert slot


def _role(rule) -> str:
    return rule.roles[0]


def load_weights(files: RankFiles, cfg, device: torch.device, compute_dtype: torch.dtype, cpu_matmul: str,
                 pack_experts: bool, weight_dtype: torch.dtype | None = None) -> Weights:
    """Every weight of the checkpoint ``files`` (config ``cfg``) on ``device``: vectors (norms, biases)
    in ``compute_dtype``, the embedding and weight matrices in ``weight_dtype`` (default: the compute
    dtype; another one is multiplied through ``trtmoe.runtime.upcast``), routers in float32, routed
    experts as ``load_expert_bank`` holds them."""
    mp = cfg.mapping
    wdt = weight_dtype or compute_dtype
    to = lambda t: None if t is None else t.to(device, compute_dtype)  # noqa: E731
    if wdt == compute_dtype:
        lin = lambda t: dense(to(t), cpu_matmul)  # noqa: E731
    else:
        lin = lambda t: None if t is None else Upcast(t.to(device, wdt))  # noqa: E731
    g = {_role(r): whole(files, r, "", 0) for r in global_rules(cfg, FIRST)}
    g.update({_role(r): whole(files, r, "", mp.pp_size - 1) for r in global_rules(cfg, LAST)})
    out = Weights(embedding=g["embed"].to(device, wdt), final_norm=to(g["final_norm"]), final_norm_b=to(g.get("final_norm_bias")),
                  lm_head=lin(g["lm_head"]), lm_head_b=to(g.get("lm_head_bias")))
    for l in range(cfg.num_layers):
        p, j = mp.layer_owner(cfg.num_layers, l)
        pre = layer_prefix(j)
        # Tensors the target model has but the source did not are zeros: nothing to add.
        t = {_role(r): whole(files, r, pre, p) for r in layer_rules(cfg, l) if r.shard != MOE_TP and not r.zeros(cfg)}
        lay = Layer(input_norm=to(t["input_norm"]), post_norm=to(t["post_norm"]), attn=attention_for(cfg, t, to, lin),
                    input_norm_b=to(t.get("input_norm_bias")), post_norm_b=to(t.get("post_norm_bias")))
        if cfg.moe_layers[l]:
            lay.router = dense(t["router"].float().to(device), cpu_matmul)
            lay.experts = load_expert_bank(files, cfg, l, pre, p, device, compute_dtype, cpu_matmul, pack_experts, wdt)
            out.expert_bytes[l] = expert_bytes(cfg, l)
            lay.shared_fc = lin(t.get("shared_up"))  # [up; gate]
            lay.shared_proj = lin(t.get("shared_down"))
            lay.shared_gate = lin(t.get("shared_expert_gate"))
        else:
            lay.dense_gate, lay.dense_up = lin(t["dense_gate"]), lin(t["dense_up"])
            lay.dense_down = lin(t["dense_down"])
        out.layers.append(lay)
    return out
