"""Batched generation on the embedded engine: admitting requests (checks, a cache row each, one
right-padded prefill for several prompts, a repeated prompt prefilled once), batched decode steps
over sequences of different lengths, beam-search requests as rows of the batch, and ``generate``.

``Batching`` is a part of ``EmbeddedEngine``: it runs the engine's ``_forward`` over its KV pool.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import InputError
from .beam import BeamState
from .beam_request import BeamSequence, advance_beams, start_beams
from .kvcache import attach, copy_rows, detach
from .sampling import SamplingParams, Sequence, accept, greedy_batch, keep_generation_logits, sample


class Batching:
    # ---- one row's steps (kept as methods: callers and tests reach them through the engine) ----------
    _sample = staticmethod(sample)
    _accept = staticmethod(accept)

    def _finish_if_done(self, s: Sequence) -> None:
        if s.finished:
            detach(self._kv, s)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InputError if a request cannot run on this engine."""
        if not prompt_ids:
            raise InputError("empty prompt")
        params.validate(self.vocab_size)
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} outside the vocabulary (0..{self.vocab_size - 1})")
        need = len(prompt_ids) + params.max_new_tokens
        if need > self.max_seq_len:
            raise InputError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                             f"{need} exceeds the engine's max_seq_len {self.max_seq_len}")

    def _new_sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self.check_request(prompt_ids, params)
        if params.beam_width > 1:
            return BeamSequence(list(map(int, prompt_ids)), params, state=BeamState(
                params.beam_width, params.end_id, params.len_penalty, params.early_stopping, params.diversity_rate,
                max_length=self.max_seq_len - len(prompt_ids), stop_words=[list(w) for w in params.stop_words]))
        s = Sequence(list(map(int, prompt_ids)), params)
        if params.temperature > 0:
            s.generator = torch.Generator().manual_seed(
                params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return s

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Prefill a new sequence and sample its first token."""
        return self.start_many([prompt_ids], [params])[0]

    @torch.inference_mode()
    def start_many(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
        """Prefill several new sequences in one right-padded forward and sample each one's first
        token. Padding is never routed, counted or cached as history. Raises InputError (nothing is
        kept) if any request cannot run; the caller can then start them one by one."""
        if len(prompts) != len(params) or not prompts:
            raise InputError(f"start_many needs one SamplingParams per prompt (got {len(prompts)} prompts, "
                             f"{len(params)} params)")
        seqs = [self._new_sequence(p, sp) for p, sp in zip(prompts, params)]
        lens = [len(s.prompt) for s in seqs]
        # A prompt that occurs more than once (a request's num_return_sequences, clients sending the
        # same prompt) is prefilled once; its other sequences copy that cache row.
        first: dict[tuple[int, ...], int] = {}
        rep = [first.setdefault(tuple(s.prompt), b) for b, s in enumerate(seqs)]
        uniq = [b for b in range(len(seqs)) if rep[b] == b]
        row_of = {b: i for i, b in enumerate(uniq)}
        U, T = len(uniq), max(lens)
        try:
            for s in seqs:
                attach(self._kv, s, len(s.prompt) + s.params.max_new_tokens)
            ids = torch.zeros(U, T, dtype=torch.long)
            for i, b in enumerate(uniq):
                ids[i, :lens[b]] = torch.tensor(seqs[b].prompt)
            ids = ids.to(self.device)
            pos = torch.arange(T, device=self.device).expand(U, T)
            ulens = [lens[b] for b in uniq]
            valid = None
            if min(ulens) < T:
                valid = torch.arange(T, device=self.device)[None] < torch.tensor(ulens, device=self.device)[:, None]
            # Every cache row starts empty: a causal mask over the padded block is each prompt's own.
            context = {row_of[rep[b]]: None for b, s in enumerate(seqs) if s.params.return_context_logits} or None
            logits = self._forward(ids, pos, [seqs[b] for b in uniq], valid=valid, last=[n - 1 for n in ulens],
                                   all_positions=context)
            if U < len(seqs):
                dups = [b for b in range(len(seqs)) if rep[b] != b]
                copy_rows(self._kv, [seqs[b].slot for b in dups], [seqs[rep[b]].slot for b in dups])
                logits = logits[torch.tensor([row_of[rep[b]] for b in range(len(seqs))], device=logits.device)]
        except BaseException:
            for s in seqs:
                detach(self._kv, s)
            raise
        for b, s in enumerate(seqs):
            if s.params.return_context_logits:
                s.context_logits = context[row_of[rep[b]]].cpu()
        keep_generation_logits(seqs, logits[:, 0])
        greedy = greedy_batch(seqs, logits[:, 0])
        for b, s in enumerate(seqs):
            s.length = lens[b]
            if isinstance(s, BeamSequence):
                start_beams(self._kv, s, logits[b, 0])
                continue
            accept(s, greedy[b] if greedy[b] is not None else sample(s, logits[b, 0]))
            self._finish_if_done(s)
        return seqs

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[int]:
        """One batched decode step for each unfinished sequence; returns the new token of each."""
        self._kv.drain()  # slots of sequences collected on other threads since the last step
        live = [s for s in seqs if not s.finished]
        if not live:
            return []
        if any(s.slot < 0 for s in live):
            raise InputError("a sequence whose KV cache was released cannot be stepped")
        # A beam-search request decodes its live beams as rows of the batch.
        rows = [r for s in live for r in (s.beams if isinstance(s, BeamSequence) else (s,))]
        lr = self.cfg.longrope
        for s in rows:
            if lr is not None and s.length == lr["original_max_position_embeddings"]:
                self._rerotate(s)
        logits = self._decode_logits(rows)
        keep_generation_logits(rows, logits)
        toks = greedy_batch(rows, logits)
        out = []
        b = 0
        for s in live:
            if isinstance(s, BeamSequence):
                n = len(s.beams)
                for r in s.beams:
                    r.length += 1
                advance_beams(self._kv, s, logits[b:b + n])
                b += n
                out.append(s.tokens[-1] if s.tokens else -1)
                continue
            s.length += 1
            tok = toks[b] if toks[b] is not None else sample(s, logits[b])
            b += 1
            accept(s, tok)
            self._finish_if_done(s)
            out.append(tok)
        return out

    def _decode_logits(self, rows: list[Sequence]) -> torch.Tensor:
        """[len(rows), V] float32 logits of one decode step over ``rows``, in their order.

        A serving batch lists its sequences in arrival order while their slots are reused lowest
        first, so a steady batch usually holds a contiguous block of slots in some other order.
        Such a batch runs in slot order, where every layer reads its keys and values as a view of
        the pool rather than gathering them, and the logits are put back in the caller's order."""
        slots = [s.slot for s in rows]
        block = list(range(min(slots), min(slots) + len(slots)))
        order = None
        if slots != block and sorted(slots) == block:
            order = sorted(range(len(rows)), key=slots.__getitem__)
            rows = [rows[i] for i in order]
        ids_pos = torch.tensor([[s.last_token, s.length] for s in rows], device=self.device)
        logits = self._forward(ids_pos[:, :1], ids_pos[:, 1:], rows,
                               decode=sum(s.length for s in rows) + len(rows))[:, -1]
        if order is None:
            return logits
        # Row i of the caller is row slots[i] - min(slots) of the slot-ordered batch.
        return logits.index_select(0, torch.tensor([sl - block[0] for sl in slots], device=logits.device))

    def _rerotate(self, s: Sequence) -> None:
        """A LongRoPE sequence about to pass original_max_position_embeddings: its cached keys were
        rotated with the short factors, so its history is computed again into its cache row with the
        long ones (the model's own generation drops its cache there and runs the whole sequence),
        and the step's token is then decoded against it like any other. The recomputation adds
        nothing to the routing statistics."""
        saved = self._routing.save()
        hist = s.prompt + s.tokens[:-1]  # what the cache holds: every token but the one to decode
        n = s.length
        s.length = 0
        ids = torch.tensor([hist], device=self.device)
        self._forward(ids, torch.arange(n, device=self.device)[None], [s], last=[n - 1], rope_lengths=[n + 1])
        s.length = n
        self._routing.restore(saved)

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
        """Generate for one prompt; ``on_token`` is called with each new token id."""
        params = params or SamplingParams()
        s = self.start(prompt_ids, params)
        emitted = 0
        while True:
            if on_token:
                for t in s.tokens[emitted:]:
                    on_token(t)
            emitted = len(s.tokens)
            if s.finished:
                return list(s.tokens)
            self.step([s])
