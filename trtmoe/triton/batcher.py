"""In-flight batcher: one background thread owns the engine and runs decode steps over every active
request; new requests join the running batch between steps.

The engine contract (``trtmoe.runtime.engine.EmbeddedEngine``) is small::

    seq = engine.start(prompt_ids, params)   # prefill + first token; seq.tokens, seq.finished
    seqs = engine.start_many(prompts, params_list)  # optional: several prefills in one call
    new = engine.step([seq, ...])            # one batched decode step; appends to each seq.tokens

Each iteration of the loop

1. drops cancelled requests (running or waiting),
2. admits waiting requests (prefill, several in one padded forward when the engine has
   ``start_many``) while fewer than ``max_batch_size`` are active, stopping once the prefill time
   spent this iteration exceeds the budget (about one decode step), so requests that are already
   streaming see at most one extra step of latency when others join,
3. runs one ``step`` over all active sequences and delivers the new tokens to each request's
   callback: every step, or with ``stream_interval`` N > 1 every N tokens (the first token and the
   last event are never held back), which divides the per-response cost downstream (IPC,
   detokenization, network) by N when many streams share the machine. ``stream_interval=0``
   (auto) streams every token while at most ``responses_per_step`` sequences are active and
   otherwise every ceil(active / responses_per_step) tokens, so a step never produces more than
   about that many responses.

Cancellation: ``cancel()`` (or ``BatchRequest.cancel``) only sets a flag, read before every step; it
takes no room in the waiting queue, so a full queue never refuses one. ``cancel(id, remember=True)``
(for ids that name one generation, such as the ensemble's request keys) also keeps the id for a
while, so a request submitted with it afterwards (a cancel that overtook its request) is answered
as cancelled before its prefill. A request's ``is_cancelled`` callable (a Triton response
sender's, an IPC call) is polled by a watcher thread about once per decode step, never on the
decode thread, so a cancelled request leaves the batch before the next step after the poll that
sees it, and polling never stalls decoding.

Memory: once the loop has had no request for ``trim_after_idle_s``, it calls the engine's
``trim_memory()`` (when it has one) once, so what a burst allocated is returned to the system while
idle rather than held until the next burst (a CPU engine keeps freed memory for reuse while busy).

Errors stay per request: a failing prefill, a failing sequence inside ``step`` (found by retrying the
batch one sequence at a time) or a callback that raises ends that request only; the loop goes on.

``InflightBatcher`` composes small pieces (``trtmoe.triton.inflight``): its options are one
``BatcherSettings``; ``TokenDelivery`` sends tokens, ``CancelWatch`` polls and answers cancels,
``Admission`` prefills joining requests and ``DecodeLoop`` is the batcher thread, all sharing one
``BatchState`` (the queues, their lock, the counters).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Sequence

from .inflight.admission import Admission
from .inflight.cancels import CancelWatch
from .inflight.delivery import TokenDelivery
from .inflight.loop import DecodeLoop
from .inflight.requests import (FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, BatcherClosed,
                                BatchRequest, Callback, QueueFull, TokenEvent)
from .inflight.settings import AUTO_RESPONSES_PER_STEP, BatcherSettings
from .inflight.state import FINISHED_LENGTHS_KEPT, BatchState

__all__ = ["AUTO_RESPONSES_PER_STEP", "FINISHED_LENGTHS_KEPT", "FINISH_CANCELLED", "FINISH_ERROR", "FINISH_LENGTH",
           "FINISH_STOP", "BatchRequest", "BatcherClosed", "BatcherSettings", "Callback", "InflightBatcher",
           "QueueFull", "TokenEvent"]


class InflightBatcher:
    """Owns ``engine`` on a background thread; see the module docstring.

    Options come as one ``BatcherSettings`` or as its fields by keyword
    (``InflightBatcher(engine, max_batch_size=4, stream_interval=0)``), not both.
    ``on_iteration(batcher)``: called on the batcher thread after every step (metrics).
    ``on_flush()``: called on the batcher thread after each burst of callbacks (a prefill's first
    token, a step's tokens), so a consumer that queues events can wake its sender once per burst.
    """

    def __init__(self, engine: Any, settings: BatcherSettings | None = None, *,
                 on_iteration: Callable[["InflightBatcher"], None] | None = None,
                 on_flush: Callable[[], None] | None = None, **options: Any):
        if settings is None:
            settings = BatcherSettings(**options)
        elif not isinstance(settings, BatcherSettings):
            raise TypeError(f"settings must be a BatcherSettings, got {type(settings).__name__}")
        elif options:
            raise TypeError(f"give options in settings or by keyword, not both: {sorted(options)}")
        self.settings = settings
        self.engine = engine
        self._state = state = BatchState()
        self._cv = state.cv
        self._ids = itertools.count()
        self._delivery = TokenDelivery(state, settings, on_flush)
        self._cancels = CancelWatch(state, settings, self._delivery)
        hook = None if on_iteration is None else (lambda: on_iteration(self))
        self._loop = DecodeLoop(engine, state, settings, self._delivery, self._cancels,
                                Admission(engine, state, settings, self._delivery), hook)
        self._thread = threading.Thread(target=self._loop.run, name=settings.name, daemon=True)
        self._thread.start()

    # -- public API (any thread) -------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: Any, callback: Callback, *,
               stop_sequences: Sequence[Sequence[int]] = (), request_id: str = "",
               is_cancelled: Callable[[], bool] | None = None,
               cancel_poll_s: float | None = None) -> BatchRequest:
        """Queue a request; ``callback`` gets a TokenEvent per new token and a final one when done.
        ``cancel_poll_s``: poll this request's ``is_cancelled`` at most this often (for requests
        whose cancels mostly arrive by ``cancel(id)``, so the poll is only a fallback); None: about
        once per decode step."""
        return self.submit_all([dict(prompt_ids=prompt_ids, params=params, callback=callback,
                                     stop_sequences=stop_sequences, request_id=request_id,
                                     is_cancelled=is_cancelled, cancel_poll_s=cancel_poll_s)])[0]

    def submit_all(self, requests: Sequence[dict]) -> list[BatchRequest]:
        """Queue several requests (each a dict of ``submit``'s arguments) all or none: QueueFull
        (nothing queued) unless every one fits among ``max_waiting``, so a batched client request
        is never left half running."""
        reqs = []
        for r in requests:
            stops = r.get("stop_sequences", ())
            reqs.append(BatchRequest(
                prompt_ids=[int(t) for t in r["prompt_ids"]], params=r["params"], callback=r["callback"],
                stop_sequences=tuple(tuple(int(t) for t in s) for s in stops if len(s)),
                request_id=r.get("request_id") or f"req-{next(self._ids)}", is_cancelled=r.get("is_cancelled"),
                cancel_poll_s=r.get("cancel_poll_s"), arrival_ns=time.monotonic_ns()))
        state, max_waiting = self._state, self.settings.max_waiting
        with state.cv:
            if state.closed:
                raise BatcherClosed("the batcher is shut down")
            self._cancels.mark_remembered(reqs)  # their cancel came first: answered before any prefill
            queued = sum(not req._cancel for req in reqs)
            if queued and max_waiting and len(state.waiting) + queued > max_waiting:
                # TensorRT-LLM's executor words this refusal so ("Maximum queue size of N has been
                # reached, ..."), and upstream's clients look for it, or for Triton's own wording.
                raise QueueFull(f"Maximum queue size of {max_waiting} has been reached, please try again later "
                                f"(Exceeds maximum queue size: {len(state.waiting)} requests are already waiting"
                                + (f"; this one brings {queued}" if queued > 1 else "") + ")")
            state.waiting.extend(reqs)
            state.cv.notify()
            self._cancels.start_watching(reqs)
        return reqs

    def cancel(self, request_id: str, *, remember: bool = False) -> bool:
        """Cancel every queued or running request with this id; True if one was found. ``remember``:
        the id names one generation (never reused), so also cancel requests submitted with it
        during the next ``remember_cancel_s`` seconds."""
        found = False
        state = self._state
        with state.cv:
            for r in itertools.chain(state.waiting, state.active):
                if r.request_id == request_id:
                    r.cancel()
                    found = True
            if remember:
                self._cancels.remember(request_id)
            state.cv.notify()
        return found

    @property
    def max_batch_size(self) -> int:
        return self.settings.max_batch_size

    @property
    def num_active(self) -> int:
        return len(self._state.active)

    @property
    def num_waiting(self) -> int:
        return len(self._state.waiting)

    @property
    def trims(self) -> int:
        """How often the engine's memory was trimmed while idle."""
        return self._state.trims

    def stats(self) -> dict[str, int]:
        return self._state.stats()

    def take_finished_lengths(self) -> list[tuple[int, int]]:
        """(prompt tokens, generated tokens) of the requests finished since the last call (at most
        ``FINISHED_LENGTHS_KEPT``, the latest, when nobody took them)."""
        return self._state.take_finished_lengths()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; every unfinished request gets a final error event."""
        with self._state.cv:
            self._state.closed = True
            self._state.cv.notify()
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()
