"""Operating-system names for the serving threads.

Python names its threads for itself only: ``top -H``, ``ps -L`` and ``/proc/PID/task/TID/comm`` show
every thread of a Triton Python-backend stub as ``triton_python_b``. The embedded ``tensorrt_llm``
model's threads call ``name_native_thread`` when they start, so an operator (and
``scripts/bench_peers.py``, which splits the served stack's CPU time by thread) sees which one
burns the CPU: the decode loop, the response sender, the cancellation poll or the metrics publisher.
"""

from __future__ import annotations

import ctypes
import threading

_PR_SET_NAME = 15  # prctl(2): name the calling thread (at most 15 bytes are kept)
_libc = None


def name_native_thread(name: str | None = None) -> bool:
    """Give the calling thread ``name`` (default: its Python name), cut to the 15 bytes Linux keeps.
    False where the platform has no such call; never raises."""
    global _libc
    text = (name or threading.current_thread().name).encode("ascii", "replace")[:15]
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's among them
        return _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(text), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
