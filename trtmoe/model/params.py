"""Tensor shapes of a model's roles, and parameter accounting: total parameters, and those a forward pass
touches per token."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .description import ModelSpec


@dataclass
class ParamCount:
    total: int
    active: int
    components: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (total, active/token)
    # Model cards' "activated" count: every parameter except the routed experts a token does not
    # pick (so the whole embedding table counts, not one row). "A3B", "A14B", "12.9B active" etc.
    activated: int = 0

    @property
    def active_share(self) -> float:
        return self.active / self.total if self.total else 0.0


def role_shapes(m: ModelSpec, layer: int | None) -> dict[str, tuple[int, ...]]:
    """HF shape of every role that exists in ``layer`` (None: the global tensors); routed experts
    under their role names (the same shape for every expert). The one shape formula: the checkpoint
    layout, the HF reader's checks and the parameter count all read it."""
    H, V = m.hidden_size, m.vocab_size
    if layer is None:
        out = {"embed": (V, H), "final_norm": (H,), "lm_head": (V, H)}
        if m.norm_bias:
            out["final_norm_bias"] = (H,)
        if m.lm_head_bias:
            out["lm_head_bias"] = (V,)
        return out
    out = {"input_norm": (H,), "post_norm": (H,), "q": (m.q_size, H), "k": (m.kv_size, H),
           "v": (m.kv_size, H), "o": (H, m.q_size)}
    if m.norm_bias:
        out.update(input_norm_bias=(H,), post_norm_bias=(H,))
    if m.qkv_bias:
        out.update(q_bias=(m.q_size,), k_bias=(m.kv_size,), v_bias=(m.kv_size,))
    if m.attn_out_bias:
        out["o_bias"] = (H,)
    if m.qk_norm:
        out.update(q_norm=(m.head_dim,), k_norm=(m.head_dim,))
    if m.moe_layers[layer]:
        I = m.expert_intermediate_size
        out.update(router=(m.num_experts, H), expert_gate=(I, H), expert_up=(I, H), expert_down=(H, I))
        S = m.shared_expert_intermediate_size
        if S:
            out.update(shared_gate_proj=(S, H), shared_up=(S, H), shared_down=(H, S))
        if m.shared_expert_gate:
            out["shared_expert_gate"] = (1, H)
    else:
        D = m.dense_intermediate_size
        out.update(dense_gate=(D, H), dense_up=(D, H), dense_down=(H, D))
    return out


# The accounting component of each decoder-layer role (global roles are counted by name below).
_COMPONENT = {
    **dict.fromkeys(("input_norm", "post_norm", "input_norm_bias", "post_norm_bias"), "norms"),
    **dict.fromkeys(("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm"), "attention"),
    "router": "router",
    **dict.fromkeys(("expert_gate", "expert_up", "expert_down"), "routed experts"),
    **dict.fromkeys(("shared_gate_proj", "shared_up", "shared_down"), "shared experts"),
    "shared_expert_gate": "shared expert gate",
    **dict.fromkeys(("dense_gate", "dense_up", "dense_down"), "dense MLP"),
}


def count_params(m: ModelSpec) -> ParamCount:
    """Count parameters of a MoE description (a ``ModelSpec``, or a checkpoint's config read back as one).

    Active per token counts what one token's forward pass multiplies with: one embedding row, all of
    attention and the norms (and their biases), every router, the shared experts, ``top_k`` routed
    experts per MoE layer, dense MLPs, and the whole lm_head (every logit is computed). ``activated``
    is the figure model cards publish: the total less the routed experts a token does not pick.
    Every count is the product of a shape from :func:`role_shapes`.
    """
    comp: dict[str, list[int]] = {}

    def add(name, total, active):
        t = comp.setdefault(name, [0, 0])
        t[0] += total
        t[1] += active

    g = {role: math.prod(shape) for role, shape in role_shapes(m, None).items()}
    add("embedding", g["embed"], m.hidden_size)
    if not m.tie_word_embeddings:
        add("lm_head", g["lm_head"], g["lm_head"])
    else:
        add("lm_head (tied)", 0, g["lm_head"])
    if "lm_head_bias" in g:
        add("lm_head", g["lm_head_bias"], g["lm_head_bias"])
    for role in ("final_norm", "final_norm_bias"):
        if role in g:
            add("norms", g[role], g[role])
    unpicked = 0
    for l in range(m.num_layers):
        for role, shape in role_shapes(m, l).items():
            n, name = math.prod(shape), _COMPONENT[role]
            if name == "routed experts":
                add(name, m.num_experts * n, m.top_k * n)
                unpicked += (m.num_experts - m.top_k) * n
            else:
                add(name, n, n)
    total = sum(t for t, _ in comp.values())
    active = sum(a for _, a in comp.values())
    return ParamCount(total, active, {k: (t, a) for k, (t, a) in comp.items()}, activated=total - unpicked)
