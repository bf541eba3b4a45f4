"""Admission: waiting requests join the running batch between decode steps, several prefilled in
one padded forward when the engine has ``start_many``, within a prefill time budget per iteration.
Runs on the batcher thread only."""

from __future__ import annotations

import time
from typing import Any

from .delivery import TokenDelivery
from .requests import BatchRequest
from .settings import BatcherSettings
from .state import BatchState, log


class Admission:
    """Takes waiting requests into ``state.active``: prefill, first token, failures per request."""

    def __init__(self, engine: Any, state: BatchState, settings: BatcherSettings, delivery: TokenDelivery):
        self.engine = engine
        self.state = state
        self.settings = settings
        self.delivery = delivery

    def take(self, room: int) -> list[BatchRequest]:
        """Up to ``room`` waiting requests whose padded prompt block (count x longest prompt) stays
        within ``max_prefill_tokens`` (at least one); cancelled ones are answered and skipped."""
        state = self.state
        batch: list[BatchRequest] = []
        longest = 0
        while len(batch) < room:
            with state.cv:
                if not state.waiting:
                    break
                req = state.waiting[0]
                n = max(longest, len(req.prompt_ids))
                if batch and n * (len(batch) + 1) > self.settings.max_prefill_tokens:
                    break
                state.waiting.popleft()
            if req._cancel:
                self.delivery.cancelled(req)
                continue
            batch.append(req)
            longest = n
        return batch

    def prefill(self, batch: list[BatchRequest]) -> list[tuple[BatchRequest, Any, BaseException | None]]:
        """Prefill ``batch`` in one engine call when the engine can; if that fails (or it cannot),
        one request at a time so a bad request fails alone."""
        now = time.monotonic_ns()
        for req in batch:
            req.first_scheduled_ns = now
        many = getattr(self.engine, "start_many", None)
        if len(batch) > 1 and many is not None:
            try:
                seqs = many([r.prompt_ids for r in batch], [r.params for r in batch])
                return [(r, s, None) for r, s in zip(batch, seqs)]
            except Exception as e:  # noqa: BLE001 - retried one by one below
                log.info("batched prefill of %d requests failed (%s); prefilling one by one", len(batch), e)
        out = []
        for req in batch:
            try:
                out.append((req, self.engine.start(req.prompt_ids, req.params), None))
            except Exception as e:  # noqa: BLE001 - per-request failure
                out.append((req, None, e))
        return out

    def admit(self) -> None:
        """Admit while there is room, stopping once this iteration's prefills took the budget (about
        one decode step unless ``prefill_budget_s`` says otherwise) and someone is decoding."""
        state, size = self.state, self.settings.max_batch_size
        budget = self.settings.prefill_budget_s
        if budget is None:
            budget = max(state.last_step_s, 0.002)
        spent = 0.0
        while len(state.active) < size:
            batch = self.take(size - len(state.active))
            if not batch:
                return
            t0 = time.perf_counter()
            results = self.prefill(batch)
            spent += time.perf_counter() - t0
            for req, seq, error in results:
                if error is not None:
                    self.delivery.fail(req, error)
                    continue
                req.seq = seq
                state.prefilled_tokens += len(req.prompt_ids)
                self.delivery.deliver(req, list(seq.tokens))
                if not req.finished:
                    state.active.append(req)
            self.delivery.flush()  # first tokens go out now, not after the rest of the admissions
            # Requests already streaming should not wait for more than ~one step of prefills.
            if state.active and spent >= budget:
                return
