"""What the in-flight batcher's pieces share: the queues, their lock, and the counters.

Locking (one lock, ``cv``): ``waiting`` is read and changed only under it; ``active`` is replaced
and appended to only by the batcher thread (other threads read it, under ``cv`` where they iterate
it); ``closed`` is set under it. The counters are written only by the batcher thread and read by
the metrics; ``finished_lengths`` is appended by the batcher thread and taken by the metrics thread
(a deque's ends are thread-safe). ``last_step_s`` is written by the batcher thread and read by the
cancel watcher and the admission budget.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

from .requests import BatchRequest

# Every piece logs under the batcher's module name, so a log filter on it sees them all.
log = logging.getLogger("trtmoe.triton.batcher")

# Finished requests' lengths kept for the token-length histograms between two metrics updates.
FINISHED_LENGTHS_KEPT = 4096


@dataclass(eq=False)
class BatchState:
    """The shared state; see the module docstring for who writes what under which lock."""

    cv: threading.Condition = field(default_factory=threading.Condition)
    waiting: deque[BatchRequest] = field(default_factory=deque)
    active: list[BatchRequest] = field(default_factory=list)
    closed: bool = False
    last_step_s: float = 0.0  # the latest decode step's duration
    iterations: int = 0
    generated_tokens: int = 0
    prefilled_tokens: int = 0
    completed_requests: int = 0
    failed_requests: int = 0
    trims: int = 0
    # (prompt tokens, generated tokens) of each request finished since the metrics last took them.
    finished_lengths: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=FINISHED_LENGTHS_KEPT))

    def stats(self) -> dict[str, int]:
        return dict(active=len(self.active), waiting=len(self.waiting), iterations=self.iterations,
                    generated_tokens=self.generated_tokens, prefilled_tokens=self.prefilled_tokens,
                    completed_requests=self.completed_requests, failed_requests=self.failed_requests)

    def take_finished_lengths(self) -> list[tuple[int, int]]:
        out = []
        while self.finished_lengths:
            out.append(self.finished_lengths.popleft())
        return out
