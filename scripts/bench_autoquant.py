#!/usr/bin/env python3
"""trtmoe's graded per-layer plans beside ModelOpt 0.47's AutoQuantize at the same effective bits.

For each trained fixture and each budget (average stored bits per routed-expert weight, scales
counted): trtmoe calibrates the ladder formats on the calibration windows (``calibrate``, ΔKL per
expert matrix and format, activation quantization included) and the allocator makes a graded plan
per MoE layer (``make_plan(..., granularity="layer")``); ModelOpt's ``mtq.auto_quantize`` searches
the same formats per MoE layer on the same calibration windows in its own environment
(tests/reference/modelopt_autoquantize.py; gradient method with next-token cross entropy, and kl_div
with ``--methods``), and its per-layer choice is read back. Both plans, and every uniform format whose
bits fit the budget, are then run by the SAME evaluator: the embedded engine with each MoE layer's
experts quantized by trtmoe's format classes (input scales from the layer input amax measured on
the calibration windows), mean KL(float || quantized) per held-out token. trtmoe's per-expert plan at
the same budget is shown too (AutoQuantize groups all experts of a layer into one decision), and a
per-layer plan that may also use ``--also`` (default w4a8_awq, which ModelOpt 0.47's W4A8 config cannot
quantize in transformers' fused experts). ``--search`` adds uniform w4a8_awq with every expert matrix's
pre-quant scale and clip searched on its routed calibration tokens (``trtmoe.quant.awq.search_w4a8``).

    python scripts/bench_autoquant.py [--budgets 5,6] [--ladder fp8,nvfp4] [--methods gradient]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from safetensors.torch import save_file  # noqa: E402

from bench_formats import (FIXTURES, MODELOPT_CFG, expert_bytes, fixture_windows, moe_inputs,  # noqa: E402
                           text_splits)
from trtmoe.checkpoint.writer import convert  # noqa: E402
from trtmoe.quant.awq import expert_inputs, search_w4a8  # noqa: E402
from trtmoe.quant.calibrate import calibrate, kl_per_token  # noqa: E402
from trtmoe.quant.formats import FORMATS, QUANTIZED  # noqa: E402
from trtmoe.quant.policies import make_plan  # noqa: E402
from trtmoe.quant.sensitivity import layer_input_amax  # noqa: E402
from trtmoe.runtime.engine import EmbeddedEngine  # noqa: E402
from trtmoe.runtime.experts import PackedExperts, PackedShard  # noqa: E402

FROM_MODELOPT = {cfg: name for name, cfg in MODELOPT_CFG.items()}


def bank(base, fc_names: list[str], proj_names: list[str], amax, dtype, cache, extra=None) -> PackedExperts:
    """Experts of one layer with expert e's fc in ``fc_names[e]`` and proj in ``proj_names[e]``
    (float names keep the model's weights); quantized matrices are cached per (expert, kind, format)."""
    shards = []
    for e, (fn, pn) in enumerate(zip(fc_names, proj_names)):
        mats = []
        for kind, n in (("fc", fn), ("proj", pn)):
            fmt = (extra or {}).get(n) or FORMATS[n]
            key = (e, kind, n)
            if key not in cache:
                w = base.row_major(e)[kind]
                cache[key] = (fmt.quantize(w, dtype=dtype, input_amax=amax[kind]) if n in QUANTIZED
                              else fmt.quantize(w, dtype=dtype))
            mats += [fmt, cache[key]]
        shards.append([PackedShard(*mats)])
    return PackedExperts(shards, list(fc_names))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--ladder", default="fp8,nvfp4", help="quantized formats both searches choose from")
    ap.add_argument("--also", default="w4a8_awq",
                    help="formats trtmoe's per-layer plan may also use in an extra column (ones AutoQuantize "
                         "cannot run here; '' for none)")
    ap.add_argument("--search", default="w4a8_awq",
                    help="also a uniform plan of this W4A8 format with each expert matrix's pre-quant scale and "
                         "clip searched on its routed calibration tokens (awq.search_w4a8); '' for none")
    ap.add_argument("--budgets", default="5,6")
    ap.add_argument("--methods", default="gradient", help="AutoQuantize methods: gradient,kl_div")
    ap.add_argument("--fixtures", default=",".join(FIXTURES))
    ap.add_argument("--modelopt-python", default=os.environ.get("TRTMOE_MODELOPT_PYTHON",
                                                                "/work/venvs/modelopt/bin/python"))
    args = ap.parse_args()
    ladder = args.ladder.split(",")
    methods = [m for m in args.methods.split(",") if m]
    also = [f for f in args.also.split(",") if f and f not in ladder]
    budgets = [float(b) for b in args.budgets.split(",")]
    mo_ok = Path(args.modelopt_python).exists()
    work = Path(tempfile.mkdtemp(prefix="bench_autoquant_"))
    rows, searched_rows = [], []
    try:
        splits = text_splits(work, args.calib_samples, args.eval_samples, args.seq_len)
        for fx in args.fixtures.split(","):
            model = ROOT / "tests" / "fixtures" / fx
            ck = work / f"ck_{fx}"
            convert(model, ck)
            eng = EmbeddedEngine.from_checkpoint(ck, device="cpu", pack_experts=False)
            tok, cal, held = fixture_windows(model, splits, args.calib_samples, args.eval_samples, args.seq_len)
            c = eng.cfg
            E = c.num_experts
            layers = [l for l in range(c.num_layers) if c.moe_layers[l]]
            inputs = moe_inputs(eng, cal, layers)
            bases = {l: eng.layers[l].experts for l in layers}
            amax = {l: layer_input_amax(bases[l], *inputs[l]) for l in layers}
            flt = "bf16" if eng.dtype == torch.bfloat16 else "fp16"
            float_bytes = expert_bytes(FORMATS[flt], eng)
            with torch.inference_mode():
                ref = [eng.logits(b).float().log_softmax(-1) for b in held.split(8)]
            cache = {l: {} for l in layers}

            def evaluate(fc: dict, proj: dict, extra=None) -> tuple[float, float]:
                """Held-out KL of per-layer/per-expert format lists, and their average bits (``extra``:
                cache keys naming prepared packed tensors, with their format)."""
                for l in layers:
                    eng.layers[l].experts = bank(bases[l], fc[l], proj[l], amax[l], eng.dtype, cache[l], extra)
                kl, count = 0.0, 0
                try:
                    with torch.inference_mode():
                        for lp, b in zip(ref, held.split(8)):
                            kl += float(kl_per_token(lp, eng.logits(b)).sum())
                            count += lp.shape[0] * lp.shape[1]
                finally:
                    for l in layers:
                        eng.layers[l].experts = bases[l]
                I, H = c.expert_intermediate_size, c.hidden_size
                cls = lambda f: (extra or {}).get(f) or FORMATS[f]  # noqa: E731
                nbytes = sum(cls(f).weight_bytes(2 * I, H, 1) for l in layers for f in fc[l]) + \
                    sum(cls(f).weight_bytes(H, I, 1) for l in layers for f in proj[l])
                return kl / count, 8 * nbytes / (float_bytes / 2)

            print(f"\n{fx}: {len(layers)} MoE layers x {E} experts, calib {tuple(cal.shape)}, "
                  f"held-out {tuple(held.shape)}", flush=True)
            uniform = {}
            for n in [flt, *QUANTIZED]:
                uniform[n] = evaluate({l: [n] * E for l in layers}, {l: [n] * E for l in layers})
                print(f"  uniform {n:<13} {uniform[n][1]:6.3f} bits  KL {uniform[n][0]:.5f}", flush=True)
            if args.search:
                t0 = time.perf_counter()
                fmt, searched = FORMATS[args.search], {}
                for l in layers:
                    x_all, routed = inputs[l]
                    for e in range(E):
                        w = bases[l].row_major(e)
                        xs = dict(zip(("fc", "proj"), expert_inputs(w["fc"].float(), x_all[(routed == e).any(-1)].float())))
                        for kind in ("fc", "proj"):
                            if xs[kind].shape[0]:
                                cache[l][(e, kind, "searched")] = search_w4a8(
                                    fmt, w[kind], xs[kind], dtype=eng.dtype, input_amax=amax[l][kind])[0]
                            else:  # an expert no calibration token reached: plain rounding
                                cache[l][(e, kind, "searched")] = fmt.quantize(w[kind], dtype=eng.dtype,
                                                                               input_amax=amax[l][kind])
                kl_s = evaluate({l: ["searched"] * E for l in layers}, {l: ["searched"] * E for l in layers},
                                {"searched": fmt})
                print(f"  uniform {args.search} with search_w4a8: KL {kl_s[0]:.5f} (plain rounding "
                      f"{uniform[args.search][0]:.5f}, {kl_s[0] / uniform[args.search][0]:.3f}x; "
                      f"{time.perf_counter() - t0:.0f} s)", flush=True)
                searched_rows.append((fx, uniform[args.search][0], kl_s[0]))
            t0 = time.perf_counter()
            calib = calibrate(model, splits[0], work / f"calib_{fx}", samples=args.calib_samples,
                              seq_len=args.seq_len, formats=tuple(ladder + also), force=True, rounding="rtn")
            print(f"  trtmoe calibration over {ladder + also}: {time.perf_counter() - t0:.1f} s", flush=True)
            ids_path = work / f"ids_{fx}.safetensors"
            save_file({"ids": cal.contiguous()}, ids_path)
            for b in budgets:
                res = {}
                for gran, key, fs in (("layer", "layer", ladder), ("expert", "expert", ladder),
                                      ("layer", "layer_also", ladder + also)):
                    if key == "layer_also" and not also:
                        continue
                    plan = make_plan(calib, "graded", budget_bpw=b, granularity=gran, formats=["float", *fs],
                                     dtype=eng.dtype, I_loc=c.expert_intermediate_size)
                    fc = {l: [flt if f in ("float", "fp16", "bf16") else f for f in plan.formats[l]] for l in layers}
                    pf = plan.proj_formats or plan.formats
                    proj = {l: [flt if f in ("float", "fp16", "bf16") else f for f in pf[l]] for l in layers}
                    res[key] = evaluate(fc, proj)
                    if gran == "layer":
                        res[key + "_formats"] = [fc[l][0] for l in layers]
                for m in methods if mo_ok else []:
                    out = work / f"aq_{fx}_{b}_{m}.json"
                    t0 = time.perf_counter()
                    proc = subprocess.run([args.modelopt_python, str(ROOT / "tests" / "reference" / "modelopt_autoquantize.py"),
                                           str(model), str(ids_path), str(b),
                                           ",".join(MODELOPT_CFG[n] for n in ladder), m, str(out)],
                                          capture_output=True, text=True, timeout=3600)
                    if proc.returncode != 0:
                        res[m] = (proc.stderr.strip().splitlines() or ["failed"])[-1][:120]
                        continue
                    chosen = json.loads(out.read_text())["layers"]
                    names = {l: FROM_MODELOPT.get(chosen[str(l)], flt) for l in layers}
                    res[m] = evaluate({l: [names[l]] * E for l in layers}, {l: [names[l]] * E for l in layers})
                    res[m + "_formats"] = [names[l] for l in layers]
                    res[m + "_s"] = time.perf_counter() - t0
                fits = {n: v for n, v in uniform.items() if v[1] <= b + 1e-9}
                fits_set = {n: v for n, v in fits.items() if n in ladder}
                best_set = min(fits_set, key=lambda n: fits_set[n][0]) if fits_set else None
                best_all = min(fits, key=lambda n: fits[n][0]) if fits else None
                rows.append((fx, b, res, best_set, fits_set.get(best_set), best_all, fits.get(best_all)))
                print(f"  budget {b}: {res}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print("\n| fixture | budget | trtmoe per-layer bits | KL | AutoQuantize method | bits | KL | trtmoe/AQ "
          "| best uniform in set (KL) | trtmoe/uniform | trtmoe per-expert KL | best uniform any format (KL) "
          f"| trtmoe per-layer +{','.join(also) or '-'} KL (formats) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fx, b, res, bs, bsv, ba, bav in rows:
        tkl, tbits = res["layer"]
        for m in methods or ["none"]:
            got = res.get(m)
            if isinstance(got, tuple):
                aq = f"{m} | {got[1]:.2f} | {got[0]:.5f} | {tkl / got[0]:.2f}x"
            else:
                aq = f"{m} | – | {got or 'not run'} | –"
            uni = f"{bs} ({bsv[0]:.5f}) | {tkl / bsv[0]:.2f}x" if bs else "none fits | –"
            extra = (f"{res['layer_also'][0]:.5f} ({','.join(res['layer_also_formats'])})"
                     if "layer_also" in res else "–")
            best = f"{ba} ({bav[0]:.5f})" if ba else "none fits"
            print(f"| {fx} | {b:.1f} | {tbits:.2f} | {tkl:.5f} | {aq} | {uni} | {res['expert'][0]:.5f} "
                  f"({res['expert'][1]:.2f} b) | {best} | {extra} |")
        print(f"|   | | trtmoe layers: {','.join(res['layer_formats'])} | | AQ layers: "
              + "; ".join(f"{m}: {','.join(res.get(m + '_formats', []))}" for m in methods)
              + " | | | | | | | | |")
    for fx, rtn, srch in searched_rows:
        print(f"uniform {args.search} on {fx}: held-out KL plain rounding {rtn:.5f}, search_w4a8 {srch:.5f} "
              f"({srch / rtn:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
