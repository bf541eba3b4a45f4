"""How the process's C allocator treats the memory the engine frees (glibc only).

The engine's CPU tensors come from glibc's malloc. By default glibc gives a freed block back to the
kernel (``munmap``, or trimming the top of the heap) once it is large enough, and its threshold
moves with the program's history; every later allocation of that size then faults in fresh zeroed
pages. A prefill allocates and frees tens to hundreds of megabytes of activations per forward, so
the same prefill of 64 x 128 tokens on the trained fixture ran at 22-32k tokens/s or at 48-50k
depending only on what the process had allocated before (``scripts/bench_engine.py``'s
``prefill64x128`` next to ``prefill_mixed``).

``hold_freed_memory`` makes glibc keep freed blocks up to ``HOLD_BYTES`` in the process (no
``mmap`` for a block below it, no trimming until that much is free at the top of the heap): the
prefill then ran at 48-50k tokens/s whatever came before. The memory a burst used stays resident
after it, so ``give_back_freed_memory`` (``malloc_trim``) returns what is free; the serving loop
calls it once the engine has been idle a while (``EmbeddedEngine.trim_memory``).

It is process-wide, set once by the first CPU engine. ``TRTMOE_MALLOC=system`` leaves glibc's own
behaviour in place (``hold``, the default, is the setting above; any other value is refused).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

from ..errors import InputError

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

HOLD_BYTES = 512 << 20


@functools.cache
def _libc():
    """glibc, or None (another C library, or none found)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return libc if version() else None


@functools.cache
def hold_freed_memory() -> bool:
    """Keep freed blocks below ``HOLD_BYTES`` in the process (see the module docstring); True when
    the setting took effect. Once per process; a no-op with ``TRTMOE_MALLOC=system`` or off glibc."""
    mode = os.environ.get("TRTMOE_MALLOC", "").strip().lower() or "hold"
    if mode not in ("hold", "system"):
        raise InputError(f"TRTMOE_MALLOC must be hold or system, got {os.environ['TRTMOE_MALLOC']!r}")
    if mode == "system":
        return False
    libc = _libc()
    if libc is None:
        return False
    # Setting either parameter also stops glibc moving them with the program's history.
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, HOLD_BYTES)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, HOLD_BYTES))


def give_back_freed_memory() -> bool:
    """Return the free memory the allocator holds to the kernel (``malloc_trim``); True when some was."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
