"""Beam search as TensorRT-LLM 1.2's C++ runtime decides it (the decoder behind ``trtllm-build``
engines and the Triton backend), restated for the embedded engine. Pure torch on one request's rows;
the engine runs the forward and keeps each beam's KV cache (``EmbeddedEngine`` forks and reorders
them from the parents this module picks).

One step, for a request of width K with live beams b = 0..K-1 of equal length:

1. Each beam's row of *log-probabilities* (log-softmax of the logits) goes through the request's
   logit steps in TensorRT-LLM's order, on the log-probs themselves: embedding bias, 1/temperature,
   the repetition / presence / frequency penalties over the prompt and that beam's own tokens, the
   end id masked while ``min_tokens`` is unmet, bad words banned. top_k, top_p and seed play no part.
2. Candidates are (beam, token) pairs valued ``cum[b] + lp[b, token]``, ranked by that value plus
   ``diversity_rate × b``; the best 2K are walked in rank order. At the first step (right after the
   prompt) every beam is the same, so only beam 0 proposes (the others start at -1e20).
3. An end-id candidate ranked among the first K becomes a finished hypothesis, scored
   ``value / L^len_penalty`` with L its generated tokens counting the end id (no division when the
   penalty is 0 or L is 1); at most K are kept, a better one replacing the worst. One ranked K or
   later is ignored. Every other candidate continues as the next live beam until K are chosen.
   A live beam whose tokens end with one of the request's stop words is finished: at the next step
   it proposes only the end id, at its cumulative value (log-prob 0), so it is kept as a hypothesis
   when that ranks within the first K and dropped otherwise.
4. The request is done once K hypotheses are kept and ``early_stopping`` is 1, or, for other
   values, when the worst kept score is at least the best candidate's value penalised at its length
   (for ``early_stopping`` > 1 with a positive penalty, at the longest length the engine allows).
   It also ends at ``max_new_tokens``, or when every live beam has met a stop word: the live beams
   then join the hypotheses (scored at their generated length, no end id), and the best K by score,
   in descending order, are the result.

Outputs per returned beam (the top ``min(num_return_sequences, K)``): the generated tokens without
the end id, the raw cumulative log-prob (the end id's included, never length-normalised) and one
log-prob per output token. A streamed response carries every beam's tokens so far, ranked as if the
request stopped there, so a beam's earlier tokens may change from one response to the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NEG_INF_CUM = -1e20  # the cumulative log-prob of the beams that must not propose at the first step


@dataclass
class Hypothesis:
    """A beam as it would be returned: generated tokens (no end id), raw cumulative log-prob, one
    log-prob per token, and the length-penalised score it is ranked by."""

    tokens: list[int]
    cum_log_prob: float
    log_probs: list[float]
    score: float


def length_penalised(value: float, length: int, len_penalty: float) -> float:
    """TensorRT-LLM's applyLengthPenalty: ``value / length^len_penalty`` unless the penalty is 0 or
    the length is 1."""
    if len_penalty == 0.0 or length == 1:
        return value
    return value / float(length) ** len_penalty


def top_candidates(values: torch.Tensor, n: int) -> list[int]:
    """Indices of the ``n`` largest ``values``, best first, ties to the lower index: what a stable
    descending sort of all of them gives, but sorting only those at or above the n-th value (a
    full sort of beams x vocabulary costs 10-110 ms a step at 32k-152k tokens)."""
    n = min(n, values.numel())
    kth = values.topk(n).values[-1]
    cand = (values >= kth).nonzero().squeeze(1)  # ascending: the stable sort keeps lower indices first
    return cand[torch.sort(values[cand], descending=True, stable=True).indices][:n].tolist()


@dataclass
class BeamState:
    """The search state of one request: live beams (tokens, cumulative and per-token log-probs) and
    the finished hypotheses kept so far."""

    width: int
    end_id: int | None
    len_penalty: float = 0.0
    early_stopping: int = 1
    diversity_rate: float = 0.0
    max_length: int = 0  # generated tokens the engine could still allow (early_stopping > 1)
    stop_words: list[list[int]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    cum: list[float] = field(default_factory=list)
    log_probs: list[list[float]] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False  # ended by the early-stopping rule (the live beams are then not returned)
    stopped: list[bool] = field(default_factory=list)  # live beams that met a stop word

    def __post_init__(self) -> None:
        if not self.cum:
            self.tokens = [[] for _ in range(self.width)]
            self.log_probs = [[] for _ in range(self.width)]
            self.cum = [0.0] + [NEG_INF_CUM] * (self.width - 1)
        if not self.stopped:
            self.stopped = [False] * self.width

    @property
    def all_stopped(self) -> bool:
        """Every live beam met a stop word: nothing is left to decode."""
        return all(self.stopped)

    @property
    def generated(self) -> int:
        """Tokens every live beam holds (they all have the same length)."""
        return len(self.tokens[0])

    def advance(self, lp: torch.Tensor) -> list[int]:
        """One step from the processed log-probs ``lp`` [K, V] of the live beams; returns, for each new
        live beam, the index of the beam it continues (its KV cache is that beam's). The new beams'
        tokens, cumulative and per-token log-probs are updated here."""
        K = self.width
        lp = lp.double()
        V = lp.shape[1]
        if any(self.stopped):  # a beam that met a stop word proposes only the end id, at log-prob 0
            lp = lp.clone()
            for b in (b for b, s in enumerate(self.stopped) if s):
                lp[b] = -float("inf")
                if self.end_id is not None:
                    lp[b, self.end_id] = 0.0
        values = lp + torch.tensor(self.cum, dtype=torch.float64)[:, None]
        rank = values + self.diversity_rate * torch.arange(K, dtype=torch.float64)[:, None] if self.diversity_rate \
            else values
        order = top_candidates(rank.reshape(-1), 2 * K)
        parents: list[int] = []
        new_tokens: list[list[int]] = []
        new_cum: list[float] = []
        new_lps: list[list[float]] = []
        flat = values.reshape(-1)
        for i, c in enumerate(order):
            b, tok = divmod(c, V)
            val = float(flat[c])
            if val <= NEG_INF_CUM / 2:  # a beam that may not propose (first step) or a banned token
                continue
            if self.end_id is not None and tok == self.end_id:
                if i < K:
                    self._keep(Hypothesis(list(self.tokens[b]), val, list(self.log_probs[b]),
                                          length_penalised(val, self.generated + 1, self.len_penalty)))
                continue
            parents.append(b)
            new_tokens.append(self.tokens[b] + [tok])
            new_cum.append(val)
            new_lps.append(self.log_probs[b] + [val - self.cum[b]])
            if len(parents) == K:
                break
        while len(parents) < K:  # fewer usable candidates than beams (a tiny vocabulary): repeat the last
            parents.append(parents[-1] if parents else 0)
            new_tokens.append(list(new_tokens[-1]) if new_tokens else list(self.tokens[0]) + [0])
            new_cum.append(NEG_INF_CUM)
            new_lps.append(list(new_lps[-1]) if new_lps else list(self.log_probs[0]) + [NEG_INF_CUM])
        best = float(flat[order[0]]) if order else NEG_INF_CUM
        self.tokens, self.cum, self.log_probs = new_tokens, new_cum, new_lps
        self.stopped = [any(len(t) >= len(w) and t[len(t) - len(w):] == w for w in self.stop_words) for t in new_tokens]
        self.done = self._stop_rule(best)
        return parents

    def _keep(self, h: Hypothesis) -> None:
        if len(self.finished) < self.width:
            self.finished.append(h)
            return
        worst = min(range(len(self.finished)), key=lambda j: self.finished[j].score)
        if h.score > self.finished[worst].score:
            self.finished[worst] = h

    def _stop_rule(self, best: float) -> bool:
        if len(self.finished) < self.width:
            return False
        if self.early_stopping == 1:
            return True
        length = self.generated  # the best candidate's generated length, counting its new token
        if self.early_stopping > 1 and self.len_penalty > 0:
            length = max(self.max_length, length)
        return min(h.score for h in self.finished) >= length_penalised(best, length, self.len_penalty)

    def result(self, count: int | None = None) -> list[Hypothesis]:
        """The best ``count`` beams (default: the width) as if the request ended now: the kept
        hypotheses plus, unless the stop rule ended it, the live beams, by descending score."""
        pool = list(self.finished)
        if not self.done:
            pool += [Hypothesis(list(t), c, list(l), length_penalised(c, len(t), self.len_penalty))
                     for t, c, l in zip(self.tokens, self.cum, self.log_probs) if c > NEG_INF_CUM / 2]
        pool.sort(key=lambda h: h.score, reverse=True)  # stable: earlier entries first on ties
        return pool[: count or self.width]
