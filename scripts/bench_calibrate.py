#!/usr/bin/env python3
"""What ``trtmoe calibrate`` costs at a real expert width, against other revisions in the same run.

It builds a seeded random MoE of Qwen3-30B-A3B's expert width by default (hidden 2048, expert FFN
768; few experts and layers, so that a round takes a minute on one core) with the trained fixture's
tokenizer, then calibrates it with this tree and with each ``--baseline-rev`` (that revision's
``trtmoe`` package, extracted with ``git archive`` and put first on the child's path), each run in a
fresh process, the rounds interleaved. It prints wall and CPU seconds (medians), peak RSS, the
ratio against each baseline, and whether every baseline wrote the same artifact bytes as this tree
(a change that only makes calibration faster keeps them).

    python scripts/bench_calibrate.py --baseline-rev 887c08b
    python scripts/bench_calibrate.py --baseline-rev HEAD~3 --experts 4 --sensitivity exact --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))


def _child(model: str, text: str, out: str, samples: str, seq_len: str, sensitivity: str, threads: str) -> None:
    """One calibration in this fresh process; prints a JSON line with its wall and CPU seconds."""
    import torch

    import trtmoe
    from trtmoe.quant.calibrate import calibrate

    torch.set_num_threads(int(threads))
    t0, c0 = time.perf_counter(), time.process_time()
    calibrate(model, text, out, samples=int(samples), seq_len=int(seq_len), force=True, sensitivity=sensitivity)
    print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "trtmoe": str(Path(trtmoe.__file__).parent)}))


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return names == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        _child(*argv[1:])
        return 0
    from bench_recipes import add_model_args, make_wide_model, run_child

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--baseline-rev", action="append", default=[], help="a git revision to compare (repeatable)")
    add_model_args(ap, experts=2)
    ap.add_argument("--sensitivity", default="fisher", choices=("fisher", "exact"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every calibration [1]")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory [a new temp dir, removed]")
    args = ap.parse_args(argv)

    from bench_engine import _extract_rev

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-calibrate-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model, text = make_wide_model(work, args.arch, args.hidden, args.inter, args.experts, args.top_k, args.layers)
        impls: dict[str, str | None] = {"trtmoe": None}
        for rev in args.baseline_rev:
            dest = work / f"rev-{len(impls)}"
            dest.mkdir()
            _extract_rev(rev, dest)
            impls[f"trtmoe@{rev}"] = str(dest)
        runs: dict[str, list[dict]] = {name: [] for name in impls}
        names = list(impls)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                env = dict(os.environ)
                env["PYTHONPATH"] = os.pathsep.join(p for p in (impls[name] or str(REPO_ROOT),
                                                                env.get("PYTHONPATH")) if p)
                out = work / f"cal-{names.index(name)}"
                res = run_child(__file__, [model, text, out, args.samples, args.seq_len, args.sensitivity,
                                           args.threads], f"calibrate ({name})", env=env, cwd=tempfile.gettempdir())
                runs[name].append(res)
                print(f"  round {r + 1} {name:>20s}: {res['wall']:7.1f} s wall {res['cpu']:7.1f} CPU s "
                      f"({res['trtmoe']})", flush=True)
        med = {n: {k: statistics.median(x[k] for x in rs) for k in ("wall", "cpu", "peak_rss_mib")}
               for n, rs in runs.items()}
        print()
        print(f"trtmoe calibrate --sensitivity {args.sensitivity}: {args.arch}, {args.layers} layer(s) x "
              f"{args.experts} experts (top-{args.top_k}), hidden {args.hidden}, expert FFN {args.inter}, "
              f"{args.samples} x {args.seq_len} tokens; medians of {args.rounds} rounds, torch threads {args.threads}")
        print("| calibrate | wall s | CPU s | peak RSS MiB | this tree's speed-up (wall) | same artifact |")
        print("|---|---|---|---|---|---|")
        for i, n in enumerate(names):
            up = f"{med[n]['wall'] / med['trtmoe']['wall']:.2f}x" if i else ""
            same = "" if not i else ("yes" if _same_files(work / "cal-0", work / f"cal-{i}") else "no")
            m = med[n]
            print(f"| {n} | {m['wall']:.1f} | {m['cpu']:.1f} | {m['peak_rss_mib']:.0f} | {up} | {same} |")
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
