#!/usr/bin/env python3
"""Garbage-collector pauses in a serving process: what ``gc.freeze()`` at the end of a model's
``initialize`` (as the repository's four Python models do) saves.

A process that has imported torch and loaded the embedded engine holds about 170,000 objects the
collector tracks. Every full (generation 2) pass walks all of them while the thread that triggered
it, and every other thread waiting for the interpreter, stands still: the decode loop stops, and so
does every stream. Frozen objects are left out of every pass.

Each mode runs in its own child process: the engine on a float32 checkpoint of --model, driven by
the served batcher (``InflightBatcher``) with --requests greedy requests of --tokens tokens kept
--concurrency at a time; every collector pass is timed through ``gc.callbacks``.

* ``default``: the collector as the process leaves it after loading;
* ``frozen``: ``gc.collect(); gc.freeze()`` after loading, what the models do.

    python scripts/bench_gc.py                       # 2500 requests, concurrency 8, 32 tokens
    python scripts/bench_gc.py --requests 400 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _child(mode: str, ckpt: str, requests: int, concurrency: int, tokens: int) -> None:
    import gc

    import torch

    from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams
    from trtmoe.triton.batcher import InflightBatcher

    torch.set_num_threads(1)
    engine = EmbeddedEngine.from_checkpoint(ckpt, device="cpu", max_seq_len=64 + tokens + 8)
    batcher = InflightBatcher(engine, max_batch_size=concurrency)
    if mode == "frozen":
        gc.collect()
        gc.freeze()
    tracked, frozen = len(gc.get_objects()), gc.get_freeze_count()
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - started[0]) * 1e3))

    slots, done, left, lock = threading.Semaphore(concurrency), threading.Event(), [requests], threading.Lock()

    def on_event(ev):
        if ev.finished:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
            slots.release()

    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    for i in range(requests):
        slots.acquire()
        batcher.submit(list(range(5 + i % 50, 25 + i % 50)), SamplingParams(max_new_tokens=tokens, min_tokens=tokens),
                       on_event)
    done.wait()
    wall = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    batcher.shutdown()
    full = [ms for g, ms in pauses if g == 2]
    print(json.dumps({"wall_s": wall, "tracked": tracked, "frozen": frozen, "passes": len(pauses), "full_passes": len(full),
                      "longest_ms": max((ms for _, ms in pauses), default=0.0),
                      "longest_full_ms": max(full, default=0.0), "total_ms": sum(ms for _, ms in pauses)}))


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "trained_mixtral")
    ap.add_argument("--requests", type=int, default=2500)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the table shows medians")
    args = ap.parse_args(argv)

    from bench_recipes import run_child
    from trtmoe.checkpoint.writer import convert

    modes = ("default", "frozen")
    with tempfile.TemporaryDirectory(prefix="bench-gc-") as tmp:
        ckpt = convert(args.model, Path(tmp) / "ckpt", dtype="float32").out_dir
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes[r % 2:] + modes[:r % 2]:
                res = run_child(__file__, [mode, ckpt, args.requests, args.concurrency, args.tokens], f"{mode} run")
                runs[mode].append(res)
                print(f"  round {r + 1} {mode:>7}: {res['full_passes']} full passes, longest pause "
                      f"{res['longest_ms']:.1f} ms, {res['wall_s']:.1f} s", flush=True)
    print()
    print(f"{args.requests} greedy requests x {args.tokens} tokens at concurrency {args.concurrency}, "
          f"{args.model.name}, torch threads 1, medians of {args.rounds} round(s)")
    print("| collector | objects tracked / frozen | passes | full passes | longest full pass ms | longest pause ms | "
          "pauses total ms | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for m in modes:
        med = {k: statistics.median(x[k] for x in runs[m]) for k in runs[m][0]}
        print(f"| {m} | {med['tracked']:,.0f} / {med['frozen']:,.0f} | {med['passes']:.0f} | {med['full_passes']:.0f} | "
              f"{med['longest_full_ms']:.1f} | {med['longest_ms']:.1f} | {med['total_ms']:.1f} | {med['wall_s']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
