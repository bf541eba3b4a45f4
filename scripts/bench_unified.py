#!/usr/bin/env python3
"""Exported unified-HF checkpoints measured by loading them: held-out KL, same top-1 and bytes.

For each trained fixture (tests/fixtures/trained_mixtral, trained_qwen3_moe, trained_qwen3_moe_deep) and
each budget (average stored bits per routed-expert weight, scales counted, as ModelOpt's ``effective_bits``
counts them):

* trtmoe's graded per-layer plan: ``trtmoe calibrate`` measures each expert matrix's ΔKL in FP8 and
  NVFP4 on the calibration windows, the allocator spends the budget per MoE layer
  (``build.unified_hf.plan_from_calibration``, the plan ``convert --target vllm --budget`` makes), and
  the checkpoint is written by ``checkpoint.unified_hf.write_unified_checkpoint`` with the calibration's
  input amax;
* ModelOpt 0.47 AutoQuantize's plan (tests/reference/modelopt_autoquantize.py, gradient method, in its
  own environment; skipped when absent) over the same formats on the same calibration windows:
  its per-layer choice written by the same writer with the same input amax ("AQ plan, trtmoe export"),
  and the searched model exported by ModelOpt itself ("AQ, ModelOpt export");
* uniform FP8, NVFP4 and MXFP4 (W4A16, ``--uniform``) experts, and the unquantized export (bf16), for scale;
* uniform W4A8-AWQ experts rounded to nearest (pre-quant scale one), and with the pre-quant scale and
  clip that a ``--rounding awq`` calibration over ``w4a8_awq`` searched per expert matrix on the same
  calibration windows (``trtmoe.quant.awq.search_w4a8``), written by the same writer with that
  calibration's recipes (``awq.checkpoint_rounding``; what ``convert --target vllm|trtllm-pytorch
  --calib`` does; under ``--final-only`` the ladder calibration's recipes, with W4A8's error-feedback
  codes under its rounding). ``--no-w4a8`` leaves these out.
* the same with activation-aware rounding of the FP8 / NVFP4 experts (``--rounding``, default awq_gptq:
  ``trtmoe.quant.fp_gptq``'s error-feedback codes and block-scale search on each expert matrix's routed
  inputs): a second calibration measures the candidates' ΔKL under that rounding, its graded plan is
  written with it ("trtmoe graded, R"), and the uniform and AutoQuantize plans are written with it too
  (", R export"), the codes recomputed from that calibration's stored inputs as ``convert --calib`` does.
* the graded plans over wider ladders (``--ladder``, repeatable; default {bf16, fp8, nvfp4, w4a8_awq},
  {bf16, fp8, nvfp4, mxfp4} and {bf16, fp8, nvfp4, mxfp4, w4a8_awq}), rows "trtmoe graded {formats}, R":
  one calibration over the union of the ladders' quantized formats with rounding R (W4A8 scored with its
  searched pre-quant scale and clip under FP8 inputs, FP8 / NVFP4 / MXFP4 with their activation-aware
  codes), and per ladder the plan that ``convert --target vllm --budget B --calib C`` makes from it
  restricted to the ladder's formats (per-layer W4A8 and MXFP4 are unlisted, accepted cells of vLLM's
  MIXED_PRECISION), written with that calibration's W4A8 recipes and float-format codes.
* AutoQuantize over each wider ladder's formats that it can take: ModelOpt 0.47 makes no W4A8 for fused
  experts, so over {fp8, nvfp4, mxfp4}, MXFP4 being weight-only ``MXFP4_MLP_WEIGHT_ONLY_CFG`` costed at its
  stored 4.25 bits (ModelOpt counts it as 4.0, its E8M0 scales left out, and would spend bits the budget
  does not have). ModelOpt 0.47 exports the MXFP4 layers of such a plan unquantized (bf16, listed in
  ``exclude_modules``), so the plan is written by trtmoe's writer rounded to nearest, as ModelOpt's
  quantizers round ("AQ {formats} plan, rtn export"), and once more with the rounding R (", R export": the
  plan's choice alone against trtmoe's). The graded {fp8, nvfp4, mxfp4} plan is then a same-formats
  comparison, as the {fp8, nvfp4} one is against "AQ, ModelOpt export".

Every checkpoint is then loaded by the embedded engine from its packed bytes
(``trtmoe.runtime.unified_load``: each linear on its format's kernel, activations quantized with the
checkpoint's input scales) and run on the held-out windows against the source model (loaded the same
way): mean KL(source || checkpoint) per token, the share of positions with the same top-1, the
checkpoint's bytes on disk and its routed experts' stored bits per weight.

    python scripts/bench_unified.py [--budgets 5,6] [--calib-samples 16] [--eval-samples 16] [--no-w4a8]
                                    [--rounding awq_gptq] [--uniform fp8,nvfp4,mxfp4]
                                    [--ladder fp8,nvfp4,mxfp4,w4a8_awq ...] [--final-only]

(``--budgets ''`` measures the uniform rows only; ``--final-only`` leaves out the rows the last tables do
not use: the round-to-nearest calibration and graded plan, AutoQuantize's plan written by trtmoe, and the
separate ``--rounding awq`` calibration of uniform W4A8, whose recipes are then the ladder calibration's.)
The last tables give, per fixture and budget, trtmoe's graded plans under the rounding (over {fp8, nvfp4},
then one table per ``--ladder``) against ModelOpt's AutoQuantize export (target ≤ 0.75×) and against the
best uniform format within the budget (≤ 0.6×, every uniform row counts), every ratio from the same run.
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

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench_formats import fixture_windows, text_splits  # noqa: E402
from trtmoe.build.unified_hf import calib_input_amax, plan_from_calibration  # noqa: E402
from trtmoe.checkpoint import unified_hf as U  # noqa: E402
from trtmoe.checkpoint.unified_rounding import UnifiedRounding  # noqa: E402
from trtmoe.hf.reader import HFCheckpoint  # noqa: E402
from trtmoe.quant import awq  # noqa: E402
from trtmoe.quant.calibrate import calibrate, kl_per_token, load_calib  # noqa: E402
from trtmoe.runtime.unified_load import load_unified_engine  # noqa: E402

FIXTURES = ("trained_mixtral", "trained_qwen3_moe", "trained_qwen3_moe_deep")
MODELOPT_CFG = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
# What AutoQuantize can search per MoE layer here: the two above and MXFP4 weight-only (W4A16, gpt-oss's
# scheme), costed at its stored 4.25 bits (ModelOpt 0.47 counts it as 4.0, its E8M0 scales left out, and
# would then spend bits the budget does not have). W4A8-AWQ is not among them: ModelOpt 0.47 makes none for
# fused experts.
AQ_CFG = {**MODELOPT_CFG, "mxfp4": "MXFP4_MLP_WEIGHT_ONLY_CFG@4.25"}
FROM_MODELOPT = {v.partition("@")[0]: k for k, v in AQ_CFG.items()}


def checkpoint_facts(ck: Path) -> tuple[int, float]:
    """(bytes of the safetensors files, stored bits per routed-expert weight: every tensor of the
    experts, scales and input scales included, over the experts' weight count)."""
    total = sum(f.stat().st_size for f in ck.glob("*.safetensors"))
    nbytes, weights = 0, 0
    for f in ck.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if ".experts." not in k:
                    continue
                sl = fh.get_slice(k)
                shape, dt = sl.get_shape(), sl.get_dtype()
                n = 1
                for s in shape:
                    n *= s
                nbytes += n * {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I8": 1}[dt]
                if k.endswith(".weight"):
                    # packed E2M1 holds two weights per byte
                    weights += n * (2 if dt == "U8" else 1)
    return total, 8 * nbytes / max(weights, 1)


def evaluate(ck: Path, held: torch.Tensor, ref: list[torch.Tensor]) -> tuple[float, float]:
    eng = load_unified_engine(ck, device="cpu")
    kl, same, count = 0.0, 0, 0
    with torch.inference_mode():
        for lp, b in zip(ref, held.split(8)):
            lg = eng.logits(b).float()
            kl += float(kl_per_token(lp, lg).sum())
            same += int((lg.argmax(-1) == lp.argmax(-1)).sum())
            count += lp.shape[0] * lp.shape[1]
    return kl / count, same / count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--budgets", default="5,6")
    ap.add_argument("--fixtures", default=",".join(FIXTURES))
    ap.add_argument("--method", default="gradient", help="AutoQuantize method (gradient or kl_div)")
    ap.add_argument("--engine", default="vllm-0.33", help="support cell the graded plan follows (per-layer mixed "
                                                          "FP8/NVFP4 experts)")
    ap.add_argument("--sm", type=int, default=100)
    ap.add_argument("--modelopt-python", default=os.environ.get("TRTMOE_MODELOPT_PYTHON",
                                                                "/work/venvs/modelopt/bin/python"))
    ap.add_argument("--keep", default=None, help="keep the checkpoints in this directory")
    ap.add_argument("--no-w4a8", dest="w4a8", action="store_false",
                    help="leave out the W4A8-AWQ rows (uniform rounded to nearest and searched, and the graded "
                         "plans over the ladder with w4a8_awq)")
    ap.add_argument("--rounding", default="awq_gptq", choices=("gptq", "awq_gptq", "awq"),
                    help="activation-aware rounding of the float-format experts for the rows marked with it")
    ap.add_argument("--uniform", default="fp8,nvfp4,mxfp4",
                    help="float formats measured as uniform rows, rounded to nearest and with the rounding "
                         "(fp8 and nvfp4 always; each counts in 'best uniform within budget')")
    ap.add_argument("--ladder", action="append", default=None, metavar="F1,F2,...",
                    help="quantized formats of a graded ladder beside bf16 (repeatable; default "
                         "fp8,nvfp4,w4a8_awq, fp8,nvfp4,mxfp4 and fp8,nvfp4,mxfp4,w4a8_awq); one calibration "
                         "covers them all")
    ap.add_argument("--final-only", action="store_true",
                    help="leave out the rows the final tables do not use (round-to-nearest graded plan, "
                         "AutoQuantize's plan written by trtmoe, the separate awq calibration of uniform W4A8)")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    ladder = list(MODELOPT_CFG)
    uniform = list(dict.fromkeys([*ladder, *(f.strip() for f in args.uniform.split(",") if f.strip())]))
    ladders = [tuple(f.strip() for f in spec.split(",") if f.strip())
               for spec in (args.ladder or ["fp8,nvfp4,w4a8_awq", "fp8,nvfp4,mxfp4", "fp8,nvfp4,mxfp4,w4a8_awq"])]
    if not args.w4a8:
        ladders = [lad for lad in ladders if "w4a8_awq" not in lad]
    ladders = [lad for lad in dict.fromkeys(ladders) if lad and lad != tuple(ladder)]
    for f in {*uniform, *(f for lad in ladders for f in lad)}:
        if f not in U.FORMATS or f == "bf16":
            ap.error(f"unknown quantized format {f!r} (one of {', '.join(x for x in U.FORMATS if x != 'bf16')})")
    if "w4a8_awq" in uniform:
        ap.error("--uniform takes float formats; the uniform W4A8-AWQ rows are on unless --no-w4a8")
    union = list(dict.fromkeys([*ladder, *(f for lad in ladders for f in lad)]))
    mo_ok = Path(args.modelopt_python).exists()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_unified_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        splits = text_splits(work, args.calib_samples, args.eval_samples, args.seq_len)
        for fx in args.fixtures.split(","):
            model = ROOT / "tests" / "fixtures" / fx
            tok, cal, held = fixture_windows(model, splits, args.calib_samples, args.eval_samples, args.seq_len)
            src = load_unified_engine(model, device="cpu")  # the source model itself, the same loader
            with torch.inference_mode():
                ref = [src.logits(b).float().log_softmax(-1) for b in held.split(8)]
            del src
            with HFCheckpoint(model) as hf:
                layers = [l for l, m in enumerate(hf.model.moe_layers) if m]
            print(f"\n{fx}: MoE layers {layers}, calib {tuple(cal.shape)}, held-out {tuple(held.shape)}", flush=True)
            R = args.rounding
            calib_dir = None
            if not args.final_only:
                t0 = time.perf_counter()
                calib_dir = work / f"calib_{fx}"
                calibrate(model, splits[0], calib_dir, samples=args.calib_samples, seq_len=args.seq_len,
                          formats=tuple(ladder), force=True, rounding="rtn")
                print(f"  calibration over {ladder}: {time.perf_counter() - t0:.0f} s", flush=True)
                t0 = time.perf_counter()
                calib_r = work / f"calib_{fx}_{R}"
                calibrate(model, splits[0], calib_r, samples=args.calib_samples, seq_len=args.seq_len,
                          formats=tuple(ladder), force=True, rounding=R)
                print(f"  calibration over {ladder} with {R} rounding: {time.perf_counter() - t0:.0f} s", flush=True)
            with U.SourceModel(model) as s_:
                dtype = s_.info(next(m for m in s_.modules() if m.kind == "expert").tensor).dtype
            calib_w = rnd_w = rec_w = None
            if ladders:  # the wider ladders: one calibration over the union of their quantized formats
                t0 = time.perf_counter()
                calib_w = work / f"calib_{fx}_{R}_{'_'.join(union)}"
                calibrate(model, splits[0], calib_w, samples=args.calib_samples, seq_len=args.seq_len,
                          formats=tuple(union), force=True, rounding=R)
                print(f"  calibration over {union} with {R} rounding: {time.perf_counter() - t0:.0f} s", flush=True)
                rnd_w = UnifiedRounding.from_calibration(calib_w, R, dtype)
                if "w4a8_awq" in union:
                    rec_w = awq.checkpoint_rounding(calib_w, load_calib(calib_w), dtype)
            if args.final_only:
                if calib_w is None:  # the {fp8, nvfp4} plan still needs a calibration under the rounding
                    calib_w = work / f"calib_{fx}_{R}"
                    calibrate(model, splits[0], calib_w, samples=args.calib_samples, seq_len=args.seq_len,
                              formats=tuple(ladder), force=True, rounding=R)
                    rnd_w = UnifiedRounding.from_calibration(calib_w, R, dtype)
                calib_r = calib_w  # the {fp8, nvfp4} plan restricted from the union's calibration
            amax = calib_input_amax(model, calib_dir or calib_r)
            rnd = UnifiedRounding.from_calibration(calib_r, R, dtype)

            def measure(name: str, budget, plan: U.UnifiedPlan | None = None, ck: Path | None = None, note="",
                        rounding=None, fp_rounding=None):
                if ck is None:
                    ck = work / f"{fx}_{name.replace(' ', '_').replace(',', '')}_{budget}"
                    t1 = time.perf_counter()
                    before = dict(fp_rounding.counts) if fp_rounding else {}
                    U.write_unified_checkpoint(model, ck, plan, input_amax=amax, force=True, rounding=rounding,
                                               fp_rounding=fp_rounding)
                    if fp_rounding:
                        note += (f" ({fp_rounding.counts['rounded'] - before['rounded']} matrices rounded, "
                                 f"{fp_rounding.counts['nearest'] - before['nearest']} kept RTN; "
                                 f"export {time.perf_counter() - t1:.0f} s)")
                kl, top1 = evaluate(ck, held, ref)
                nbytes, bits = checkpoint_facts(ck)
                rows.append((fx, budget, name, bits, nbytes, kl, top1, note))
                print(f"  {name:<26} budget {budget}: experts {bits:.3f} bits, {nbytes} B, KL {kl:.5f}, "
                      f"same top-1 {top1:.4f} {note}", flush=True)

            def autoquantize(budget, fmts):
                """ModelOpt AutoQuantize over ``fmts`` at ``budget``, exported by ModelOpt: (its per-layer
                choice in trtmoe's names, seconds, the process, the export directory), or None."""
                tag = f"{fx}_{budget}_{'_'.join(fmts)}"
                out_json, mo_dir = work / f"aq_{tag}.json", work / f"aq_{tag}_modelopt"
                shutil.rmtree(mo_dir, ignore_errors=True)
                t0 = time.perf_counter()
                script = ROOT / "tests" / "reference" / "modelopt_autoquantize.py"
                p = subprocess.run([args.modelopt_python, str(script), str(model), str(ids_path), str(budget),
                                    ",".join(AQ_CFG[n] for n in fmts), args.method, str(out_json), str(mo_dir)],
                                   capture_output=True, text=True, timeout=3600, cwd="/tmp")
                secs = time.perf_counter() - t0
                if p.returncode != 0 and not out_json.is_file():
                    print(f"  AutoQuantize over {fmts} failed: {(p.stderr.strip().splitlines() or ['?'])[-1][:200]}",
                          flush=True)
                    return None
                chosen = json.loads(out_json.read_text())["layers"]
                names = {l: FROM_MODELOPT.get(chosen.get(str(l), ""), "bf16") for l in layers}
                print(f"  AutoQuantize over {{{','.join(fmts)}}} plan {','.join(names[l] for l in layers)} "
                      f"({secs:.0f} s search+export)", flush=True)
                return names, secs, p, mo_dir

            measure("bf16", "-", U.UnifiedPlan.uniform("bf16", layers))
            for f in uniform:
                measure(f"uniform {f}", "-", U.UnifiedPlan({l: f for l in layers}))
                measure(f"uniform {f}, {R}", "-", U.UnifiedPlan({l: f for l in layers}), fp_rounding=rnd)
            if args.w4a8:
                w4 = U.UnifiedPlan({l: "w4a8_awq" for l in layers})
                measure("uniform w4a8_awq, rtn", "-", w4)
                if args.final_only and rec_w is not None:
                    measure("uniform w4a8_awq, searched", "-", w4, note=f"(recipes of the {R} ladder calibration)",
                            rounding=rec_w)
                else:
                    t0 = time.perf_counter()
                    w4_dir = work / f"calib_w4a8_{fx}"
                    calibrate(model, splits[0], w4_dir, samples=args.calib_samples, seq_len=args.seq_len,
                              formats=("w4a8_awq",), force=True, rounding="awq")
                    secs = time.perf_counter() - t0
                    measure("uniform w4a8_awq, searched", "-", w4, note=f"(awq calibration {secs:.0f} s)",
                            rounding=awq.checkpoint_rounding(w4_dir, load_calib(w4_dir), dtype))
            ids_path = work / f"ids_{fx}.safetensors"
            save_file({"ids": cal.contiguous()}, ids_path)
            for b in budgets:
                if calib_dir is not None:
                    plan, _ = plan_from_calibration(model, calib_dir, b, engine=args.engine, sm=args.sm,
                                                    formats=["bf16", *ladder])
                    measure("trtmoe graded", b, plan, note=",".join(plan.expert_formats[l] for l in layers))
                plan_r, _ = plan_from_calibration(model, calib_r, b, engine=args.engine, sm=args.sm,
                                                  formats=["bf16", *ladder])
                measure(f"trtmoe graded, {R}", b, plan_r, note=",".join(plan_r.expert_formats[l] for l in layers),
                        fp_rounding=rnd)
                for lad in ladders:
                    plan_w, _ = plan_from_calibration(model, calib_w, b, engine=args.engine, sm=args.sm,
                                                      formats=["bf16", *lad])
                    measure(f"trtmoe graded {{{','.join(lad)}}}, {R}", b, plan_w,
                            note=",".join(plan_w.expert_formats[l] for l in layers), rounding=rec_w,
                            fp_rounding=rnd_w)
                if not mo_ok:
                    continue
                got_aq = autoquantize(b, tuple(ladder))
                if got_aq is None:
                    continue
                names, secs, p, mo_dir = got_aq
                if not args.final_only:
                    measure("AQ plan, trtmoe export", b, U.UnifiedPlan(dict(names)),
                            note=",".join(names[l] for l in layers) + f" ({secs:.0f} s search+export)")
                    measure(f"AQ plan, {R} export", b, U.UnifiedPlan(dict(names)),
                            note=",".join(names[l] for l in layers), fp_rounding=rnd)
                if p.returncode == 0 and (mo_dir / "hf_quant_config.json").is_file():
                    measure("AQ, ModelOpt export", b, ck=mo_dir, note=",".join(names[l] for l in layers))
                else:
                    print(f"  ModelOpt export of the AutoQuantize model failed: "
                          f"{(p.stderr.strip().splitlines() or ['?'])[-1][:200]}", flush=True)
                # AutoQuantize over each wider ladder's formats that it can take (W4A8 left out). ModelOpt
                # 0.47 exports the MXFP4 layers of such a plan unquantized (bf16, excluded in its
                # hf_quant_config.json), so the plan is written by trtmoe's writer rounded to nearest, the
                # numerics ModelOpt's quantizers use, and with the rounding R for the plan alone.
                for aq_fmts in dict.fromkeys(tuple(f for f in lad if f in AQ_CFG) for lad in ladders):
                    if set(aq_fmts) <= set(MODELOPT_CFG):
                        continue
                    got_aq = autoquantize(b, aq_fmts)
                    if got_aq is None:
                        continue
                    names, secs = got_aq[:2]
                    note = ",".join(names[l] for l in layers)
                    measure(f"AQ {{{','.join(aq_fmts)}}} plan, rtn export", b, U.UnifiedPlan(dict(names)),
                            note=note + f" ({secs:.0f} s search+export)")
                    measure(f"AQ {{{','.join(aq_fmts)}}} plan, {R} export", b, U.UnifiedPlan(dict(names)),
                            note=note, fp_rounding=rnd_w)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print("\n| fixture | budget (expert bits) | checkpoint | expert bits stored | bytes | held-out KL | same top-1 "
          "| layers / note |")
    print("|---|---|---|---|---|---|---|---|")
    for fx, b, name, bits, nbytes, kl, top1, note in rows:
        print(f"| {fx} | {b} | {name} | {bits:.3f} | {nbytes:,} | {kl:.5f} | {top1:.4f} | {note} |")

    R = args.rounding
    print(f"\n| fixture | budget | trtmoe graded, {R} KL | AQ, ModelOpt export KL | ratio (target ≤ 0.75) "
          "| best uniform within budget | its KL | ratio (target ≤ 0.6) |")
    print("|---|---|---|---|---|---|---|---|")
    for fx in dict.fromkeys(r[0] for r in rows):
        for b in budgets:
            got = {name: (bits, kl) for f_, b_, name, bits, _, kl, _, _ in rows if f_ == fx and b_ in (b, "-")}
            if f"trtmoe graded, {R}" not in got:
                continue
            kl_r = got[f"trtmoe graded, {R}"][1]
            aq = got.get("AQ, ModelOpt export")
            uni = [(kl, name) for name, (bits, kl) in got.items() if name.startswith("uniform") and bits <= b + 1e-9]
            best = min(uni) if uni else None
            print(f"| {fx} | {b} | {kl_r:.5f} | {'-' if aq is None else f'{aq[1]:.5f}'} | "
                  f"{'-' if aq is None else f'{kl_r / aq[1]:.2f}x'} | {'-' if best is None else best[1]} | "
                  f"{'-' if best is None else f'{best[0]:.5f}'} | {'-' if best is None else f'{kl_r / best[0]:.2f}x'} |")

    for lad in ladders:
        name_w = f"trtmoe graded {{{','.join(lad)}}}, {R}"
        if not any(r[2] == name_w for r in rows):
            continue
        aq_fmts = tuple(f for f in lad if f in AQ_CFG)
        aq_name = (f"AQ {{{','.join(aq_fmts)}}} plan, rtn export" if not set(aq_fmts) <= set(MODELOPT_CFG)
                   else "AQ, ModelOpt export")
        print(f"\n| fixture | budget | graded {{fp8, nvfp4}} KL | graded {{{', '.join(lad)}}} | bits | its KL "
              f"| AutoQuantize {{{', '.join(aq_fmts)}}} | its KL | ratio (target ≤ 0.75) "
              "| best uniform within budget | its KL | ratio (target ≤ 0.6) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for fx in dict.fromkeys(r[0] for r in rows):
            for b in budgets:
                got = {name: (bits, kl, note) for f_, b_, name, bits, _, kl, _, note in rows
                       if f_ == fx and b_ in (b, "-")}
                if name_w not in got:
                    continue
                bits_w, kl_w, note_w = got[name_w]
                kl_r = got.get(f"trtmoe graded, {R}", (0, float("nan")))[1]
                aq = got.get(aq_name)
                uni = [(kl, name) for name, (bits, kl, _) in got.items()
                       if name.startswith("uniform") and bits <= b + 1e-9]
                best = min(uni) if uni else None
                print(f"| {fx} | {b} | {kl_r:.5f} | {note_w.split(' ')[0]} | {bits_w:.3f} | {kl_w:.5f} | "
                      f"{'-' if aq is None else aq[2].split(' ')[0]} | {'-' if aq is None else f'{aq[1]:.5f}'} | "
                      f"{'-' if aq is None else f'{kl_w / aq[1]:.2f}x'} | "
                      f"{'-' if best is None else best[1]} | {'-' if best is None else f'{best[0]:.5f}'} | "
                      f"{'-' if best is None else f'{kl_w / best[0]:.2f}x'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
