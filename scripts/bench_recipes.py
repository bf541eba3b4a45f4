#!/usr/bin/env python3
"""What calibration's stored int4 recipes save ``trtmoe convert``.

Calibration searches every int4 candidate's pre-quant scale and clip on each expert matrix's routed
tokens, and keeps what it chose under ``recipes/`` in its artifact. ``convert`` applies those instead
of searching again (the error-feedback codes of awq_gptq are still computed at convert time). This
benchmark builds a synthetic MoE at real expert width (Qwen3-30B-A3B's by default: hidden 2048,
expert FFN 768), calibrates it once, then converts it with the same plan, interleaved over
``--rounds`` rounds, each in a fresh child process:

* ``stored``: the default, applying the calibration's recipes;
* ``searched``: the same convert with the stored recipes ignored (every search runs again), which is
  what convert did before recipes were stored;
* ``scale+clip`` (with ``--parts``): the stored scales and clips applied but not which error-feedback
  candidate won, so every candidate's codes and errors are computed again (what each stored part
  saves).

It prints wall and CPU seconds per convert (medians), their ratio, and whether both wrote the same
bytes (they must: a stored recipe is exactly what the search returns for that weight).

    python scripts/bench_recipes.py                       # 8 experts, 1 layer, graded 4.5 bpw per matrix
    python scripts/bench_recipes.py --target tensorrt-llm --plan uniform:int4_g128   # layer-shared scale

The calibration is for ``--target`` (the default, embedded, scores each matrix with its own pre-quant
scale; tensorrt-llm also with the layer-shared one its stacked layout writes), and so is the convert.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "trained_mixtral"  # its tokenizer (vocabulary 2048)


def run_child(script: str, args: list, what: str, **kw) -> dict:
    """Run ``script --child ARGS`` in a fresh interpreter and return the JSON object its last output
    line holds; on failure print the tail of its stderr and exit naming ``what``. ``kw`` goes to
    ``subprocess.run`` (env, cwd)."""
    p = subprocess.run([sys.executable, script, "--child", *map(str, args)], capture_output=True, text=True, **kw)
    if p.returncode:
        print(p.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{what} failed")
    return json.loads(p.stdout.strip().splitlines()[-1])


def plan_args(plan: str) -> list[str]:
    kind, _, value = plan.partition(":")
    if kind == "uniform":
        return ["--policy", "uniform", "--format", value]
    if kind == "budget":
        return ["--budget", value]
    raise SystemExit(f"--plan must be uniform:FORMAT or budget:BPW, got {plan!r}")


def _child(mode: str, model: str, cal: str, out: str, plan: str, threads: str, target: str) -> None:
    """One convert in this fresh process; prints a JSON line with its wall and CPU seconds."""
    import torch

    from trtmoe.cli import main
    from trtmoe.quant import awq

    torch.set_num_threads(int(threads))
    if mode == "searched":
        awq.RecipeStore.get = lambda *a, **k: None  # as if calibration had stored no recipe
    elif mode == "scale+clip":
        get = awq.RecipeStore.get
        awq.RecipeStore.get = lambda *a, **k: None if (r := get(*a, **k)) is None else (r[0], r[1], None)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        main(["convert", model, "-o", out, "--calib", cal, "--force", "--target", target, *plan_args(plan)],
             prog_name="trtmoe")
    except SystemExit as e:
        if e.code:
            raise
    print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def add_model_args(ap: argparse.ArgumentParser, experts: int) -> None:
    """The options ``make_wide_model`` and a calibration of it take."""
    ap.add_argument("--arch", default="qwen3_moe", help="make_tiny_models architecture [qwen3_moe]")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768, help="expert FFN size")
    ap.add_argument("--experts", type=int, default=experts)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--samples", type=int, default=8, help="calibration sequences")
    ap.add_argument("--seq-len", type=int, default=64)


def make_wide_model(work: Path, arch: str, hidden: int, inter: int, experts: int, top_k: int, layers: int
                    ) -> tuple[Path, Path]:
    """A seeded random MoE at the given expert width with the trained fixture's tokenizer, and a
    calibration text beside it: (model directory, text file)."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from make_tiny_models import make_tiny_model

    from trtmoe.data import write_split_text

    width = ({"num_local_experts": experts, "intermediate_size": inter} if arch in ("mixtral", "phimoe")
             else {"num_experts": experts, "moe_intermediate_size": inter, "mlp_only_layers": []})
    model = make_tiny_model(arch, work / "model", seed=0, num_experts_per_tok=top_k, num_hidden_layers=layers,
                            hidden_size=hidden, vocab_size=2048, head_dim=64, num_attention_heads=hidden // 64,
                            dtype="bfloat16", **width)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(FIXTURE / f, Path(model) / f)
    text = work / "calib.txt"
    write_split_text("calib", text, max_bytes=200_000)
    return Path(model), text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        _child(*argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_model_args(ap, experts=8)
    ap.add_argument("--plan", default="budget:4.5", help="uniform:FORMAT or budget:BPW [budget:4.5]")
    ap.add_argument("--target", default="embedded", choices=("embedded", "tensorrt-llm"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of calibrate and convert [1]")
    ap.add_argument("--parts", action="store_true", help="also convert with the scales and clips alone")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory [a new temp dir, removed]")
    args = ap.parse_args(argv)

    import torch

    from trtmoe.quant.calibrate import calibrate

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-recipes-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model, text = make_wide_model(work, args.arch, args.hidden, args.inter, args.experts, args.top_k, args.layers)
        torch.set_num_threads(args.threads)
        t0, c0 = time.perf_counter(), time.process_time()
        calibrate(model, text, work / "cal", samples=args.samples, seq_len=args.seq_len, force=True,
                  target=args.target)
        cal_wall, cal_cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"calibrate: {cal_wall:.1f} s wall, {cal_cpu:.1f} CPU s ({args.layers} layer(s) x {args.experts} experts, "
              f"hidden {args.hidden}, expert FFN {args.inter}, {args.samples} x {args.seq_len} tokens)", flush=True)
        modes = ("stored", "searched") + (("scale+clip",) if args.parts else ())
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                out = work / f"ck-{mode}"
                res = run_child(__file__, [mode, model, work / "cal", out, args.plan, args.threads, args.target],
                                f"convert ({mode})")
                runs[mode].append(res)
                print(f"  round {r + 1} {mode:>10s}: {res['wall']:7.1f} s wall {res['cpu']:7.1f} CPU s", flush=True)
        same = all((work / f"ck-{m}" / n.name).read_bytes() == n.read_bytes() for m in modes[:1] + modes[2:]
                   for n in sorted((work / "ck-searched").glob("rank*.safetensors")))
        med = {m: {k: statistics.median(x[k] for x in rs) for k in ("wall", "cpu", "peak_rss_mib")}
               for m, rs in runs.items()}
        print()
        print(f"convert {args.plan} --target {args.target}, {args.arch}, rounding awq_gptq, medians of {args.rounds} rounds, "
              f"torch threads {args.threads}")
        print("| convert | wall s | CPU s | peak RSS MiB |")
        print("|---|---|---|---|")
        for m in ("searched",) + modes[:1] + modes[2:]:
            print(f"| {m} | {med[m]['wall']:.1f} | {med[m]['cpu']:.1f} | {med[m]['peak_rss_mib']:.0f} |")
        for m in modes[:1] + modes[2:]:
            print(f"{m} / searched: wall {med[m]['wall'] / med['searched']['wall']:.2f}x, "
                  f"CPU {med[m]['cpu'] / med['searched']['cpu']:.2f}x")
        print(f"rank files identical: {same}")
        recipes = sum(f.stat().st_size for f in (work / "cal" / "recipes").glob("*.safetensors"))
        print(f"recipes stored by calibration: {recipes / 1e6:.2f} MB "
              f"({recipes / (args.layers * args.experts) / 1e3:.0f} KB per expert)")
        return 0 if same else 1
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
