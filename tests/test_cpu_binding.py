"""`--decode-cores`: which cores the embedded engine's decode thread gets, and the threads actually
moved there (in a child process: affinity is process state)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trtmoe.errors import InputError
from trtmoe.triton import cpu_binding
from trtmoe.triton.cpu_binding import format_cores, parse_cores, plan

MULTICORE = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2
needs_two_cores = pytest.mark.skipif(not MULTICORE, reason="binding threads needs Linux and at least 2 usable cores")


@pytest.mark.parametrize("spec,want", [
    (None, None), ("", None), ("none", None), (" None ", None), ("auto", "auto"), ("AUTO", "auto"),
    ("3", [3]), (3, [3]), ("0-3,8", [0, 1, 2, 3, 8]), ("5,1-2,2", [1, 2, 5]), ("2-2", [2]),
])
def test_parse_cores(spec, want):
    assert parse_cores(spec) == want


@pytest.mark.parametrize("spec,words", [
    ("1-x", "core list"), ("-1", "core list"), ("3-1", "backwards"), ("1,,2", "core list"), ("all", "core list"),
])
def test_parse_cores_names_a_malformed_list(spec, words):
    with pytest.raises(InputError, match=words):
        parse_cores(spec)


def test_format_cores_is_the_shortest_range_list():
    assert format_cores([8, 0, 1, 2, 3]) == "0-3,8"
    assert format_cores({5}) == "5"
    assert parse_cores(format_cores([0, 2, 3, 4, 7, 9, 10])) == [0, 2, 3, 4, 7, 9, 10]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_plan():
    allowed = {0, 1, 2, 3, 4, 5, 6, 7}
    assert plan(None, 4, allowed) is None and plan("none", 4, allowed) is None
    assert plan("auto", 3, allowed) == ({5, 6, 7}, {0, 1, 2, 3, 4})  # the last cores, one per thread
    assert plan("auto", 0, allowed) == ({7}, {0, 1, 2, 3, 4, 5, 6})  # at least one
    assert plan("0-1", 2, allowed) == ({0, 1}, {2, 3, 4, 5, 6, 7})
    # What the machine cannot meet is a reason, not an error: serving goes on unbound.
    assert "leave one" in plan("auto", 8, allowed)
    assert "not available" in plan("6-9", 4, allowed) and "8-9" in plan("6-9", 4, allowed)
    assert "no core" in plan("0-7", 8, allowed)


_CHILD = r"""
import json, os, sys, threading, time
from trtmoe.triton import cpu_binding
from trtmoe.triton.batcher import InflightBatcher

class Idle:  # an engine the batcher never has work for
    pass

before = threading.Thread(target=time.sleep, args=(5,), daemon=True)
before.start()  # a thread that exists before the binding
decode, rest = {int(c) for c in sys.argv[1].split(",")}, {int(c) for c in sys.argv[2].split(",")}
cpu_binding.bind_process_threads(rest)
after = threading.Thread(target=time.sleep, args=(5,), daemon=True)
after.start()  # one started after it
b = InflightBatcher(Idle(), max_batch_size=1, cpu_cores=decode, trim_after_idle_s=None)


def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        name = open(f"/proc/self/task/{tid}/comm").read().strip()
        out[f"{name}:{tid}"] = sorted(os.sched_getaffinity(int(tid)))
    return out


deadline = time.monotonic() + 20  # until the decode thread has started and moved (or the test sees why not)
while not any(n.startswith("trtmoe-decode:") and c == sorted(decode) for n, c in threads().items()) \
        and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps(threads()))
b.shutdown()
"""


@needs_two_cores
def test_the_decode_thread_alone_moves_to_its_cores():
    cores = sorted(os.sched_getaffinity(0))
    decode, rest = cores[-1:], cores[:-1]
    res = subprocess.run([sys.executable, "-c", _CHILD, ",".join(map(str, decode)),
                          ",".join(map(str, rest))], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    threads = json.loads(res.stdout.strip().splitlines()[-1])
    on_decode = [name for name, cpus in threads.items() if cpus == decode]
    assert [n.split(":")[0] for n in on_decode] == ["trtmoe-decode"], threads
    assert all(cpus == rest for name, cpus in threads.items() if not name.startswith("trtmoe-decode")), threads
    assert len(threads) >= 4  # main, the two sleepers, the decode thread


def test_resolved_cores_come_from_the_launcher(monkeypatch):
    monkeypatch.setenv(cpu_binding.ENV, "1,3")
    assert cpu_binding.from_environment() == {1, 3}
    monkeypatch.setenv(cpu_binding.ENV, "")
    assert cpu_binding.from_environment() is None


_SERVED_CHILD = r"""
import json, os, sys
from trtmoe.triton.served import _bind
out = {"none": _bind("none", 1), "missing": _bind("4000-4001", 1)}
os.environ["TRTMOE_DECODE_CORES"] = sys.argv[1]
out["launcher"] = _bind("none", 1)  # a launcher's resolved cores win over an edited config.pbtxt
out["threads"] = sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})
print(json.dumps({k: [sorted(v[0]) if v[0] else None, v[1]] if k != "threads" else v for k, v in out.items()}))
"""


@needs_two_cores
def test_a_served_model_applies_the_setting_or_says_why_not():
    cores = sorted(os.sched_getaffinity(0))
    res = subprocess.run([sys.executable, "-c", _SERVED_CHILD, str(cores[-1])], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["none"] == [None, ""]
    assert got["missing"][0] is None and got["missing"][1].startswith("decode_cores not applied: ")
    assert got["launcher"][0] == [cores[-1]] and "decode thread on cores" in got["launcher"][1]
    assert got["threads"] == [cores[:-1]]  # every thread of the process moved off the decode core
