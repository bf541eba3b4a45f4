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
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .cpu_binding import bind_this_thread
from .threads import name_native_thread

log = logging.getLogger(__name__)

# The auto stream interval's target number of responses per decode step: 4 streams get every token,
# 8 streams every 2nd, 32 every 8th. Measured with scripts/bench_peers.py on 2 cores: 8 instead of 4
# gave 30-44% fewer tokens/s at 8 streams and 16-27% fewer at 32, 2 gave chunkier streams for
# little more.
AUTO_RESPONSES_PER_STEP = 4

# Finished requests' lengths kept for the token-length histograms between two metrics updates.
FINISHED_LENGTHS_KEPT = 4096

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


@dataclass
class TokenEvent:
    """What a request's callback receives: tokens new since the last event, and whether it is done."""

    request: "BatchRequest"
    new_tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: BaseException | None = None


Callback = Callable[[TokenEvent], None]


@dataclass(eq=False)
class BatchRequest:
    """One sequence being generated. Times are ``time.monotonic_ns()`` values (ns)."""

    prompt_ids: list[int]
    params: Any
    callback: Callback
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    request_id: str = ""
    is_cancelled: Callable[[], bool] | None = None
    # Longest wait between two is_cancelled polls of this request; None = about once per decode step.
    cancel_poll_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    arrival_ns: int = 0
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    finished: bool = False
    finish_reason: str | None = None
    seq: Any = None
    _unsent: list[int] = field(default_factory=list)
    _cancel: bool = False
    _polled_at: float = 0.0  # monotonic s of the latest is_cancelled poll
    # Held by the watcher around an is_cancelled() call and by the batcher when it finishes the
    # request: no poll starts after the final event, so none can reach a Triton response sender
    # whose final response went out (Triton 2.51's server then reads freed memory and crashes).
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def cancel(self) -> None:
        """Ask the batcher to drop this request before its next step."""
        self._cancel = True


class BatcherClosed(RuntimeError):
    """The batcher was shut down; no new requests are accepted."""


class QueueFull(RuntimeError):
    """More requests are waiting than ``max_waiting`` allows."""


class InflightBatcher:
    """Owns ``engine`` on a background thread; see the module docstring.

    ``max_batch_size``: sequences decoded together (the engine's build limit).
    ``max_waiting``: requests allowed to wait for a slot; 0 means unbounded.
    ``prefill_budget_s``: prefill time allowed per iteration while others are decoding; ``None``
    adapts it to the last decode step's duration (at least 2 ms).
    ``on_iteration(batcher)``: called on the batcher thread after every step (metrics).
    ``cancel_check_period_s``: the longest wait between two polls of a request's ``is_cancelled`` (it
    may be an IPC call); the watcher polls once per decode step when steps are shorter (at least
    ``min_cancel_check_period_s`` apart).
    ``stream_interval``: deliver tokens every this many; 0 = auto (see the module docstring).
    ``responses_per_step``: the auto interval's target number of responses per decode step.
    ``max_prefill_tokens``: size of one batched prefill (requests x longest prompt, padded); an
    engine with ``start_many(prompts, params)`` prefills the waiting requests that fit together.
    ``on_flush()``: called on the batcher thread after each burst of callbacks (a prefill's first
    token, a step's tokens), so a consumer that queues events can wake its sender once per burst.
    ``remember_cancel_s`` / ``max_remembered_cancels``: how long, and how many, ids cancelled with
    ``remember=True`` are kept for requests that arrive after their cancel.
    ``trim_after_idle_s``: idle time after which the engine's ``trim_memory()`` is called (once per
    idle period; None never).
    ``cpu_cores``: cores the batcher thread moves itself to when it starts (see
    ``trtmoe.triton.cpu_binding``); None leaves it where it is.
    """

    def __init__(self, engine: Any, *, max_batch_size: int, max_waiting: int = 0,
                 prefill_budget_s: float | None = None, on_iteration: Callable[["InflightBatcher"], None] | None = None,
                 cancel_check_period_s: float = 0.1, idle_callback_period_s: float = 1.0,
                 stream_interval: int = 1, responses_per_step: int = AUTO_RESPONSES_PER_STEP,
                 on_flush: Callable[[], None] | None = None,
                 max_prefill_tokens: int = 1024, name: str = "trtmoe-inflight-batcher",
                 min_cancel_check_period_s: float = 0.005, remember_cancel_s: float = 600.0,
                 max_remembered_cancels: int = 16384, trim_after_idle_s: float | None = 2.0,
                 cpu_cores: set[int] | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if stream_interval < 0:
            raise ValueError(f"stream_interval must be >= 0 (0 = auto), got {stream_interval}")
        if responses_per_step < 1:
            raise ValueError(f"responses_per_step must be >= 1, got {responses_per_step}")
        self.cpu_cores = cpu_cores
        self.stream_interval = stream_interval
        self.responses_per_step = responses_per_step
        self.on_flush = on_flush
        self.max_prefill_tokens = max_prefill_tokens
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.prefill_budget_s = prefill_budget_s
        self.on_iteration = on_iteration
        self.cancel_check_period_s = cancel_check_period_s
        self.min_cancel_check_period_s = min(min_cancel_check_period_s, cancel_check_period_s)
        self._watcher: threading.Thread | None = None
        self.idle_callback_period_s = idle_callback_period_s
        self._waiting: deque[BatchRequest] = deque()
        self.remember_cancel_s = remember_cancel_s
        self.max_remembered_cancels = max_remembered_cancels
        self._remembered: OrderedDict[str, float] = OrderedDict()  # id -> when it was cancelled (monotonic s)
        self._active: list[BatchRequest] = []
        self._cv = threading.Condition()
        self._closed = False
        self._ids = itertools.count()
        self._last_step_s = 0.0
        self.trim_after_idle_s = trim_after_idle_s
        self._trim_at: float | None = None  # when to call the engine's trim_memory, once idle
        self.trims = 0
        # Counters read by metrics; written only by the batcher thread.
        self.iterations = 0
        self.generated_tokens = 0
        self.prefilled_tokens = 0
        self.completed_requests = 0
        self.failed_requests = 0
        # (prompt tokens, generated tokens) of each request finished since the metrics last took them;
        # appended by the batcher thread, taken by the metrics thread (deque ends are thread-safe).
        self._finished_lengths: deque[tuple[int, int]] = deque(maxlen=FINISHED_LENGTHS_KEPT)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
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
        with self._cv:
            if self._closed:
                raise BatcherClosed("the batcher is shut down")
            for req in reqs:
                if req.request_id in self._remembered:  # its cancel came first: answered before any prefill
                    req._cancel = True
            queued = sum(not req._cancel for req in reqs)
            if queued and self.max_waiting and len(self._waiting) + queued > self.max_waiting:
                # TensorRT-LLM's executor words this refusal so ("Maximum queue size of N has been
                # reached, ..."), and upstream's clients look for it, or for Triton's own wording.
                raise QueueFull(f"Maximum queue size of {self.max_waiting} has been reached, please try again later "
                                f"(Exceeds maximum queue size: {len(self._waiting)} requests are already waiting"
                                + (f"; this one brings {queued}" if queued > 1 else "") + ")")
            self._waiting.extend(reqs)
            self._cv.notify()
            if any(req.is_cancelled is not None for req in reqs) and self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_cancelled, name=self._thread.name + "-cancel",
                                                 daemon=True)
                self._watcher.start()
        return reqs

    def cancel(self, request_id: str, *, remember: bool = False) -> bool:
        """Cancel every queued or running request with this id; True if one was found. ``remember``:
        the id names one generation (never reused), so also cancel requests submitted with it
        during the next ``remember_cancel_s`` seconds."""
        found = False
        with self._cv:
            for r in itertools.chain(self._waiting, self._active):
                if r.request_id == request_id:
                    r.cancel()
                    found = True
            if remember:
                now = time.monotonic()
                self._remembered[request_id] = now
                self._remembered.move_to_end(request_id)
                old = self._remembered
                while old and (len(old) > self.max_remembered_cancels
                               or next(iter(old.values())) < now - self.remember_cancel_s):
                    old.popitem(last=False)
            self._cv.notify()
        return found

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict[str, int]:
        return dict(active=len(self._active), waiting=len(self._waiting), iterations=self.iterations,
                    generated_tokens=self.generated_tokens, prefilled_tokens=self.prefilled_tokens,
                    completed_requests=self.completed_requests, failed_requests=self.failed_requests)

    def take_finished_lengths(self) -> list[tuple[int, int]]:
        """(prompt tokens, generated tokens) of the requests finished since the last call (at most
        ``FINISHED_LENGTHS_KEPT``, the latest, when nobody took them)."""
        out = []
        while self._finished_lengths:
            out.append(self._finished_lengths.popleft())
        return out

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; every unfinished request gets a final error event."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- batcher thread ------------------------------------------------------------------------
    def _emit(self, req: BatchRequest, new: list[int], *, finished: bool = False, reason: str | None = None,
              error: BaseException | None = None) -> bool:
        """Deliver an event; a callback that raises cancels its own request. Returns False then."""
        if finished:
            with req._lock:  # waits for a poll in progress (see BatchRequest._lock)
                req.finished, req.finish_reason = True, reason
        try:
            req.callback(TokenEvent(req, new, finished, reason, error))
            return True
        except Exception as e:  # noqa: BLE001 - a broken consumer must not stop the loop
            log.warning("callback of %s failed (%s); cancelling it", req.request_id, e)
            req.cancel()
            if not finished:
                with req._lock:
                    req.finished, req.finish_reason = True, FINISH_CANCELLED
            return False

    def _flush(self) -> None:
        if self.on_flush is not None:
            try:
                self.on_flush()
            except Exception:  # noqa: BLE001 - a consumer's wake-up must not stop the loop
                log.exception("on_flush hook failed")

    def _fail(self, req: BatchRequest, error: BaseException) -> None:
        self.failed_requests += 1
        self._emit(req, [], finished=True, reason=FINISH_ERROR, error=error)

    def _stop_hit(self, req: BatchRequest) -> bool:
        toks = req.tokens
        return any(len(toks) >= len(s) and tuple(toks[-len(s):]) == s for s in req.stop_sequences)

    def _deliver(self, req: BatchRequest, new: list[int]) -> None:
        """Record new tokens and send them; finish on engine end, length, or a stop sequence."""
        now = time.monotonic_ns()
        if not req.first_token_ns:
            req.first_token_ns = now
        req.last_token_ns = now
        req.tokens.extend(new)
        self.generated_tokens += len(new)
        seq = req.seq
        if self._stop_hit(req):
            done, reason = True, FINISH_STOP
        elif getattr(seq, "finished", False):
            done, reason = True, getattr(seq, "finish_reason", None) or FINISH_LENGTH
        else:
            done, reason = False, None
        if done:
            self.completed_requests += 1
            self._finished_lengths.append((len(req.prompt_ids), len(req.tokens)))
        first = len(req.tokens) == len(new)
        req._unsent.extend(new)
        if done or first or len(req._unsent) >= self._interval():
            out, req._unsent = req._unsent, []
            self._emit(req, out, finished=done, reason=reason)

    def _interval(self) -> int:
        if self.stream_interval:
            return self.stream_interval
        return max(1, -(-len(self._active) // self.responses_per_step))

    def _watch_cancelled(self) -> None:
        """Watcher thread: polls ``is_cancelled`` of every queued and running request, about once per
        decode step (bounded by the check periods), and flags the cancelled ones for the loop."""
        name_native_thread("trtmoe-cancel")
        while True:
            with self._cv:
                if self._closed:
                    return
                reqs = [r for r in itertools.chain(self._waiting, self._active)
                        if r.is_cancelled is not None and not r._cancel and not r.finished]
            found = False
            now = time.monotonic()
            step = min(self.cancel_check_period_s, max(self._last_step_s, self.min_cancel_check_period_s))
            wait = self.cancel_check_period_s
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
                with self._cv:
                    self._cv.notify()
            time.sleep(max(wait, self.min_cancel_check_period_s))

    def _drop_cancelled(self) -> None:
        """Answer the cancelled requests, running or still waiting (so a cancelled request gives back
        its place in the queue at once, not when a slot frees)."""
        with self._cv:
            gone = [r for r in self._waiting if r._cancel]
            if gone:
                self._waiting = deque(r for r in self._waiting if not r._cancel)
        for r in gone:
            self._emit(r, [], finished=True, reason=FINISH_CANCELLED)
        keep = []
        for r in self._active:
            if r.finished:
                continue
            if r._cancel:
                self._emit(r, r._unsent, finished=True, reason=FINISH_CANCELLED)
            else:
                keep.append(r)
        self._active = keep

    def _take(self, room: int) -> list[BatchRequest]:
        """Up to ``room`` waiting requests whose padded prompt block (count x longest prompt) stays
        within ``max_prefill_tokens`` (at least one); cancelled ones are answered and skipped."""
        batch: list[BatchRequest] = []
        longest = 0
        while len(batch) < room:
            with self._cv:
                if not self._waiting:
                    break
                req = self._waiting[0]
                n = max(longest, len(req.prompt_ids))
                if batch and n * (len(batch) + 1) > self.max_prefill_tokens:
                    break
                self._waiting.popleft()
            if req._cancel:
                self._emit(req, [], finished=True, reason=FINISH_CANCELLED)
                continue
            batch.append(req)
            longest = n
        return batch

    def _prefill(self, batch: list[BatchRequest]) -> list[tuple[BatchRequest, Any, BaseException | None]]:
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

    def _admit(self) -> None:
        budget = self.prefill_budget_s
        if budget is None:
            budget = max(self._last_step_s, 0.002)
        spent = 0.0
        while len(self._active) < self.max_batch_size:
            batch = self._take(self.max_batch_size - len(self._active))
            if not batch:
                return
            t0 = time.perf_counter()
            results = self._prefill(batch)
            spent += time.perf_counter() - t0
            for req, seq, error in results:
                if error is not None:
                    self._fail(req, error)
                    continue
                req.seq = seq
                self.prefilled_tokens += len(req.prompt_ids)
                self._deliver(req, list(seq.tokens))
                if not req.finished:
                    self._active.append(req)
            self._flush()  # first tokens go out now, not after the rest of the admissions
            # Requests already streaming should not wait for more than ~one step of prefills.
            if self._active and spent >= budget:
                return

    def _step(self) -> None:
        active = [r for r in self._active if not r.finished]
        if not active:
            self._active = []
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
        self._last_step_s = time.perf_counter() - t0
        bad = {id(r) for r, _ in failed}
        for r, e in failed:
            self._fail(r, e)
        for r, n in zip(active, before):
            if id(r) in bad:
                continue
            self._deliver(r, [int(t) for t in r.seq.tokens[n:]])
        self._active = [r for r in active if not r.finished]
        self.iterations += 1

    def _trim(self) -> None:
        trim = getattr(self.engine, "trim_memory", None)
        if trim is None:
            return
        try:
            trim()
            self.trims += 1
        except Exception:  # noqa: BLE001 - never let the loop die
            log.exception("engine trim_memory failed")

    def _run(self) -> None:
        name_native_thread("trtmoe-decode")
        if self.cpu_cores:  # before the first torch op, so the intra-op workers it starts inherit them
            try:
                bind_this_thread(self.cpu_cores)
            except OSError as e:
                log.warning("could not move the decode thread to cores %s: %s", sorted(self.cpu_cores), e)
        next_idle_cb = 0.0
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not self._active:
                    timeout = self.idle_callback_period_s if self.on_iteration else None
                    if self._trim_at is not None:
                        left = self._trim_at - time.monotonic()
                        if left <= 0:
                            break  # idle long enough: trim below, outside the lock
                        timeout = left if timeout is None else min(timeout, left)
                    if not self._cv.wait(timeout) and self.on_iteration and time.monotonic() >= next_idle_cb:
                        break  # periodic idle call so gauges settle
                if self._closed:
                    break
                idle = not self._waiting and not self._active  # else this iteration has work
            if idle and self._trim_at is not None and time.monotonic() >= self._trim_at:
                self._trim_at = None
                self._trim()
                continue
            try:
                self._drop_cancelled()
                self._admit()
                self._step()
            except Exception as e:  # noqa: BLE001 - never let the loop die
                log.exception("batcher iteration failed")
                for r in self._active:
                    if not r.finished:
                        self._fail(r, e)
                self._active = []
            self._flush()
            if not idle and not self._active and self.trim_after_idle_s is not None:
                self._trim_at = time.monotonic() + self.trim_after_idle_s  # idle from now on
            if self.on_iteration is not None:
                try:
                    self.on_iteration(self)
                except Exception:  # noqa: BLE001
                    log.exception("on_iteration hook failed")
                next_idle_cb = time.monotonic() + self.idle_callback_period_s
        closed = BatcherClosed("the server is shutting down")
        with self._cv:
            pending = list(self._waiting) + [r for r in self._active if not r.finished]
            self._waiting.clear()
            self._active = []
        for r in pending:
            self._fail(r, closed)
        self._flush()
