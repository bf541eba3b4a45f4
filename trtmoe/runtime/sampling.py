"""Sampling: a request's settings (``SamplingParams``), its running state (``Sequence``) and the
per-row logit processing and draws, in TensorRT-LLM's order (embedding bias, temperature, penalties,
min_tokens, bad words; then greedy argmax or top-k / top-p sampling)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import InputError


@dataclass
class SamplingParams:
    """Generation settings. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None
    min_tokens: int = 0
    # Logit processing, in TensorRT-LLM's order: embedding_bias is added, the temperature divides
    # (``greedy_temperature`` for a greedy request: it changes the argmax only through the additive
    # penalties), then every token id seen in the prompt or the generated tokens is penalised:
    # repetition divides a positive logit and multiplies a negative one, presence subtracts once,
    # frequency subtracts once per occurrence. The end id is then masked inside ``min_tokens``, and
    # each bad word's last token is masked when the sequence ends with the rest of the word.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    greedy_temperature: float = 1.0
    bad_words: list[list[int]] = field(default_factory=list)
    embedding_bias: torch.Tensor | None = None  # [vocab] float, added to the logits
    # Record each chosen token's log-probability under the processed distribution (full-vocabulary
    # softmax after the steps above, before top-k/top-p): Sequence.log_probs / cum_log_prob.
    return_log_probs: bool = False
    # TensorRT-LLM's return_context_logits / return_generation_logits: keep the prompt's per-position
    # logits from the prefill (Sequence.context_logits) and each sampled step's raw logits, before any
    # of the steps above, as the sampler received them (Sequence.generation_logits). Neither changes
    # which tokens are chosen, nor takes a row out of the batched greedy argmax.
    return_context_logits: bool = False
    return_generation_logits: bool = False
    # Beam search (trtmoe.runtime.beam, TensorRT-LLM's rules) when beam_width > 1: top_k, top_p and
    # the seed play no part; the temperature scales the log-probs (``greedy_temperature``).
    # ``num_return_beams``: how many of the ranked beams a result returns (default: all).
    beam_width: int = 1
    len_penalty: float = 0.0
    early_stopping: int = 1
    diversity_rate: float = 0.0
    num_return_beams: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)  # beam search's own (each beam's tokens)

    def __post_init__(self) -> None:
        if self.embedding_bias is not None and not isinstance(self.embedding_bias, torch.Tensor):
            self.embedding_bias = torch.as_tensor(self.embedding_bias, dtype=torch.float32).reshape(-1)
        self.bad_words = [[int(t) for t in w] for w in self.bad_words]

    @property
    def processed(self) -> bool:
        """Whether a row needs any of the per-row steps above (it then leaves the batched greedy argmax)."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                    or self.bad_words or self.embedding_bias is not None or self.return_log_probs
                    or self.beam_width > 1)

    def validate(self, vocab_size: int) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:  # NaN fails every comparison
            raise InputError(f"temperature must be a finite number ≥ 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be ≥ 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.end_id is not None and not 0 <= self.end_id < vocab_size:
            raise InputError(f"end_id {self.end_id} outside the vocabulary (0..{vocab_size - 1})")
        if not self.repetition_penalty > 0:
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.greedy_temperature < math.inf:
            raise InputError(f"temperature must be a finite number ≥ 0, got {self.greedy_temperature}")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "len_penalty", "diversity_rate"):
            if not math.isfinite(getattr(self, name)):
                raise InputError(f"{name} must be finite, got {getattr(self, name)}")
        for w in self.bad_words:
            if not w or any(not 0 <= int(t) < vocab_size for t in w):
                raise InputError(f"bad word {list(w)} is empty or outside the vocabulary (0..{vocab_size - 1})")
        if self.embedding_bias is not None and tuple(self.embedding_bias.shape) != (vocab_size,):
            raise InputError(f"embedding_bias has shape {list(self.embedding_bias.shape)}; "
                             f"it must have the vocabulary size [{vocab_size}]")
        if self.beam_width < 1:
            raise InputError(f"beam_width must be ≥ 1, got {self.beam_width}")
        if self.beam_width > 1:
            if self.len_penalty < 0 or self.early_stopping < 0 or self.diversity_rate < 0:
                raise InputError("len_penalty, early_stopping and beam_search_diversity_rate must be ≥ 0, got "
                                 f"{self.len_penalty}, {self.early_stopping}, {self.diversity_rate}")
            if self.num_return_beams is not None and not 1 <= self.num_return_beams <= self.beam_width:
                raise InputError(f"num_return_sequences {self.num_return_beams} must be between 1 and the beam "
                                 f"width {self.beam_width} in beam search")


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    slot: int = -1  # row of the engine's KV pool; -1 once released
    length: int = 0  # tokens held in the KV cache
    kv_capacity: int = 0  # tokens of the pool row reserved for it when it was admitted
    generator: torch.Generator | None = field(default=None, repr=False)
    log_probs: list[float] = field(default_factory=list)  # one per token, when return_log_probs
    cum_log_prob: float = 0.0  # their sum, plus the end id's when generation stopped on it
    context_logits: torch.Tensor | None = field(default=None, repr=False)  # [prompt, vocab] float32
    # One [vocab] float32 row per decoding step (the step that chose the end id included).
    generation_logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    _counts: torch.Tensor | None = field(default=None, repr=False)  # occurrences of each id in history
    _counted: int = 0  # generated tokens already in _counts
    _release: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def last_token(self) -> int:
        return self.tokens[-1] if self.tokens else self.prompt[-1]


def process_logits(s: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """The per-row logit steps of SamplingParams (bias, temperature, penalties, min_tokens,
    bad words) on one row of logits, as a new float tensor."""
    p = s.params
    x = logits.float().clone()
    if p.embedding_bias is not None:
        if p.embedding_bias.device != x.device or p.embedding_bias.dtype != x.dtype:
            p.embedding_bias = p.embedding_bias.to(device=x.device, dtype=x.dtype)  # once per request
        x += p.embedding_bias
    t = p.temperature if p.temperature > 0 else p.greedy_temperature
    if t != 1.0:
        x /= max(t, 1e-6)
    if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        if s._counts is None:
            s._counts = torch.bincount(torch.tensor(s.prompt, dtype=torch.long), minlength=x.numel())
            s._counts = s._counts[: x.numel()].to(x.device)
        if s._counted < len(s.tokens):
            new = torch.tensor(s.tokens[s._counted:], dtype=torch.long, device=x.device)
            s._counts.index_add_(0, new, torch.ones_like(new))
            s._counted = len(s.tokens)
        seen = s._counts > 0
        if p.repetition_penalty != 1.0:
            r = p.repetition_penalty
            x = torch.where(seen, torch.where(x < 0, x * r, x / r), x)
        if p.presence_penalty != 0.0:
            x = x - p.presence_penalty * seen.to(x.dtype)
        if p.frequency_penalty != 0.0:
            x = x - p.frequency_penalty * s._counts.to(x.dtype)
    if p.end_id is not None and len(s.tokens) < p.min_tokens:
        x[p.end_id] = -float("inf")
    if p.bad_words:
        hist = s.prompt + s.tokens
        for w in p.bad_words:
            n = len(w) - 1
            if n == 0 or (n <= len(hist) and hist[len(hist) - n:] == list(w[:n])):
                x[w[-1]] = -float("inf")
    return x


def sample(s: Sequence, logits: torch.Tensor) -> int:
    """The next token of ``s`` from its row of logits [V] under its SamplingParams."""
    p = s.params
    if p.processed:
        x = process_logits(s, logits)
        if p.temperature == 0:
            tok = int(x.argmax())
        else:
            tok = draw(s, x)
        if p.return_log_probs:
            lp = float(torch.log_softmax(x, -1)[tok])
            s.cum_log_prob += lp
            if not (p.end_id is not None and tok == p.end_id and len(s.tokens) >= p.min_tokens):
                s.log_probs.append(lp)  # the end id is not an output token
        return tok
    logits = logits.float()
    if p.end_id is not None and len(s.tokens) < p.min_tokens:
        logits[p.end_id] = -float("inf")
    if p.temperature == 0:
        return int(logits.argmax())
    return draw(s, logits / p.temperature)


def draw(s: Sequence, logits: torch.Tensor) -> int:
    """Top-k / top-p sampling from temperature-scaled logits."""
    p = s.params
    if p.top_k:
        kth = logits.topk(min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        keep = sp.cumsum(0) - sp < p.top_p
        probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    return int(torch.multinomial(probs.cpu(), 1, generator=s.generator))


def accept(s: Sequence, tok: int) -> None:
    """Append ``tok`` to ``s`` (or stop on its end id) and finish it when its budget is spent."""
    p = s.params
    if p.end_id is not None and tok == p.end_id and len(s.tokens) >= p.min_tokens:
        s.finished, s.finish_reason = True, "stop"
        return
    s.tokens.append(tok)
    if len(s.tokens) >= p.max_new_tokens:
        s.finished, s.finish_reason = True, "length"


def keep_generation_logits(seqs: list[Sequence], logits: torch.Tensor) -> None:
    """Record this step's raw logits row [V] of each sequence that asked for them (before the
    sampler, which may mask a row in place)."""
    for b, s in enumerate(seqs):
        if s.params.return_generation_logits:
            s.generation_logits.append(logits[b].detach().to("cpu", torch.float32, copy=True))


def greedy_batch(live: list[Sequence], logits: torch.Tensor) -> list[int | None]:
    """Argmax of every greedy row in one op (None for sampled rows); an end id still inside
    its sequence's ``min_tokens`` is masked out first, as ``sample`` does."""
    rows = [b for b, s in enumerate(live) if s.params.temperature == 0 and not s.params.processed]
    out: list[int | None] = [None] * len(live)
    if not rows:
        return out
    sub = logits[rows] if len(rows) < len(live) else logits
    for i, b in enumerate(rows):
        p = live[b].params
        if p.end_id is not None and len(live[b].tokens) < p.min_tokens:
            if sub is logits:  # the caller's logits stay as they are
                sub = logits.clone()
            sub[i, p.end_id] = -float("inf")
    for b, t in zip(rows, sub.argmax(-1).tolist()):
        out[b] = t
    return out
