"""Cancellation: ids cancelled before their request arrived, the watcher thread that polls each
request's ``is_cancelled``, and the batcher thread's removal of cancelled requests."""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from typing import Sequence

from ..threads import name_native_thread
from .delivery import TokenDelivery
from .requests import BatchRequest
from .settings import BatcherSettings
from .state import BatchState


class CancelWatch:
    """Flags cancelled requests (by id, by remembered id, by polling) and answers them.

    ``remember``, ``mark_remembered`` and ``start_watching`` are called with ``state.cv`` held;
    ``watch`` is the watcher thread's body; ``drop_cancelled`` runs on the batcher thread.
    """

    def __init__(self, state: BatchState, settings: BatcherSettings, delivery: TokenDelivery):
        self.state = state
        self.settings = settings
        self.delivery = delivery
        self._remembered: OrderedDict[str, float] = OrderedDict()  # id -> when it was cancelled (monotonic s)
        self._watcher: threading.Thread | None = None

    # -- any thread, state.cv held ---------------------------------------------------------------
    def remember(self, request_id: str) -> None:
        """Keep ``request_id`` (newest last) for ``remember_cancel_s``, at most ``max_remembered_cancels``."""
        now = time.monotonic()
        self._remembered[request_id] = now
        self._remembered.move_to_end(request_id)
        old = self._remembered
        while old and (len(old) > self.settings.max_remembered_cancels
                       or next(iter(old.values())) < now - self.settings.remember_cancel_s):
            old.popitem(last=False)

    def mark_remembered(self, reqs: Sequence[BatchRequest]) -> None:
        """Flag the requests whose cancel came first: they are answered before any prefill."""
        for req in reqs:
            if req.request_id in self._remembered:
                req._cancel = True

    def start_watching(self, reqs: Sequence[BatchRequest]) -> None:
        """Start the watcher thread the first time a request brings an ``is_cancelled``."""
        if any(req.is_cancelled is not None for req in reqs) and self._watcher is None:
            self._watcher = threading.Thread(target=self.watch, name=self.settings.name + "-cancel", daemon=True)
            self._watcher.start()

    # -- watcher thread ----------------------------------------------------------------------------
    def watch(self) -> None:
        """Polls ``is_cancelled`` of every queued and running request, about once per decode step
        (bounded by the check periods), and flags the cancelled ones for the loop."""
        name_native_thread("trtmoe-cancel")
        state, settings = self.state, self.settings
        while True:
            with state.cv:
                if state.closed:
                    return
                reqs = [r for r in itertools.chain(state.waiting, state.active)
                        if r.is_cancelled is not None and not r._cancel and not r.finished]
            found = False
            now = time.monotonic()
            step = min(settings.cancel_check_period_s, max(state.last_step_s, settings.min_cancel_check_period_s))
            wait = settings.cancel_check_period_s
            for r in reqs:
                if r.cancel_poll_s is not None:
                    due = r._polled_at + r.cancel_poll_s
                    if now < due:
                        wait = min(wait, due - now)
                        continue
                    wait = min(wait, r.cancel_poll_s)
                else:
                    wait = min(wait, step)
                r._polled_at = now
                with r._lock:
                    if r.finished:  # its final event may be out: the sender must not be asked again
                        continue
                    try:
                        cancelled = bool(r.is_cancelled())
                    except Exception:  # noqa: BLE001 - a dead sender means nobody is listening
                        cancelled = True
                if cancelled:
                    r._cancel = found = True
            if found:
                with state.cv:
                    state.cv.notify()
            time.sleep(max(wait, settings.min_cancel_check_period_s))

    # -- batcher thread ----------------------------------------------------------------------------
    def drop_cancelled(self) -> None:
        """Answer the cancelled requests, running or still waiting (so a cancelled request gives back
        its place in the queue at once, not when a slot frees)."""
        state = self.state
        with state.cv:
            gone = [r for r in state.waiting if r._cancel]
            if gone:
                state.waiting = deque(r for r in state.waiting if not r._cancel)
        for r in gone:
            self.delivery.cancelled(r)
        keep = []
        for r in state.active:
            if r.finished:
                continue
            if r._cancel:
                self.delivery.cancelled(r, r._unsent)
            else:
                keep.append(r)
        state.active = keep
