"""What a caller hands the in-flight batcher and what its callback gets back."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

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


def wall_clock_offset_ns() -> int:
    """What to add to a ``time.monotonic_ns()`` value for wall-clock ns, taken now.

    Taken when a time is reported, not once at start-up: the system clock is slewed (NTP) while
    the monotonic one is not, so an offset from hours earlier can put a request's reported
    arrival before the moment the client sent it.
    """
    return time.time_ns() - time.monotonic_ns()


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
