"""The batcher thread: wait for work (or for the idle hook and memory trim), then one iteration:
drop cancelled requests, admit waiting ones, run one decode step over the batch, deliver its tokens.
Failures stay per request; on shutdown every unfinished request gets a final error event."""

from __future__ import annotations

import time
from typing import Any, Callable

from ..cpu_binding import bind_this_thread
from ..threads import name_native_thread
from .admission import Admission
from .cancels import CancelWatch
from .delivery import TokenDelivery
from .requests import BatchRequest, BatcherClosed
from .settings import BatcherSettings
from .state import BatchState, log


class DecodeLoop:
    """Owns the engine on the batcher thread (``run``); ``on_iteration`` runs after every iteration
    and, while idle, every ``idle_callback_period_s``."""

    def __init__(self, engine: Any, state: BatchState, settings: BatcherSettings, delivery: TokenDelivery,
                 cancels: CancelWatch, admission: Admission, on_iteration: Callable[[], None] | None):
        self.engine = engine
        self.state = state
        self.settings = settings
        self.delivery = delivery
        self.cancels = cancels
        self.admission = admission
        self.on_iteration = on_iteration
        self._trim_at: float | None = None  # when to call the engine's trim_memory, once idle

    def step(self) -> None:
        """One batched decode step; when it raises, each sequence alone, so only the bad ones fail."""
        state = self.state
        active = [r for r in state.active if not r.finished]
        if not active:
            state.active = []
            return
        before = [len(r.seq.tokens) for r in active]
        t0 = time.perf_counter()
        try:
            self.engine.step([r.seq for r in active])
            failed: list[tuple[BatchRequest, BaseException]] = []
        except Exception as batch_error:  # noqa: BLE001 - isolate the failing sequence(s)
            log.warning("batched step failed (%s); retrying sequences one by one", batch_error)
            failed = []
            for r, n in zip(active, before):
                if len(r.seq.tokens) != n:
                    continue  # this one advanced before the failure
                try:
                    self.engine.step([r.seq])
                except Exception as e:  # noqa: BLE001
                    failed.append((r, e))
        state.last_step_s = time.perf_counter() - t0
        bad = {id(r) for r, _ in failed}
        for r, e in failed:
            self.delivery.fail(r, e)
        for r, n in zip(active, before):
            if id(r) in bad:
                continue
            self.delivery.deliver(r, [int(t) for t in r.seq.tokens[n:]])
        state.active = [r for r in active if not r.finished]
        state.iterations += 1

    def trim(self) -> None:
        """Return what the engine holds for reuse (``trim_memory``, when it has one)."""
        trim = getattr(self.engine, "trim_memory", None)
        if trim is None:
            return
        try:
            trim()
            self.state.trims += 1
        except Exception:  # noqa: BLE001 - never let the loop die
            log.exception("engine trim_memory failed")

    def _wait(self, next_idle_cb: float) -> bool | None:
        """Block until there is work, the idle hook or the trim is due, or the batcher closes.
        Returns None once closed, else whether the iteration starts idle."""
        state = self.state
        with state.cv:
            while not state.closed and not state.waiting and not state.active:
                timeout = self.settings.idle_callback_period_s if self.on_iteration else None
                if self._trim_at is not None:
                    left = self._trim_at - time.monotonic()
                    if left <= 0:
                        break  # idle long enough: trim below, outside the lock
                    timeout = left if timeout is None else min(timeout, left)
                if not state.cv.wait(timeout) and self.on_iteration and time.monotonic() >= next_idle_cb:
                    break  # periodic idle call so gauges settle
            if state.closed:
                return None
            return not state.waiting and not state.active  # else this iteration has work

    def _iterate(self) -> None:
        state = self.state
        try:
            self.cancels.drop_cancelled()
            self.admission.admit()
            self.step()
        except Exception as e:  # noqa: BLE001 - never let the loop die
            log.exception("batcher iteration failed")
            for r in state.active:
                if not r.finished:
                    self.delivery.fail(r, e)
            state.active = []
        self.delivery.flush()

    def run(self) -> None:
        """The batcher thread's body."""
        name_native_thread("trtmoe-decode")
        cores = self.settings.cpu_cores
        if cores:  # before the first torch op, so the intra-op workers it starts inherit them
            try:
                bind_this_thread(cores)
            except OSError as e:
                log.warning("could not move the decode thread to cores %s: %s", sorted(cores), e)
        next_idle_cb = 0.0
        while True:
            idle = self._wait(next_idle_cb)
            if idle is None:
                break
            if idle and self._trim_at is not None and time.monotonic() >= self._trim_at:
                self._trim_at = None
                self.trim()
                continue
            self._iterate()
            if not idle and not self.state.active and self.settings.trim_after_idle_s is not None:
                self._trim_at = time.monotonic() + self.settings.trim_after_idle_s  # idle from now on
            if self.on_iteration is not None:
                try:
                    self.on_iteration()
                except Exception:  # noqa: BLE001
                    log.exception("on_iteration hook failed")
                next_idle_cb = time.monotonic() + self.settings.idle_callback_period_s
        self._close()

    def _close(self) -> None:
        """Every request still waiting or running gets a final error event."""
        state = self.state
        closed = BatcherClosed("the server is shutting down")
        with state.cv:
            pending = list(state.waiting) + [r for r in state.active if not r.finished]
            state.waiting.clear()
            state.active = []
        for r in pending:
            self.delivery.fail(r, closed)
        self.delivery.flush()
