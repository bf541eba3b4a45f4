"""The in-flight batcher's options as one typed, checked value."""

from __future__ import annotations

from dataclasses import dataclass

# The auto stream interval's target number of responses per decode step: 4 streams get every token,
# 8 streams every 2nd, 32 every 8th. Measured with scripts/bench_peers.py on 2 cores: 8 instead of 4
# gave 30-44% fewer tokens/s at 8 streams and 16-27% fewer at 32, 2 gave chunkier streams for
# little more.
AUTO_RESPONSES_PER_STEP = 4


@dataclass(frozen=True)
class BatcherSettings:
    """How an ``InflightBatcher`` schedules; checked when built.

    ``max_batch_size``: sequences decoded together (the engine's build limit).
    ``max_waiting``: requests allowed to wait for a slot; 0 means unbounded.
    ``prefill_budget_s``: prefill time allowed per iteration while others are decoding; ``None``
    adapts it to the last decode step's duration (at least 2 ms).
    ``cancel_check_period_s``: the longest wait between two polls of a request's ``is_cancelled`` (it
    may be an IPC call); the watcher polls once per decode step when steps are shorter (at least
    ``min_cancel_check_period_s`` apart, never more than ``cancel_check_period_s``).
    ``idle_callback_period_s``: while idle, the ``on_iteration`` hook still runs this often.
    ``stream_interval``: deliver tokens every this many; 0 = auto (see ``trtmoe.triton.batcher``).
    ``responses_per_step``: the auto interval's target number of responses per decode step.
    ``max_prefill_tokens``: size of one batched prefill (requests x longest prompt, padded); an
    engine with ``start_many(prompts, params)`` prefills the waiting requests that fit together.
    ``name``: the batcher thread's name (the cancel watcher's is this plus ``-cancel``).
    ``remember_cancel_s`` / ``max_remembered_cancels``: how long, and how many, ids cancelled with
    ``remember=True`` are kept for requests that arrive after their cancel.
    ``trim_after_idle_s``: idle time after which the engine's ``trim_memory()`` is called (once per
    idle period; None never).
    ``cpu_cores``: cores the batcher thread moves itself to when it starts (see
    ``trtmoe.triton.cpu_binding``); None leaves it where it is.
    """

    max_batch_size: int
    max_waiting: int = 0
    prefill_budget_s: float | None = None
    cancel_check_period_s: float = 0.1
    idle_callback_period_s: float = 1.0
    stream_interval: int = 1
    responses_per_step: int = AUTO_RESPONSES_PER_STEP
    max_prefill_tokens: int = 1024
    name: str = "trtmoe-inflight-batcher"
    min_cancel_check_period_s: float = 0.005
    remember_cancel_s: float = 600.0
    max_remembered_cancels: int = 16384
    trim_after_idle_s: float | None = 2.0
    cpu_cores: frozenset[int] | set[int] | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.stream_interval < 0:
            raise ValueError(f"stream_interval must be >= 0 (0 = auto), got {self.stream_interval}")
        if self.responses_per_step < 1:
            raise ValueError(f"responses_per_step must be >= 1, got {self.responses_per_step}")
        # The shortest wait between two polls never exceeds the longest.
        object.__setattr__(self, "min_cancel_check_period_s",
                           min(self.min_cancel_check_period_s, self.cancel_check_period_s))
