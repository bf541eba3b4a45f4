#!/usr/bin/env python3
"""Calibration cost and accuracy of the Fisher sensitivity against the exact (end-to-end) ΔKL.

Cost (default): for seeded random Mixtral-shaped models with E = 8, 32, 64, 128 experts (the same
other dimensions), run ``fisher`` and ``exact`` in a fresh process each and print forward-pass
equivalents, wall time (of the measurement) and the process's peak RSS (model, conversion and
Python included). The exact method's recorded cost counts only its reruns of layers
l..L-1; the ``all`` column adds its reference pass and its all-token output-error passes (E × (1 + 2F)
expert passes over every token per layer), counted in the same multiply-accumulates as fisher's.

    python scripts/bench_calib_cost.py --experts 8,32,64,128

Accuracy (``--accuracy MODEL``): calibrate a trained fixture both ways on the corpus's ``calib``
split (round-to-nearest, so that both measure the same quantized weights), report Spearman's ρ of
fisher against exact per MoE layer (per expert, fc + proj, and per matrix) for every format, then
build the graded per-matrix plan from each at the given budgets, convert both and compare their
held-out KL (the ``heldout`` split, disjoint from calibration) with the float model's.

    python scripts/bench_calib_cost.py --accuracy tests/fixtures/trained_mixtral --samples 128

Routing split (``--routing-split FORMAT``, with ``--accuracy``): where exact and Fisher differ. The
Fisher estimate is a second-order expansion at fixed routing, so it cannot see a later MoE layer
choosing other experts because an earlier expert's output moved. For each expert matrix of every MoE
layer but the last, the end-to-end ΔKL of quantizing it alone (round-to-nearest, FORMAT) is measured
twice on the calibration tokens: with free routing (the exact method) and with every later MoE layer's
top-k ids held at the reference's (their weights still follow the perturbed router logits). Per layer
it prints the three totals and Spearman's ρ of Fisher against each.

    python scripts/bench_calib_cost.py --accuracy tests/fixtures/trained_mixtral --samples 32 \
        --seq-len 64 --routing-split int4 --budgets ""
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- cost ------------------------------------------------------------------------------------------

def _child(model: str, method: str, samples: int, seq_len: int, formats: str, device: str) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    import torch

    from trtmoe.checkpoint.writer import convert
    from trtmoe.quant.calibrate import applicable_formats, measure
    from trtmoe.quant.sensitivity import fisher_measure, forward_macs
    from trtmoe.runtime.engine import EmbeddedEngine

    torch.set_num_threads(1)
    samples, seq_len = int(samples), int(seq_len)
    work = Path(model).parent / f"ck-{method}"
    shutil.rmtree(work, ignore_errors=True)
    ck = convert(model, work).out_dir
    eng = EmbeddedEngine.from_checkpoint(ck, device=device, pack_experts=False)
    # As calibrate does: formats that cannot store the model's matrices are left out.
    fmts, skipped = applicable_formats(tuple(formats.split(",")), eng.cfg.hidden_size,
                                       eng.cfg.expert_intermediate_size)
    if not fmts:
        raise SystemExit(f"no format of {formats} applies: {skipped}")
    vocab = eng.cfg.vocab_size
    ids = torch.randint(0, vocab, (samples, seq_len), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    if method == "fisher":
        res = fisher_measure(eng, ids, formats=fmts)
        total = res["sensitivity"]["cost_forward_passes"]
    else:
        res = measure(eng, ids, formats=fmts, rounding="rtn")
        c = eng.cfg
        macs = forward_macs(c, seq_len)
        n_moe = sum(c.moe_layers)
        err = n_moe * c.num_experts * (1 + 2 * len(fmts)) * 3 * c.expert_intermediate_size * c.hidden_size
        total = 1 + res["sensitivity"]["cost_forward_passes"] + err / macs["total"]
    secs = time.perf_counter() - t0
    shutil.rmtree(work, ignore_errors=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"passes": res["sensitivity"]["cost_forward_passes"], "all": total, "seconds": secs,
                      "peak_rss_mib": rss, "formats": list(fmts), "skipped": skipped}))


def cost(args) -> list[dict]:
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from make_tiny_models import make_tiny_model

    rows = []
    work = Path(args.workdir)
    for E in [int(e) for e in args.experts.split(",")]:
        model = work / f"mixtral-E{E}-L{args.layers}-H{args.hidden}-I{args.inter}-V{args.vocab}"
        if not (model / "config.json").is_file():
            shutil.rmtree(model, ignore_errors=True)
            make_tiny_model("mixtral", model, seed=E, num_local_experts=E, num_hidden_layers=args.layers,
                            hidden_size=args.hidden, intermediate_size=args.inter, vocab_size=args.vocab)
        for method in ("fisher", "exact"):
            if method == "exact" and E > args.exact_max_experts:
                continue
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, __file__, "--child", str(model), method, str(args.samples),
                                str(args.seq_len), args.formats, args.device], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if r.returncode:
                log(r.stderr[-3000:])
                raise SystemExit(f"{method} E={E} failed")
            out = json.loads(r.stdout.strip().splitlines()[-1])
            for f, why in out["skipped"].items():
                log(f"E={E:4d} {method:6s} {f} skipped: {why}")
            rows.append({"E": E, "method": method, "passes": out["passes"], "all": out["all"],
                         "measure_seconds": out["seconds"], "process_seconds": wall,
                         "peak_rss_mib": out["peak_rss_mib"], "formats": out["formats"]})
            log(f"E={E:4d} {method:6s} passes {out['passes']:8.2f}  all {out['all']:8.2f}  "
                f"measure {out['seconds']:7.1f} s  process {wall:7.1f} s  peak RSS {out['peak_rss_mib']:.0f} MiB")
    log("")
    log(f"calibration cost: {args.samples} x {args.seq_len} tokens, formats {args.formats}, {args.layers} layers, "
        f"hidden {args.hidden}, expert FFN {args.inter}, top-2")
    log(f"{'E':>5s} {'method':>7s} {'fwd-pass equiv.':>16s} {'incl. all passes':>17s} {'measure s':>10s} "
        f"{'peak RSS MiB':>13s}")
    for r in rows:
        rss = f"{r['peak_rss_mib']:.0f}"
        log(f"{r['E']:>5d} {r['method']:>7s} {r['passes']:>16.2f} {r['all']:>17.2f} {r['measure_seconds']:>10.1f} "
            f"{rss:>13s}")
    return rows


# ---- accuracy --------------------------------------------------------------------------------------

def accuracy(args) -> dict:
    import torch
    from scipy.stats import spearmanr

    from trtmoe.checkpoint.writer import convert
    from trtmoe.data import split_texts
    from trtmoe.quant.calibrate import measure, token_batches
    from trtmoe.quant.policies import make_plan
    from trtmoe.quant.sensitivity import fisher_measure
    from trtmoe.report.quality import Reference, heldout_ids
    from trtmoe.runtime.engine import EmbeddedEngine
    from trtmoe.runtime.load import load_tokenizer

    torch.set_num_threads(args.threads)
    model = Path(args.accuracy)
    work = Path(args.workdir) / f"accuracy-{model.name}"
    work.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(model)
    ref_ck = work / "ckpt_fp"
    if not (ref_ck / "config.json").is_file():
        shutil.rmtree(ref_ck, ignore_errors=True)
        convert(model, ref_ck)
    eng = EmbeddedEngine.from_checkpoint(ref_ck, device=args.device, pack_experts=False)
    from trtmoe.quant.calibrate import applicable_formats

    fmts, _ = applicable_formats(tuple(args.formats.split(",")), eng.cfg.hidden_size,
                                 eng.cfg.expert_intermediate_size)
    ids = token_batches(split_texts("calib", max_bytes=64 * args.samples * args.seq_len), tok, args.samples,
                        args.seq_len)
    cache = work / f"calib-{args.samples}x{args.seq_len}-{'-'.join(fmts)}.json"
    if cache.is_file():
        both = json.loads(cache.read_text())
        log(f"calibrations reused from {cache}")
    else:
        both = {}
        for method in ("fisher", "exact"):
            t0 = time.perf_counter()
            both[method] = (fisher_measure(eng, ids, formats=fmts) if method == "fisher"
                            else measure(eng, ids, formats=fmts, rounding="rtn"))
            both[method]["seconds"] = time.perf_counter() - t0
        cache.write_text(json.dumps(both))
    fi, ex = both["fisher"], both["exact"]
    for method in ("fisher", "exact"):
        log(f"{method}: {both[method]['sensitivity']['cost_forward_passes']:.2f} forward-pass equivalents (recorded), "
            f"{both[method]['seconds']:.0f} s")
    out = {"model": str(model), "tokens": int(ids.numel()), "formats": list(fmts), "spearman": {}, "plans": []}
    log(f"Spearman rho, fisher vs exact, per MoE layer ({ids.shape[0]} x {ids.shape[1]} calibration tokens):")
    for f in fmts:
        for what in ("expert", "fc", "proj"):
            if what == "expert":
                a, b = ex["sensitivity"]["delta_kl"][f], fi["sensitivity"]["delta_kl"][f]
            else:
                a = ex["sensitivity"]["matrices"][what]["delta_kl"][f]
                b = fi["sensitivity"]["matrices"][what]["delta_kl"][f]
            rho = [float(spearmanr(a[l], b[l]).statistic) for l in ex["moe_layers"]]
            out["spearman"][f"{f}/{what}"] = rho
            log(f"  {f:10s} {what:6s} " + " ".join(f"{r:6.3f}" for r in rho) + f"   min {min(rho):.3f}")
    if args.heldout_oracle:
        # Which calibration predicts per-expert ΔKL on other text: exact ΔKL measured on held-out windows
        # (same count and length as calibration) against exact and fisher measured on calibration text.
        ofile = work / f"heldout-exact-{args.samples}x{args.seq_len}-{'-'.join(fmts)}.json"
        if ofile.is_file():
            ho = json.loads(ofile.read_text())
        else:
            ho = measure(eng, heldout_ids(tok, samples=args.samples, seq_len=args.seq_len), formats=fmts,
                         rounding="rtn")
            ofile.write_text(json.dumps(ho))
        out["heldout_oracle"] = {}
        log("Spearman rho against exact ΔKL measured on held-out text (per expert, fc + proj):")
        for f in fmts:
            for method, cal in (("exact", ex), ("fisher", fi)):
                rho = [float(spearmanr(cal["sensitivity"]["delta_kl"][f][l], ho["sensitivity"]["delta_kl"][f][l])
                             .statistic) for l in ex["moe_layers"]]
                out["heldout_oracle"][f"{f}/{method}"] = rho
                log(f"  {f:10s} {method:6s} (calibration text) " + " ".join(f"{r:6.3f}" for r in rho)
                    + f"   mean {sum(rho) / len(rho):.3f}")
    if args.routing_split:
        out["routing_split"] = routing_split(eng, ids, fi, args.routing_split)
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets:
        return out
    held = heldout_ids(tok, samples=args.eval_samples, seq_len=args.eval_seq_len)
    ref = Reference(ref_ck, held, device=args.device)
    for budget in budgets:
        row = {"budget": budget}
        for method, cal in (("fisher", fi), ("exact", ex)):
            plan = make_plan(cal, "graded", budget_bpw=budget, granularity="matrix", dtype=eng.dtype)
            ck = work / f"plan-{method}-{budget}"
            shutil.rmtree(ck, ignore_errors=True)
            convert(model, ck, quant=plan)
            ev = ref.compare(ck)
            shutil.rmtree(ck)
            row[method] = {"kl_mean": ev["kl"]["mean"], "kl_stderr": ev["kl"]["stderr"], "bpw": ev["expert_bpw"],
                           "formats": sorted(plan.used_formats())}
        row["ratio"] = row["fisher"]["kl_mean"] / row["exact"]["kl_mean"]
        out["plans"].append(row)
        log(f"  budget {budget}: held-out KL fisher plan {row['fisher']['kl_mean']:.5f} ± "
            f"{row['fisher']['kl_stderr']:.5f} ({row['fisher']['bpw']:.3f} bpw), exact plan "
            f"{row['exact']['kl_mean']:.5f} ± {row['exact']['kl_stderr']:.5f} ({row['exact']['bpw']:.3f} bpw): "
            f"ratio {row['ratio']:.3f}")
    return out


def routing_split(eng, ids, fi: dict, fmt_name: str) -> dict:
    """Exact ΔKL per expert matrix with free and with frozen later routing (see the module docstring),
    next to the Fisher estimate ``fi`` of the same tokens."""
    import types

    import torch
    import torch.nn.functional as F
    from scipy.stats import spearmanr

    from trtmoe.model.description import NORM_NONE, NORM_RENORMALIZE
    from trtmoe.quant.plan import format_obj

    c = eng.cfg
    if c.normalization_mode not in (NORM_NONE, NORM_RENORMALIZE):
        raise SystemExit("--routing-split: only softmax top-k routers (Mixtral, Qwen, DeepSeek-MoE)")
    E = c.num_experts
    moe_layers = [l for l in range(c.num_layers) if c.moe_layers[l]]
    if any(eng.layers[l].shared_fc is not None for l in moe_layers):
        raise SystemExit("--routing-split: models without shared experts only")
    frozen: dict[int, torch.Tensor] = {}
    own_moe = eng._moe

    def moe(self, li, lay, x, valid=None, stats=None):
        # The engine's MoE layer with the top-k ids given; weights from this pass's router logits.
        if li not in frozen:
            return own_moe(li, lay, x, valid, stats)
        h = x.reshape(-1, x.shape[-1])
        logits = lay.router(h.float())
        idx = frozen[li]
        w = (logits.gather(-1, idx).softmax(-1) if c.normalization_mode == NORM_RENORMALIZE
             else logits.softmax(-1).gather(-1, idx)).to(h.dtype)
        out = torch.zeros_like(h)
        for e in range(E):
            hit = idx == e
            rows = hit.any(-1).nonzero().squeeze(-1)
            if len(rows):
                out.index_add_(0, rows, lay.experts.forward(e, h[rows]) * (w[rows] * hit[rows]).sum(-1, keepdim=True))
        return out.reshape(x.shape)

    ref_idx: dict[int, torch.Tensor] = {}
    eng.route_hook = lambda li, idx: ref_idx.__setitem__(li, idx.detach().clone())
    with torch.no_grad():
        ref = eng.logits(ids).float().log_softmax(-1)
    eng.route_hook = None
    eng._moe = types.MethodType(moe, eng)

    def kl() -> float:
        with torch.no_grad():
            lp = eng.logits(ids).float().log_softmax(-1)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    fmt = format_obj(fmt_name, eng.dtype)
    out = {"format": fmt_name, "layers": {}}
    log(f"Routing split, {fmt_name}, {ids.shape[0]} x {ids.shape[1]} tokens: ΔKL summed over the layer's "
        "expert matrices (fc, proj)")
    log(f"  {'layer':>5s} {'free':>10s} {'frozen':>10s} {'fisher':>10s}   rho(fisher, free / frozen) per matrix"
        f", per expert")
    try:
        for l in moe_layers[:-1]:
            bank = eng.layers[l].experts
            free, held = [], []
            for e in range(E):
                for m in ("fc", "proj"):
                    wt = bank.fc[e] if m == "fc" else bank.proj[e]
                    keep = wt.clone()
                    wt.copy_(fmt.dequantize(fmt.quantize(wt, dtype=eng.dtype), dtype=eng.dtype))
                    free.append(kl())
                    frozen.update({l2: ref_idx[l2] for l2 in moe_layers if l2 > l})
                    held.append(kl())
                    frozen.clear()
                    wt.copy_(keep)
            est = [fi["sensitivity"]["matrices"][m]["delta_kl"][fmt_name][l][e] for e in range(E) for m in ("fc", "proj")]
            per_e = lambda v: [v[2 * e] + v[2 * e + 1] for e in range(E)]  # noqa: E731
            row = {"free": free, "frozen": held, "fisher": est,
                   "rho_free": float(spearmanr(est, free).statistic),
                   "rho_frozen": float(spearmanr(est, held).statistic),
                   "rho_free_expert": float(spearmanr(per_e(est), per_e(free)).statistic),
                   "rho_frozen_expert": float(spearmanr(per_e(est), per_e(held)).statistic)}
            out["layers"][l] = row
            log(f"  {l:5d} {sum(free):10.3e} {sum(held):10.3e} {sum(est):10.3e}   "
                f"{row['rho_free']:.3f} / {row['rho_frozen']:.3f}, {row['rho_free_expert']:.3f} / "
                f"{row['rho_frozen_expert']:.3f}")
    finally:
        eng._moe = own_moe
    return out


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:8])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/trtmoe-bench-calib-cost")
    ap.add_argument("--experts", default="8,32,64,128")
    ap.add_argument("--exact-max-experts", type=int, default=128, help="skip exact above this E")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--accuracy", default=None, help="a trained fixture: Spearman and plan KL instead of cost")
    ap.add_argument("--budgets", default="4.5,5.0")
    ap.add_argument("--heldout-oracle", action="store_true",
                    help="also measure exact ΔKL on held-out text and rank both calibrations against it")
    ap.add_argument("--routing-split", metavar="FORMAT", default=None,
                    help="with --accuracy: exact ΔKL per matrix with free and with frozen later routing")
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--eval-seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    if args.accuracy:
        if args.formats == "int8,int4":
            args.formats = "int8,int4,int4_g128,int4_g64"
        res = accuracy(args)
    else:
        res = cost(args)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
