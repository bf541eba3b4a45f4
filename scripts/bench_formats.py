#!/usr/bin/env python3
"""Uniform fused-MoE formats on the trained fixtures: held-out KL, same top-1 and bytes.

For each fixture (tests/fixtures/trained_mixtral, trained_qwen3_moe): convert the float model, run it
in the embedded engine on calibration windows (``calib`` split) to measure each MoE layer's input
amax per matrix kind (``trtmoe.quant.sensitivity.layer_input_amax``), then store every routed expert in
one format (each expert's fc and proj quantized by the format's own ``quantize``, the static input
scales from those amax values) and compare the held-out windows' next-token distributions with the
float model's (mean KL, share of positions with the same top-1). The engine runs each matrix through
the format's ``linear``: weights dequantized, activations quantized as the format's kernel does. The
baseline (float, KL 0) and the engine-path formats (int8, int4_g128) are measured in the same run.

Beside each uniform format ModelOpt 0.47 runs here, ModelOpt's own quantization of the same model
(``--modelopt-python``, its separate environment; skipped when absent): ``mtq.quantize`` with its
config for the format, calibrated on the same calibration windows, exported as a unified-HF
checkpoint (tests/reference/modelopt_quantize_model.py); its routed experts' tensors (weights,
scales, input scales) are run by the same engine kernel (the format's ``linear``) with everything
else float, so the two columns differ only in how each quantized the experts. For FP8, FP8-block, NVFP4 and MXFP4 a
third column (``--rounding``, default awq_gptq) reads trtmoe's own unified-HF export of the same format
the same way: one ``calibrate`` over those formats with that rounding, then ``write_unified_checkpoint``
with the calibration's input amax and activation-aware codes (what ``convert --target vllm --calib``
writes); INT8 W8A16 has no activation-aware codes: its column is the export rounded to nearest (ModelOpt's
per-channel rule, not the engine path's int8 of the second column).

Then graded plans over the ladder FP16 / FP8 / FP4 (``--ladder``, default float, fp8, nvfp4): one
``trtmoe.quant.calibrate.calibrate`` run on the calibration windows measures every expert matrix's
ΔKL in each format (activation quantization included) and each layer's input amax; the allocator
(``make_plan``, policy graded) spends each budget in ``--budgets`` per expert and per layer; each plan
is converted (``convert``, the input scales from the calibration) and run by the embedded engine on
the held-out windows. KL should not increase as the budget grows.

For each format that quantizes its activations (FP8 W8A8, NVFP4 W4A4, FP8-block with 1x128 inputs) a
row "<format> acts only" keeps the weights unquantized and quantizes only the inputs, as the format's
kernel does with the same input scales: the KL no weight rounding can go below, and its ratio to
ModelOpt's KL for the format, the lowest ratio any rounding of the weights could reach (weight and
activation errors add, near enough, at these sizes).

    python scripts/bench_formats.py [--calib-samples 16] [--eval-samples 16] [--seq-len 128]
"""

from __future__ import annotations

import argparse
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

from dataclasses import replace  # noqa: E402

from trtmoe.build.unified_hf import calib_input_amax  # noqa: E402
from trtmoe.checkpoint import unified_hf as U  # noqa: E402
from trtmoe.checkpoint.unified_rounding import UnifiedRounding  # noqa: E402
from trtmoe.checkpoint.writer import convert  # noqa: E402
from trtmoe.quant import fp_gptq  # noqa: E402
from trtmoe.quant.calibrate import calibrate  # noqa: E402
from trtmoe.quant.policies import make_plan  # noqa: E402
from trtmoe.data import write_split_text, load_texts  # noqa: E402
from trtmoe.quant.calibrate import kl_per_token, token_batches  # noqa: E402
from trtmoe.quant.sensitivity import layer_input_amax  # noqa: E402
from trtmoe.quant.formats import FORMATS, QUANTIZED  # noqa: E402
from trtmoe.runtime.engine import EmbeddedEngine  # noqa: E402
from trtmoe.runtime.experts import PackedExperts, PackedShard  # noqa: E402
from trtmoe.runtime.load import load_tokenizer  # noqa: E402

FIXTURES = ("trained_mixtral", "trained_qwen3_moe")
MODELOPT_CFG = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG", "mxfp4": "MXFP4_DEFAULT_CFG",
                "fp8_block_wo": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "w4a8_awq": "W4A8_AWQ_BETA_CFG",
                "int8": "INT8_WEIGHT_ONLY_CFG"}
# HF names of an expert's gate, up and down matrices per family.
EXPERT_NAMES = {"mixtral": ("block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")),
                "qwen3_moe": ("mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"))}


class _SplitBank(PackedExperts):
    """Experts whose gate, up and down matrices are each one packed tensor set (ModelOpt's export keeps
    gate and up apart), run through the format's ``linear``: up / gate / down as trtmoe's fc / proj."""

    def __init__(self, fmt, mats: list[tuple[dict, dict, dict]]):
        self.fmt, self.mats, self.kernels, self._stacks = fmt, mats, False, []
        self.shards = [[None] for _ in mats]
        self.fc_names = self.proj_names = [fmt.name] * len(mats)

    def forward(self, e, x):
        g, u, d = self.mats[e]
        return self.fmt.linear(torch.nn.functional.silu(self.fmt.linear(x, g)) * self.fmt.linear(x, u), d)

    def forward_grouped(self, x, counts):
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                ys.append(self.forward(e, x[start:start + n]))
                start += n
        return torch.cat(ys) if ys else x.clone()

    def forward_picks(self, x, experts):
        return [self.forward(e, x) for e in experts]


def modelopt_banks(py: str, model: Path, ids: torch.Tensor, name: str, family: str, layers, E: int, out: Path):
    """ModelOpt's quantization of ``model``'s experts in format ``name`` as banks per MoE layer, or the
    reason there are none."""
    from safetensors.torch import save_file

    save_file({"ids": ids.contiguous()}, out / "ids.safetensors")
    exp = out / f"mo_{name}"
    proc = subprocess.run([py, str(ROOT / "tests" / "reference" / "modelopt_quantize_model.py"), str(model),
                           str(out / "ids.safetensors"), MODELOPT_CFG[name], str(exp)],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["failed"])[-1][:160]
    return export_banks(exp, name, family, layers, E)


def export_banks(exp: Path, name: str, family: str, layers, E: int):
    """The routed experts of a unified-HF export (ModelOpt's or trtmoe's) in format ``name`` as banks per
    MoE layer (each linear's tensors in the engine format's convention, as the unified loader reads
    them), or the reason there are none."""
    from safetensors.torch import load_file

    from trtmoe.runtime.unified_load import _engine_tensors

    t = {}
    for f in sorted(exp.glob("*.safetensors")):
        t.update(load_file(f))
    fmt = FORMATS[name]
    pre, roles = EXPERT_NAMES[family]
    if not any(".experts.0." in k and pre.split(".")[0] in k for k in t):
        pre, roles = EXPERT_NAMES["qwen3_moe"]  # some configs export transformers' fused experts under mlp.*
    banks = {}
    for l in layers:
        mats = []
        for e in range(E):
            per = []
            for r in roles:
                base = f"model.layers.{l}.{pre.format(e=e)}{r}."
                d = {k[len(base):]: v for k, v in t.items() if k.startswith(base)}
                if "weight" not in d or (name != "fp8_block_wo" and d["weight"].dtype.is_floating_point
                                         and d["weight"].dtype.itemsize > 1):
                    some = sorted(k for k in t if f"layers.{l}." in k and "experts" in k)[:2]
                    return f"no {name} expert tensors under {base}* in the export (e.g. {some})"
                # (ModelOpt 0.47 writes FP8-block's grid as [] or [1, 1, 1, 1] here: reshaped to the blocks)
                per.append(_engine_tensors(name, d, base[:-1]))
            mats.append(tuple(per))
        banks[l] = _SplitBank(fmt, mats)
    return banks


def moe_inputs(eng: EmbeddedEngine, ids: torch.Tensor, layers: list[int]):
    xs = {l: [] for l in layers}
    rs = {l: [] for l in layers}
    eng.layer_hook = lambda li, h: xs[li].append(h.clone())
    eng.route_hook = lambda li, idx: rs[li].append(idx.reshape(-1, idx.shape[-1]).clone())
    try:
        with torch.inference_mode():
            for b in ids.split(8):
                eng.logits(b)
    finally:
        eng.layer_hook = eng.route_hook = None
    return {l: (torch.cat([x.reshape(-1, x.shape[-1]) for x in xs[l]]), torch.cat(rs[l])) for l in layers}


class _ActsOnlyBank(PackedExperts):
    """Float experts whose matrices' inputs are quantized as ``fmt``'s kernel quantizes them (its input
    scales from ``amax``), the weights left unquantized."""

    def __init__(self, base, fmt, amax: dict[str, torch.Tensor], dtype):
        self.fmt, self.kernels, self._stacks = fmt, False, []
        self.mats = []
        for e in range(base.fc.shape[0]):
            w = base.row_major(e)
            self.mats.append({k: (w[k].float(), fmt.quantize(w[k], dtype=dtype, input_amax=amax[k]))
                              for k in ("fc", "proj")})
        self.shards = [[None] for _ in self.mats]
        self.fc_names = self.proj_names = [f"{fmt.name} acts"] * len(self.mats)

    def _lin(self, x, e, k):
        w, packed = self.mats[e][k]
        return (self.fmt.quantize_input(x.float(), packed) @ w.T).to(x.dtype)

    def forward(self, e, x):
        up, gate = self._lin(x, e, "fc").chunk(2, dim=-1)
        return self._lin(torch.nn.functional.silu(gate) * up, e, "proj")

    forward_grouped = _SplitBank.forward_grouped
    forward_picks = _SplitBank.forward_picks


def quantized_bank(base, fmt, amax: dict[str, torch.Tensor], dtype) -> PackedExperts:
    shards = []
    E = base.fc.shape[0]
    for e in range(E):
        w = base.row_major(e)
        fc = fmt.quantize(w["fc"], dtype=dtype, input_amax=amax["fc"])
        proj = fmt.quantize(w["proj"], dtype=dtype, input_amax=amax["proj"])
        shards.append([PackedShard(fmt, fc, fmt, proj)])
    return PackedExperts(shards, [fmt.name] * E)


def expert_bytes(fmt, eng) -> int:
    c = eng.cfg
    I, H, E = c.expert_intermediate_size, c.hidden_size, c.num_experts
    layers = sum(1 for l in range(c.num_layers) if c.moe_layers[l])
    return layers * (fmt.weight_bytes(2 * I, H, E) + fmt.weight_bytes(H, I, E))


def text_splits(work: Path, calib_samples: int, eval_samples: int, seq_len: int) -> tuple[Path, Path]:
    """The corpus's calibration and held-out splits under ``work``, cut to what the windows need."""
    calib_txt, held_txt = work / "calib.txt", work / "heldout.txt"
    write_split_text("calib", calib_txt, max_bytes=64 * calib_samples * seq_len)
    write_split_text("heldout", held_txt, max_bytes=64 * eval_samples * seq_len)
    return calib_txt, held_txt


def fixture_windows(model: Path, splits: tuple[Path, Path], calib_samples: int, eval_samples: int, seq_len: int):
    """A model's tokenizer and its calibration and held-out windows ([samples, seq_len] token ids)."""
    tok = load_tokenizer(model)
    return (tok, token_batches(load_texts(splits[0]), tok, calib_samples, seq_len),
            token_batches(load_texts(splits[1]), tok, eval_samples, seq_len))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--ladder", default="fp8,nvfp4", help="quantized rungs of the graded plans")
    ap.add_argument("--budgets", default="5,6,8,10,12")
    ap.add_argument("--fixtures", default=",".join(FIXTURES))
    ap.add_argument("--modelopt-python", default=os.environ.get("TRTMOE_MODELOPT_PYTHON",
                                                                "/work/venvs/modelopt/bin/python"))
    ap.add_argument("--formats", default="int8,int4_g128," + ",".join(n for n in QUANTIZED if not FORMATS[n].engine_path))
    ap.add_argument("--rounding", default="awq_gptq", choices=("rtn", "gptq", "awq_gptq", "awq"),
                    help="also write the FP8 / FP8-block / NVFP4 / MXFP4 experts with this activation-aware rounding "
                         "(a calibration over them, then the unified-HF export's codes, run by the same kernel as "
                         "ModelOpt's export); rtn: leave that column out")
    args = ap.parse_args()
    names = args.formats.split(",")
    work = Path(tempfile.mkdtemp(prefix="bench_formats_"))
    try:
        splits = text_splits(work, args.calib_samples, args.eval_samples, args.seq_len)
        for fx in args.fixtures.split(","):
            model = ROOT / "tests" / "fixtures" / fx
            ck = work / f"ck_{fx}"
            convert(model, ck)
            eng = EmbeddedEngine.from_checkpoint(ck, device="cpu", pack_experts=False)
            tok, cal, held = fixture_windows(model, splits, args.calib_samples, args.eval_samples, args.seq_len)
            c = eng.cfg
            layers = [l for l in range(c.num_layers) if c.moe_layers[l]]
            inputs = moe_inputs(eng, cal, layers)
            bases = {l: eng.layers[l].experts for l in layers}
            amax = {l: layer_input_amax(bases[l], *inputs[l]) for l in layers}
            with torch.inference_mode():
                ref = [eng.logits(b).float().log_softmax(-1) for b in held.split(8)]
            float_bytes = expert_bytes(FORMATS["bf16"] if eng.dtype == torch.bfloat16 else FORMATS["fp16"], eng)
            print(f"\n{fx}: dtype {eng.dtype}, {len(layers)} MoE layers x {c.num_experts} experts, "
                  f"calib {tuple(cal.shape)}, held-out {tuple(held.shape)}")
            def run_banks(banks):
                for l in layers:
                    eng.layers[l].experts = banks[l]
                kl, same, count = 0.0, 0, 0
                try:
                    with torch.inference_mode():
                        for lp, b in zip(ref, held.split(8)):
                            lg = eng.logits(b)
                            kl += float(kl_per_token(lp, lg).sum())
                            same += int((lg.argmax(-1) == lp.argmax(-1)).sum())
                            count += lp.shape[0] * lp.shape[1]
                finally:
                    for l in layers:
                        eng.layers[l].experts = bases[l]
                return kl / count, same / count

            mo_ok = Path(args.modelopt_python).exists()
            R = args.rounding
            exported = [n for n in names if R != "rtn" and n in U.FORMATS
                        and (fp_gptq.applies(FORMATS[n]) or not FORMATS[n].needs_input_amax)]
            aware = [n for n in exported if fp_gptq.applies(FORMATS[n])]
            rnd, amax_u = None, {}
            if aware:  # one calibration over the formats that take activation-aware codes
                t0 = time.perf_counter()
                cal_r = work / f"calib_{fx}_{R}"
                calibrate(model, splits[0], cal_r, samples=args.calib_samples, seq_len=args.seq_len,
                          formats=tuple(aware), force=True, rounding=R)
                rnd = UnifiedRounding.from_calibration(cal_r, R, eng.dtype)
                amax_u = calib_input_amax(model, cal_r)
                print(f"calibration over {aware} with {R} rounding: {time.perf_counter() - t0:.0f} s")
            print(f"{'format':<14} {'bits/w':>7} {'expert MB':>9} {'KL mean':>10} {'same top-1':>10} {'s':>6}"
                  f"   ModelOpt 0.47: {'KL mean':>10} {'same top-1':>10}  trtmoe/ModelOpt KL"
                  + (f"   trtmoe export: {'KL mean':>10} {'same top-1':>10}  export/ModelOpt KL" if exported else ""))
            print(f"{'float':<14} {8 * float_bytes / (float_bytes / 2):7.3f} {float_bytes / 1e6:9.3f} "
                  f"{0.0:10.5f} {100.0:9.2f}% {0:6.1f}")
            for n in names:
                fmt = FORMATS[n]
                t0 = time.perf_counter()
                kl, same = run_banks({l: quantized_bank(bases[l], fmt, amax[l], eng.dtype) for l in layers})
                secs = time.perf_counter() - t0
                mo, mkl = "", None
                if n in MODELOPT_CFG and mo_ok:
                    got = modelopt_banks(args.modelopt_python, model, cal, n, eng.cfg.family, layers,
                                         c.num_experts, work)
                    if isinstance(got, str):
                        mo = f"   ModelOpt failed: {got}"
                    else:
                        mkl, msame = run_banks(got)
                        mo = f"   {'':14} {mkl:10.5f} {100 * msame:9.2f}%  {kl / mkl if mkl else float('nan'):8.3f}x"
                if n in exported:  # trtmoe's unified-HF export: R's codes, or round to nearest (int8)
                    ck_r = work / f"tr_{fx}_{n}"
                    U.write_unified_checkpoint(model, ck_r, U.UnifiedPlan({l: n for l in layers}), input_amax=amax_u,
                                               fp_rounding=rnd, force=True)
                    got = export_banks(ck_r, n, eng.cfg.family, layers, c.num_experts)
                    if isinstance(got, str):
                        mo += f"   trtmoe export unreadable: {got}"
                    else:
                        rkl, rsame = run_banks(got)
                        ratio = f"{rkl / mkl:8.3f}x" if mkl else "       -"
                        mo += f"   {'':14} {rkl:10.5f} {100 * rsame:9.2f}%  {ratio}  ({R if n in aware else 'rtn'})"
                    shutil.rmtree(ck_r, ignore_errors=True)
                nb = expert_bytes(fmt, eng)
                bpw = 8 * nb / (float_bytes / 2)
                print(f"{n:<14} {bpw:7.3f} {nb / 1e6:9.3f} {kl:10.5f} {100 * same:9.2f}% {secs:6.1f}{mo}", flush=True)
                if getattr(fmt, "activation", None):
                    akl, asame = run_banks({l: _ActsOnlyBank(bases[l], fmt, amax[l], eng.dtype) for l in layers})
                    floor = f"   acts only / ModelOpt KL {akl / mkl:.3f}x" if mkl else ""
                    print(f"{n + ' acts only':<14} {'':7} {'':9} {akl:10.5f} {100 * asame:9.2f}% {'':6}{floor}",
                          flush=True)
            if not args.ladder:
                continue
            # ---- graded plans over the ladder ----------------------------------------------------
            t0 = time.perf_counter()
            ladder = args.ladder.split(",")
            calib = calibrate(model, splits[0], work / f"calib_{fx}", samples=args.calib_samples,
                              seq_len=args.seq_len, formats=tuple(ladder), force=True, rounding="rtn")
            print(f"calibration over {ladder}: {time.perf_counter() - t0:.1f} s")
            amax = {l: {m: max(v) for m, v in d.items()} for l, d in calib["input_amax"].items()}

            def held_out_kl(ck):
                q = EmbeddedEngine.from_checkpoint(ck, device="cpu", pack_experts=False)
                kl, same, count = 0.0, 0, 0
                with torch.inference_mode():
                    for lp, b in zip(ref, held.split(8)):
                        lg = q.logits(b)
                        kl += float(kl_per_token(lp, lg).sum())
                        same += int((lg.argmax(-1) == lp.argmax(-1)).sum())
                        count += lp.shape[0] * lp.shape[1]
                return kl / count, same / count

            print(f"{'plan':<22} {'budget':>6} {'avg bits':>8} {'KL mean':>10} {'same top-1':>10}  formats used")
            for gran in ("expert", "layer"):
                last = None
                for b in [float(x) for x in args.budgets.split(",")]:
                    plan = make_plan(calib, "graded", budget_bpw=b, granularity=gran, formats=["float", *ladder],
                                     dtype=eng.dtype, I_loc=c.expert_intermediate_size)
                    plan = replace(plan, meta={**plan.meta, "input_amax": amax})
                    ck = work / f"q_{fx}_{gran}_{b}"
                    convert(model, ck, quant=plan)
                    kl, same = held_out_kl(ck)
                    used = sorted({f for fs in plan.formats.values() for f in fs})
                    flag = "" if last is None or kl <= last * 1.02 else "  (KL rose)"
                    last = kl
                    print(f"{'graded per ' + gran:<22} {b:6.1f} {plan.meta['avg_bpw']:8.3f} {kl:10.5f} "
                          f"{100 * same:9.2f}%  {','.join(used)}{flag}")
                    shutil.rmtree(ck, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
