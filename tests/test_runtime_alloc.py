"""The allocator setting of CPU engines (trtmoe.runtime.alloc): freed activation memory stays in the
process for reuse, ``give_back_freed_memory`` returns it, and ``TRTMOE_MALLOC=system`` leaves glibc's
own behaviour. Each case runs in a fresh interpreter: the setting is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trtmoe.runtime import alloc

pytestmark = pytest.mark.skipif(alloc._libc() is None, reason="the C library is not glibc: the setting does not apply")

PROBE = r"""
import json, os, sys
from trtmoe.runtime import alloc

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

held = alloc.hold_freed_memory()
before = rss_mb()
block = bytearray(256 << 20)  # 256 MiB, every page written
after_alloc = rss_mb()
del block
after_free = rss_mb()
alloc.give_back_freed_memory()
print(json.dumps({"held": held, "alloc": after_alloc - before, "free": after_free - before,
                  "trim": rss_mb() - before}))
"""


def _probe(env_extra: dict) -> dict:
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_memory_is_held_until_given_back():
    r = _probe({})
    assert r["held"] and r["alloc"] > 200
    assert r["free"] > 200  # freed, but kept for the next allocation
    assert r["trim"] < 50  # returned to the system


def test_system_malloc_opt_out():
    r = _probe({"TRTMOE_MALLOC": "system"})
    assert not r["held"] and r["alloc"] > 200
    assert r["free"] < 50  # glibc unmaps a block this large at once


def test_unknown_setting_is_refused():
    out = subprocess.run([sys.executable, "-c", "from trtmoe.runtime import alloc; alloc.hold_freed_memory()"],
                         capture_output=True, text=True, env={**os.environ, "TRTMOE_MALLOC": "jemalloc"})
    assert out.returncode != 0 and "TRTMOE_MALLOC must be hold or system, got 'jemalloc'" in out.stderr
