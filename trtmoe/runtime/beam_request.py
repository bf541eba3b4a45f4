"""A beam-search request in the embedded engine: its sequence (``BeamSequence``), the cache row per
beam forked from the prompt's, and each step's reordering of the rows after the parents the search
(``trtmoe.runtime.beam``, TensorRT-LLM's rules) picked."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .beam import BeamState, Hypothesis
from .kvcache import KVPool, attach, copy_rows, detach
from .sampling import Sequence, process_logits


@dataclass
class BeamSequence(Sequence):
    """One beam-search request (``params.beam_width`` > 1). Its own cache row holds the prompt during
    the prefill; then each live beam is a ``Sequence`` of its own (``beams``), the first on that row,
    the others on rows forked from it, and every step reorders the rows after the parents the search
    picked. ``tokens`` are the best-ranked beam's so far (at the end: the best result's);
    ``results()`` gives the ranked beams the request returns."""

    beams: list[Sequence] = field(default_factory=list, repr=False)
    state: BeamState | None = field(default=None, repr=False)
    # With return_generation_logits, once finished: [K, steps, vocab] float32, the raw logits of each
    # cache slot's beam at each step (the prompt's last position for the first), in slot order as
    # TensorRT-LLM keeps them (not re-ranked like the results).
    beam_generation_logits: torch.Tensor | None = field(default=None, repr=False)

    def results(self) -> list[Hypothesis]:
        return self.state.result(self.params.num_return_beams or self.params.beam_width)


def beam_log_probs(beams: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """[K, V] float32: each beam's log-softmax, then the request's logit steps applied to the
    log-probs over that beam's own history (TensorRT-LLM's order; see trtmoe.runtime.beam)."""
    lp = torch.log_softmax(logits.float(), -1)
    return torch.stack([process_logits(r, lp[i]) for i, r in enumerate(beams)])


def start_beams(pool: KVPool, s: BeamSequence, logits: torch.Tensor) -> None:
    """After the prefill: fork the prompt's cache row into one row per beam and take the first
    step of the search (only the first beam proposes)."""
    K = s.params.beam_width
    first = Sequence(s.prompt, s.params, slot=s.slot, length=s.length, kv_capacity=s.kv_capacity)
    s.beams = [first]
    try:
        for _ in range(K - 1):  # their rows get the prompt's cache when the first step picks parents
            r = Sequence(s.prompt, s.params, length=s.length)
            attach(pool, r, len(s.prompt) + s.params.max_new_tokens)
            s.beams.append(r)
    except BaseException:
        for r in s.beams[1:]:
            detach(pool, r)
        detach(pool, s)
        raise
    s.kv_capacity = sum(r.kv_capacity for r in s.beams)
    s.generation_logits = []  # the prefill's row went here; each slot's rows are kept by its beam
    if s.params.return_generation_logits:
        for r in s.beams:
            r.generation_logits = [logits.detach().to("cpu", torch.float32, copy=True)]
    lp = beam_log_probs([first], logits[None])
    reorder_beams(pool, s, s.state.advance(lp.expand(K, -1)))


def advance_beams(pool: KVPool, s: BeamSequence, logits: torch.Tensor) -> None:
    """One decode step's logits [K, V] of the live beams: the search's next step."""
    reorder_beams(pool, s, s.state.advance(beam_log_probs(s.beams, logits)))


def reorder_beams(pool: KVPool, s: BeamSequence, parents: list[int]) -> None:
    """Give beam i the cache row of its parent (a gather, so rows may swap), its tokens and
    history counts; finish the request when the search is done or out of tokens."""
    slots = [r.slot for r in s.beams]
    if parents != list(range(len(parents))):
        copy_rows(pool, slots, [slots[p] for p in parents])
    for r, toks in zip(s.beams, s.state.tokens):
        r.tokens = list(toks)
        r._counts, r._counted = None, 0
    best = s.state.result(1)
    s.tokens = list(best[0].tokens) if best else []
    if s.state.done or s.state.all_stopped or s.state.generated >= s.params.max_new_tokens:
        s.finished, s.finish_reason = True, "stop" if s.state.done or s.state.all_stopped else "length"
        res = s.results()
        s.tokens = list(res[0].tokens) if res else []
        s.log_probs = list(res[0].log_probs) if res else []
        s.cum_log_prob = res[0].cum_log_prob if res else 0.0
        if s.params.return_generation_logits:
            s.beam_generation_logits = torch.stack([torch.stack(r.generation_logits) for r in s.beams])
        for r in s.beams:
            detach(pool, r)
        s.beams = []
        detach(pool, s)
