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

    python scripts/bench_formats.py [--calib-samples 16] [--eval-samples 16] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trtmoe.checkpoint.writer import convert  # noqa: E402
from trtmoe.data import write_split_text, load_texts  # noqa: E402
from trtmoe.quant.calibrate import kl_per_token, token_batches  # noqa: E402
from trtmoe.quant.sensitivity import layer_input_amax  # noqa: E402
from trtmoe.quant.formats import FORMATS, QUANTIZED  # noqa: E402
from trtmoe.runtime.engine import EmbeddedEngine  # noqa: E402
from trtmoe.runtime.experts import PackedExperts, PackedShard  # noqa: E402
from trtmoe.runtime.load import load_tokenizer  # noqa: E402

FIXTURES = ("trained_mixtral", "trained_qwen3_moe")


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--formats", default="int8,int4_g128," + ",".join(n for n in QUANTIZED if not FORMATS[n].engine_path))
    args = ap.parse_args()
    names = args.formats.split(",")
    work = Path(tempfile.mkdtemp(prefix="bench_formats_"))
    try:
        calib_txt, held_txt = work / "calib.txt", work / "heldout.txt"
        write_split_text("calib", calib_txt, max_bytes=64 * args.calib_samples * args.seq_len)
        write_split_text("heldout", held_txt, max_bytes=64 * args.eval_samples * args.seq_len)
        for fx in FIXTURES:
            model = ROOT / "tests" / "fixtures" / fx
            ck = work / f"ck_{fx}"
            convert(model, ck)
            eng = EmbeddedEngine.from_checkpoint(ck, device="cpu", pack_experts=False)
            tok = load_tokenizer(model)
            cal = token_batches(load_texts(calib_txt), tok, args.calib_samples, args.seq_len)
            held = token_batches(load_texts(held_txt), tok, args.eval_samples, args.seq_len)
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
            print(f"{'format':<14} {'bits/w':>7} {'expert MB':>9} {'KL mean':>10} {'same top-1':>10} {'s':>6}")
            print(f"{'float':<14} {8 * float_bytes / (float_bytes / 2):7.3f} {float_bytes / 1e6:9.3f} "
                  f"{0.0:10.5f} {100.0:9.2f}% {0:6.1f}")
            for n in names:
                fmt = FORMATS[n]
                t0 = time.perf_counter()
                for l in layers:
                    eng.layers[l].experts = quantized_bank(bases[l], fmt, amax[l], eng.dtype)
                kl, same, count = 0.0, 0, 0
                with torch.inference_mode():
                    for lp, b in zip(ref, held.split(8)):
                        lg = eng.logits(b)
                        kl += float(kl_per_token(lp, lg).sum())
                        same += int((lg.argmax(-1) == lp.argmax(-1)).sum())
                        count += lp.shape[0] * lp.shape[1]
                for l in layers:
                    eng.layers[l].experts = bases[l]
                nb = expert_bytes(fmt, eng)
                bpw = 8 * nb / (float_bytes / 2)
                print(f"{n:<14} {bpw:7.3f} {nb / 1e6:9.3f} {kl / count:10.5f} {100 * same / count:9.2f}% "
                      f"{time.perf_counter() - t0:6.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
