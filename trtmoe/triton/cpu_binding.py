"""Cores of its own for the embedded engine's decode thread (``trtmoe repo --decode-cores``).

A served embedded engine decodes on one thread (plus its torch intra-op workers) while other
threads come and go around it: tritonserver's HTTP/gRPC frontends and its Python-backend message
handling, the model's response sender, metrics and cancellation watchers, pre/postprocessing
processes, and often the clients. Linux schedules them onto any core, the decode thread's included,
and a thread that lands there holds it for up to a scheduler slice (milliseconds). A decode step
of a small model takes a fraction of a millisecond, so those slices become the slowest
inter-token gaps: on a 2-core machine, the trained fixture served through the llmapi layout at
one stream showed a p99 inter-token latency of 3.9 ms against a median of 0.64 ms; with the
decode thread alone on one core and everything else on the other, 1.3 ms against 0.63 ms.

``decode_cores`` (a repository setting, ``config.pbtxt`` parameter of the ``tensorrt_llm`` model):

* unset or ``none``: no binding (every thread may run on every core: the default);
* ``auto``: the last ``torch_num_threads`` cores the server may use, provided at least one is
  left for everything else;
* a list such as ``2-7`` or ``0,2,4``: those cores.

The decode thread moves itself onto the decode cores when it starts, before its first torch op, so
the intra-op workers it starts inherit them (OpenMP gives each thread that opens a parallel region a
team of its own). Every other thread of the model's process is moved to the rest of the cores.
``trtmoe serve`` resolves the setting before it starts tritonserver, starts the server on the rest
(so its threads, and the backend processes it starts, stay off the decode cores) and passes the
resolved cores in ``TRTMOE_DECODE_CORES``; a model started by another launcher resolves the setting
itself, and that launcher may keep the server off those cores itself (``taskset -c REST
tritonserver ...``). A setting that cannot be met on the serving machine (cores it does not have, or
none left over) is logged and serving goes on unbound.
"""

from __future__ import annotations

import os
import re

from ..errors import InputError

AUTO = "auto"
ENV = "TRTMOE_DECODE_CORES"  # cores resolved by the launcher, e.g. "1" or "4,5,6,7"
_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def parse_cores(spec: str | int | None) -> str | list[int] | None:
    """None (no binding), ``"auto"``, or the sorted distinct cores of a list like ``0-3,8`` (or one core
    number, as YAML gives ``decode_cores: 3``); InputError names a malformed one."""
    text = ("" if spec is None else str(spec)).strip().lower().replace(" ", "")
    if text in ("", "none"):
        return None
    if text == AUTO:
        return AUTO
    if not _LIST.match(text):
        raise InputError(f"decode_cores {spec!r} is not auto, none or a core list such as 0-3,8")
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise InputError(f"decode_cores {spec!r}: the range {part} runs backwards")
        cores.update(range(a, b + 1))
    return sorted(cores)


def format_cores(cores) -> str:
    """A core set as the shortest list of ranges, e.g. ``0-3,8``."""
    out, run = [], []
    for c in sorted(cores):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def allowed_cores() -> set[int]:
    """The cores this process may run on (all of the machine's where the platform cannot tell)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def plan(spec: str | None, threads: int, allowed: set[int] | None = None) -> tuple[set[int], set[int]] | str | None:
    """(decode cores, the rest) for ``spec`` on a process allowed ``allowed`` (default: this one's)
    whose engine runs ``threads`` torch threads; None when ``spec`` asks for no binding; a one-line
    reason when the machine cannot meet it."""
    want = parse_cores(spec)
    if want is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        return "this platform cannot bind threads to cores"
    allowed = allowed_cores() if allowed is None else set(allowed)
    if want == AUTO:
        n = max(1, threads)
        if len(allowed) <= n:
            return (f"decode_cores auto needs more cores than the engine's {n} torch thread(s), to leave one for the "
                    f"server's other threads; this process may use {len(allowed)}")
        decode = set(sorted(allowed)[-n:])
    else:
        decode = set(want)
        missing = decode - allowed
        if missing:
            return (f"decode_cores {format_cores(decode)}: cores {format_cores(missing)} are not available here "
                    f"(this process may use {format_cores(allowed)})")
    rest = allowed - decode
    if not rest:
        return f"decode_cores {format_cores(decode)} leaves no core for the server's other threads"
    return decode, rest


def from_environment() -> set[int] | None:
    """The decode cores a launcher resolved (``TRTMOE_DECODE_CORES``), or None."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    cores = parse_cores(value)
    return set(cores) if isinstance(cores, list) else None


def bind_this_thread(cores: set[int]) -> None:
    """Run the calling thread (and threads it starts from now on) on ``cores`` only."""
    os.sched_setaffinity(0, cores)


def bind_process_threads(cores: set[int]) -> None:
    """Move every thread of this process to ``cores`` (threads it starts later inherit the mask of the
    thread that starts them). A thread that ended meanwhile is skipped; any other refusal raises
    OSError."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            continue
