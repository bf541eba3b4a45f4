"""Parameter accounting: total parameters, and those a forward pass touches per token."""

from __future__ import annotations

from dataclasses import dataclass, field


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


def count_params(m) -> ParamCount:
    """Count parameters of a MoE description (``ModelSpec`` or a checkpoint config).

    Active per token counts what one token's forward pass multiplies with: one embedding row, all of
    attention and the norms (and their biases), every router, the shared experts, ``top_k`` routed
    experts per MoE layer, dense MLPs, and the whole lm_head (every logit is computed). ``activated``
    is the figure model cards publish: the total less the routed experts a token does not pick.
    """
    H, V = m.hidden_size, m.vocab_size
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    comp: dict[str, list[int]] = {}

    def add(name, total, active):
        t = comp.setdefault(name, [0, 0])
        t[0] += total
        t[1] += active

    add("embedding", V * H, H)
    if not m.tie_word_embeddings:
        add("lm_head", V * H, V * H)
    else:
        add("lm_head (tied)", 0, V * H)
    if getattr(m, "lm_head_bias", False):
        add("lm_head", V, V)
    norm = 2 * H if getattr(m, "norm_bias", False) else H  # LayerNorm: weight and bias
    add("norms", norm, norm)
    unpicked = 0
    for l in range(m.num_layers):
        attn = H * q + 2 * H * kv + q * H
        if m.qkv_bias:
            attn += q + 2 * kv
        if getattr(m, "attn_out_bias", False):
            attn += H
        if m.qk_norm:
            attn += 2 * m.head_dim
        add("attention", attn, attn)
        add("norms", 2 * norm, 2 * norm)
        if m.moe_layers[l]:
            E, I, k = m.num_experts, m.expert_intermediate_size, m.top_k
            add("router", E * H, E * H)
            add("routed experts", E * 3 * H * I, k * 3 * H * I)
            unpicked += (E - k) * 3 * H * I
            S = m.shared_expert_intermediate_size
            if S:
                add("shared experts", 3 * H * S, 3 * H * S)
            if m.shared_expert_gate:
                add("shared expert gate", H, H)
        else:
            D = m.dense_intermediate_size
            add("dense MLP", 3 * H * D, 3 * H * D)
    total = sum(t for t, _ in comp.values())
    active = sum(a for _, a in comp.values())
    return ParamCount(total, active, {k: (t, a) for k, (t, a) in comp.items()}, activated=total - unpicked)
