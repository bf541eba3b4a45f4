"""Router kinds: how a MoE layer turns its router logits into top-k expert picks and their weights,
one function each, looked up by the model's ``normalization_mode`` (TensorRT-LLM's MoeConfig):

* NONE: top-k of the softmax over all experts (weights not renormalized);
* RENORMALIZE: softmax over the top-k logits;
* SPARSE_MIXER (Phi-3.5-MoE): each pick's weight is a softmax over the logits within a relative
  margin of it.

A kind maps ``(logits [N, E] float32, k, cfg)`` to ``(weights [N, k], ids [N, k], probs)``, where
``probs`` is the softmax over every expert when the kind computed it anyway (None otherwise: the
routing statistics then compute it themselves). A new kind (grouped top-k, say) is one function and
one entry in ``KINDS``. ``RouterOverride`` is a what-if applied around any kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError, UnsupportedError
from ..model.description import NORM_NONE, NORM_RENORMALIZE, NORM_SPARSE_MIXER


def softmax_topk(logits: torch.Tensor, k: int, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    probs = logits.softmax(-1)
    w, idx = probs.topk(k, dim=-1)
    return w, idx, probs


def topk_softmax(logits: torch.Tensor, k: int, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    top, idx = logits.topk(k, dim=-1)
    return top.softmax(-1), idx, None


def _sparse_mixer_picks(logits: torch.Tensor, k: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-mixer routing (inference form): pick the best remaining expert k times; each pick's
    weight is its softmax share among the logits within a relative margin 2·eps of it (the others,
    and earlier picks, masked out)."""
    masked = logits
    ws, idxs = [], []
    for _ in range(k):
        top, idx = masked.max(-1, keepdim=True)
        far = (top - logits) / logits.abs().clamp(min=top) > 2 * eps
        ws.append(masked.masked_fill(far, -math.inf).softmax(-1).gather(-1, idx))
        idxs.append(idx)
        masked = masked.scatter(-1, idx, -math.inf)
    return torch.cat(ws, -1), torch.cat(idxs, -1)


def sparse_mixer(logits: torch.Tensor, k: int, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    w, idx = _sparse_mixer_picks(logits, k, cfg.sparse_mixer_epsilon)
    return w, idx, None


KINDS = {NORM_NONE: softmax_topk, NORM_RENORMALIZE: topk_softmax, NORM_SPARSE_MIXER: sparse_mixer}


def router_for(cfg):
    """The router kind of ``cfg`` (a ModelSpec)."""
    kind = KINDS.get(cfg.normalization_mode)
    if kind is None:
        raise UnsupportedError(f"router normalization mode {cfg.normalization_mode} is not supported by the "
                               "embedded engine")
    return kind


@dataclass(frozen=True)
class RouterOverride:
    """A what-if on routing (``EmbeddedEngine.router_override``): ``top_k`` picks per token instead of
    the model's, router logits divided by ``temperature`` before the model's own normalization, and a
    per-expert capacity of ceil(``capacity_factor`` · tokens · k / experts) picks per forward block:
    as in capacity-limited MoE serving, the tokens of a block claim places in order (row by row,
    position by position, a token's picks best first) and a pick over its expert's capacity is
    dropped (the expert adds nothing for that token; the residual stream passes on)."""

    top_k: int | None = None
    temperature: float = 1.0
    capacity_factor: float | None = None

    def __post_init__(self):
        if self.top_k is not None and self.top_k < 1:
            raise InputError(f"router override top_k must be ≥ 1, got {self.top_k}")
        if not self.temperature > 0:
            raise InputError(f"router temperature must be > 0, got {self.temperature}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise InputError(f"capacity factor must be > 0, got {self.capacity_factor}")

    def keep(self, idx: torch.Tensor, num_experts: int) -> torch.Tensor | None:
        """[N, k] bool: the picks within their expert's capacity (None: no capacity limit)."""
        if self.capacity_factor is None:
            return None
        n, k = idx.shape
        cap = math.ceil(self.capacity_factor * n * k / num_experts)
        flat = idx.reshape(-1)
        # Each pick's place in its expert's queue: how many earlier picks chose the same expert.
        place = F.one_hot(flat, num_experts).cumsum(0).gather(1, flat[:, None]).squeeze(1)
        return (place <= cap).view(n, k)
