"""The MoE layer: routing (the model's router kind, a routing what-if, the statistics record and the
hooks), the routed experts run grouped by expert, and the shared expert; and the dense layers' gated
MLP. The functions take the engine for its configuration, hooks, router kind and statistics."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .experts import STACK_MAX_ROWS
from .layers import Layer


def moe_forward(eng, li: int, lay: Layer, x: torch.Tensor, valid: torch.Tensor | None = None,
                stats: list | None = None) -> torch.Tensor:
    """MoE layer ``li`` of ``eng`` over ``x`` [..., H]: route, run the picked experts, add the
    shared expert. ``valid`` [B, T] marks the real tokens of a padded batch; ``stats``: a list that
    collects this block's routing record (added with the block's others afterwards), None to add it
    at once. Calls the engine's hooks and applies its ``router_override``."""
    if valid is not None:  # a padded batch: route and run only the real tokens
        out = torch.zeros_like(x)
        out[valid] = eng._moe(li, lay, x[valid], stats=stats)
        return out
    c = eng.cfg
    shape = x.shape
    h = x.reshape(-1, shape[-1])
    if eng.layer_hook is not None:
        eng.layer_hook(li, h)
    logits = lay.router(h if h.dtype == torch.float32 else h.float())
    ov, top_k, keep = eng.router_override, c.top_k, None
    if ov is not None:
        top_k = min(ov.top_k or top_k, c.num_experts)
        if ov.temperature != 1.0:
            logits = logits / ov.temperature
    # probs: the router probabilities, where routing itself needs them (else None)
    w, idx, probs = eng.router_kind(logits, top_k, c)
    if ov is not None:
        keep = ov.keep(idx, c.num_experts)
        if keep is not None:
            w = w * keep
    one = h.shape[0] == 1 and not h.requires_grad and stats is not None
    flat_idx = None if one else idx.reshape(-1)
    with torch.no_grad():
        # A small block's statistics are added for every layer together after the forward
        # (expert counts included); a one-token block needs no counts to group by.
        n_e = None if one else torch.bincount(flat_idx, minlength=c.num_experts)
        if stats is None:
            eng._routing.record([(li, n_e, logits.softmax(-1) if probs is None else probs, flat_idx, w)])
        else:  # the probabilities of a deferred record are computed when it is added
            stats.append((li, n_e, logits if probs is None else probs, idx, w, probs is None))
        if eng.route_hook is not None:
            eng.route_hook(li, idx if keep is None else idx.masked_fill(~keep, -1))
    if w.dtype != h.dtype:
        w = w.to(h.dtype)
    if one:
        # One token: its k experts run on it directly, in expert order, each output weighted
        # and summed (the same arithmetic as the grouped path below, without the grouping).
        picks = sorted((e, j) for j, e in enumerate(idx.tolist()[0]))
        ws = w.unbind(1)  # [1] each
        out = None
        for (e, j), y in zip(picks, lay.experts.forward_picks(h, [e for e, _ in picks])):
            y = y * ws[j]
            out = y if out is None else out.add_(y)
        return moe_tail(eng, li, lay, h, idx, w, out, shape)
    # Group the (token, pick) pairs by expert with one stable sort, run every expert with
    # tokens over its contiguous block, and add the weighted outputs back in one indexed op
    # (in expert order, as a loop over the experts would).
    order = flat_idx.argsort(stable=True)
    token_of = order // idx.shape[1]
    counts = n_e.tolist()
    w_sorted = w.reshape(-1)[order, None]
    if len(token_of) <= STACK_MAX_ROWS:
        # One token: each of its experts reads it as it is (a [1, H] view, no gathered copy).
        xs = h.expand(len(token_of), h.shape[1]) if h.shape[0] == 1 else h[token_of]
        y = lay.experts.forward_grouped(xs, counts)  # a new tensor: weighted in place (no autograd)
        y = y * w_sorted if y.requires_grad else y.mul_(w_sorted)
        out = torch.zeros_like(h).index_add_(0, token_of, y)
    else:  # a big block (prefill): expert by expert, without a copy of every routed row
        out, start = torch.zeros_like(h), 0
        for e, n in enumerate(counts):
            if n:
                tok = token_of[start:start + n]
                out.index_add_(0, tok, lay.experts.forward(e, h[tok]) * w_sorted[start:start + n])
                start += n
    return moe_tail(eng, li, lay, h, idx, w, out, shape)

def moe_tail(eng, li: int, lay: Layer, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
             out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The routed experts' output ``out`` plus the shared expert (gated where the model has the gate),
    seen by the engine's ``moe_hook``, in the input's shape."""
    if lay.shared_fc is not None:
        hs = lay.shared_fc(h)
        up, gate = hs.chunk(2, dim=-1)
        s = lay.shared_proj(F.silu(gate) * up)
        if lay.shared_gate is not None:
            s = torch.sigmoid(lay.shared_gate(h)) * s
        out = out + s
    if eng.moe_hook is not None:
        eng.moe_hook(li, h, idx, w, out)
    return out.reshape(shape)


def dense_mlp(lay: Layer, x: torch.Tensor) -> torch.Tensor:
    """A dense layer's gated MLP (TensorRT-LLM's GatedMLP: fc activated, gate linear)."""
    return lay.dense_down(F.silu(lay.dense_gate(x)) * lay.dense_up(x))
