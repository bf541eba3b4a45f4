"""Router what-ifs, measured on held-out text with the embedded engine: what serving with fewer picks
per token (top-k − 1), a router temperature, or a per-expert capacity (tokens over it dropped, as
capacity-limited MoE serving does) does to the model's output and to where its tokens go.

Each what-if reruns the reference checkpoint with ``EmbeddedEngine.router_override`` set and is
compared position by position with the unmodified run on the same windows:

* ``kl``: mean KL(p_ref ‖ p_what-if) of the next-token distributions, nats (± its standard error);
* ``same_top1``: share of positions whose most likely next token is unchanged;
* ``dropped``: share of the model's expert places (tokens × MoE layers × k) where the what-if runs no
  expert: the place top-k − 1 leaves out (exactly 1/k), or a pick over its expert's capacity;
* ``rerouted``: share of (token, MoE layer) pairs where the what-if runs an expert the unmodified model
  did not pick there (a changed hidden state routes elsewhere downstream).

A capacity is per forward block (``batch_size`` windows of ``seq_len`` tokens), ceil(factor · tokens
· k / experts) picks per expert; the block's tokens claim places window by window, position by
position.
"""

from __future__ import annotations

import math

import torch

from ..quant.calibrate import kl_per_token
from ..runtime.engine import EmbeddedEngine, RouterOverride

DEFAULT_TEMPERATURES = (0.5, 2.0)
DEFAULT_CAPACITY_FACTORS = (1.0, 1.25, 2.0)


def default_what_ifs(top_k: int, temperatures=DEFAULT_TEMPERATURES,
                     capacity_factors=DEFAULT_CAPACITY_FACTORS) -> list[tuple[str, RouterOverride]]:
    """The knobs: top-k − 1 (where k > 1), each temperature, each capacity factor."""
    out = [(f"top-{top_k - 1} (k − 1)", RouterOverride(top_k=top_k - 1))] if top_k > 1 else []
    out += [(f"temperature {t:g}", RouterOverride(temperature=t)) for t in temperatures]
    out += [(f"capacity {f:g}", RouterOverride(capacity_factor=f)) for f in capacity_factors]
    return out


@torch.inference_mode()
def _run(eng: EmbeddedEngine, ids: torch.Tensor, batch_size: int, override: RouterOverride | None):
    """Log-probs [N, T, V] and per MoE layer the experts run per token [N·T, k'] (-1: dropped)."""
    routes: dict[int, list[torch.Tensor]] = {}
    eng.route_hook = lambda li, idx: routes.setdefault(li, []).append(idx.clone())
    eng.router_override = override
    try:
        logp = torch.cat([eng.logits(b).log_softmax(-1) for b in ids.split(batch_size)])
    finally:
        eng.route_hook = None
        eng.router_override = None
    return logp, {l: torch.cat(r) for l, r in routes.items()}


def measure_what_ifs(eng: EmbeddedEngine, ids: torch.Tensor, *, batch_size: int = 8,
                     what_ifs: list[tuple[str, RouterOverride]] | None = None, progress=None) -> dict:
    """The what-ifs' held-out KL, top-1 agreement, dropped and re-routed shares (see the module
    docstring) on windows ``ids`` [N, T]. The engine's routing statistics are reset afterwards (its
    passes here are not traffic)."""
    c = eng.cfg
    k, E = c.top_k, c.num_experts
    what_ifs = what_ifs if what_ifs is not None else default_what_ifs(k)
    ref_logp, ref_routes = _run(eng, ids, batch_size, None)
    layers = sorted(ref_routes)
    ref_sets = {l: _membership(ref_routes[l], E) for l in layers}
    top1 = ref_logp.argmax(-1)
    rows = []
    for i, (name, ov) in enumerate(what_ifs):
        logp, routes = _run(eng, ids, batch_size, ov)
        kl = kl_per_token(ref_logp, logp).flatten()
        n = kl.numel()
        run = rerouted = pairs = 0
        for l in layers:
            ran = _membership(routes[l], E)
            run += int((routes[l] >= 0).sum())
            rerouted += int((ran & ~ref_sets[l]).any(-1).sum())
            pairs += ran.shape[0]
        rows.append({"name": name, "top_k": ov.top_k or k, "temperature": ov.temperature,
                     "capacity_factor": ov.capacity_factor,
                     "kl": {"mean": float(kl.mean()), "stderr": float(kl.std() / math.sqrt(n)) if n > 1 else 0.0,
                            "p99": float(kl.quantile(0.99)) if n > 1 else float(kl.max())},
                     "same_top1": float((logp.argmax(-1) == top1).double().mean()),
                     "dropped": 1.0 - run / (pairs * k) if pairs else 0.0,
                     "rerouted": rerouted / pairs if pairs else 0.0})
        if progress:
            progress(i + 1, len(what_ifs))
    eng.reset_routing_stats()
    return {"tokens": int(ids.numel()), "windows": int(ids.shape[0]), "seq_len": int(ids.shape[1]),
            "batch_size": batch_size, "top_k": k, "num_experts": E, "what_ifs": rows,
            "capacity_group": f"a forward block of {batch_size} windows × {ids.shape[1]} tokens"}


def _membership(idx: torch.Tensor, E: int) -> torch.Tensor:
    """[tokens, k'] expert ids (-1 = none) -> [tokens, E] bool: the experts run for each token."""
    out = torch.zeros(idx.shape[0], E + 1, dtype=torch.bool)
    out.scatter_(1, idx.long().clamp_min(-1) % (E + 1), True)  # -1 lands in the spare column E
    return out[:, :E]

