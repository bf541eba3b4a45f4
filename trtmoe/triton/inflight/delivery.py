"""Token delivery: new tokens recorded on their request and handed to its callback, every token or
every ``stream_interval`` tokens; a request ends on the engine's end, its length, a stop sequence or
an error. Runs on the batcher thread only."""

from __future__ import annotations

import time
from typing import Callable

from .requests import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, BatchRequest, TokenEvent
from .settings import BatcherSettings
from .state import BatchState, log


class TokenDelivery:
    """Sends events to request callbacks and counts what was generated, finished and failed."""

    def __init__(self, state: BatchState, settings: BatcherSettings, on_flush: Callable[[], None] | None):
        self.state = state
        self.settings = settings
        self.on_flush = on_flush

    def emit(self, req: BatchRequest, new: list[int], *, finished: bool = False, reason: str | None = None,
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

    def flush(self) -> None:
        """Wake the consumer once after a burst of events."""
        if self.on_flush is not None:
            try:
                self.on_flush()
            except Exception:  # noqa: BLE001 - a consumer's wake-up must not stop the loop
                log.exception("on_flush hook failed")

    def fail(self, req: BatchRequest, error: BaseException) -> None:
        self.state.failed_requests += 1
        self.emit(req, [], finished=True, reason=FINISH_ERROR, error=error)

    def cancelled(self, req: BatchRequest, unsent: list[int] | None = None) -> None:
        """The final event of a cancelled request (with the tokens it had not been sent yet)."""
        self.emit(req, [] if unsent is None else unsent, finished=True, reason=FINISH_CANCELLED)

    @staticmethod
    def stop_hit(req: BatchRequest) -> bool:
        toks = req.tokens
        return any(len(toks) >= len(s) and tuple(toks[-len(s):]) == s for s in req.stop_sequences)

    def deliver(self, req: BatchRequest, new: list[int]) -> None:
        """Record new tokens and send them; finish on engine end, length, or a stop sequence."""
        now = time.monotonic_ns()
        if not req.first_token_ns:
            req.first_token_ns = now
        req.last_token_ns = now
        req.tokens.extend(new)
        self.state.generated_tokens += len(new)
        seq = req.seq
        if self.stop_hit(req):
            done, reason = True, FINISH_STOP
        elif getattr(seq, "finished", False):
            done, reason = True, getattr(seq, "finish_reason", None) or FINISH_LENGTH
        else:
            done, reason = False, None
        if done:
            self.state.completed_requests += 1
            self.state.finished_lengths.append((len(req.prompt_ids), len(req.tokens)))
        first = len(req.tokens) == len(new)
        req._unsent.extend(new)
        if done or first or len(req._unsent) >= self.interval():
            out, req._unsent = req._unsent, []
            self.emit(req, out, finished=done, reason=reason)

    def interval(self) -> int:
        """Tokens per response now: the fixed interval, or auto's ceil(active / responses_per_step)."""
        if self.settings.stream_interval:
            return self.settings.stream_interval
        return max(1, -(-len(self.state.active) // self.settings.responses_per_step))
