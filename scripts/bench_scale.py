#!/usr/bin/env python3
"""Layer-streamed calibration at real widths: CPU seconds per phase and peak RSS against depth.

Builds random bf16 MoE checkpoints (hub tensor names, one safetensors shard per layer, written one
layer at a time) at the widths of Qwen3-30B-A3B (hidden 2048, 128 experts top-8, expert FFN 768,
vocab 151,936; 48 layers) and Mixtral-8x7B (hidden 4096, expert FFN 14,336, 8 experts top-2, vocab
32,000; 32 layers) with 1, 2 and 4 decoder layers, and runs in a fresh child process each:

* ``calibrate --runner stream`` over the same calibration tokens (its own per-phase measurement:
  boundaries, forward, backward, scoring, io), and
* the baseline, in the same run: a transformers forward (``AutoModelForCausalLM``, bf16, the whole
  model loaded) over the same tokens,

reporting CPU seconds, peak RSS (the child's ru_maxrss), the ratio of calibration to the forward, and
the extrapolation to the full depth (a straight line through the measured depths: per-layer slope and
fixed part). Each child runs on ``--threads`` threads (1 by default: CPU seconds on one thread).

``--one-expert`` instead times the int4 rounding searches alone on one expert of the width (random
bf16 weights, statistics from ``collect_layer`` over ``--tokens`` random hidden states routed top-k of
the width's experts, so each expert gets as many routed rows as in the real model): CPU seconds of
``awq.quantize`` for fc and proj per rounding, round to nearest being the baseline.

``--projection 4096,65536`` adds, after the depth runs, the whole model (the width's depth and expert
count) at those calibration token counts: the searches timed per expert as ``--one-expert`` does at
each count's routed rows (statistics keep at most ``awq.MAX_INPUT_TOKENS`` tokens, as calibration does)
times layers × experts, the other phases and the transformers forward scaled from the depth runs
(two depths or more: a line in layers, then linear in tokens; scoring and statistics by the larger of
the token and expert ratios when ``--experts`` ran fewer: an upper bound).
What is measured and what is projected is printed with the table.

Usage::

    python scripts/bench_scale.py --widths qwen3 --layers 1,2,4 --tokens 512 --rounding rtn
    python scripts/bench_scale.py --widths qwen3 --one-expert --experts-timed 3 --tokens 512
    python scripts/bench_scale.py --widths mixtral --layers 1,2 --tokens 64   # ~3 GB of bf16 per layer
    python scripts/bench_scale.py --widths qwen3 --layers 1,2 --experts 16 --tokens 1024 --rounding awq_gptq \
        --projection 4096,65536
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WIDTHS = {
    "qwen3": {"arch": "qwen3_moe", "full_layers": 48, "hidden": 2048, "experts": 128, "top_k": 8, "ffn": 768,
              "vocab": 151936, "heads": 32, "kv_heads": 4, "head_dim": 128},
    "mixtral": {"arch": "mixtral", "full_layers": 32, "hidden": 4096, "experts": 8, "top_k": 2, "ffn": 14336,
                "vocab": 32000, "heads": 32, "kv_heads": 8, "head_dim": 128},
}
FULL_EXPERTS = {k: v["experts"] for k, v in WIDTHS.items()}
TOKENIZER = REPO / "tests" / "fixtures" / "trained_mixtral"


def _config(w: dict, layers: int) -> dict:
    common = {"hidden_size": w["hidden"], "num_attention_heads": w["heads"], "num_key_value_heads": w["kv_heads"],
              "head_dim": w["head_dim"], "num_hidden_layers": layers, "vocab_size": w["vocab"],
              "num_experts_per_tok": w["top_k"], "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    if w["arch"] == "qwen3_moe":
        return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "num_experts": w["experts"], "moe_intermediate_size": w["ffn"], "intermediate_size": 6144,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": w["experts"], "intermediate_size": w["ffn"]}


def _layer_tensors(w: dict, l: int, gen) -> dict:
    import torch

    H, hd, E, I = w["hidden"], w["head_dim"], w["experts"], w["ffn"]
    bf = torch.bfloat16
    rnd = lambda *shape, std=None: (torch.randn(*shape, generator=gen) * (std or shape[-1] ** -0.5)).to(bf)  # noqa: E731
    p = f"model.layers.{l}."
    t = {p + "input_layernorm.weight": torch.ones(H, dtype=bf), p + "post_attention_layernorm.weight": torch.ones(H, dtype=bf),
         p + "self_attn.q_proj.weight": rnd(w["heads"] * hd, H), p + "self_attn.k_proj.weight": rnd(w["kv_heads"] * hd, H),
         p + "self_attn.v_proj.weight": rnd(w["kv_heads"] * hd, H), p + "self_attn.o_proj.weight": rnd(H, w["heads"] * hd)}
    if w["arch"] == "qwen3_moe":
        t[p + "self_attn.q_norm.weight"] = torch.ones(hd, dtype=bf)
        t[p + "self_attn.k_norm.weight"] = torch.ones(hd, dtype=bf)
        t[p + "mlp.gate.weight"] = rnd(E, H, std=0.2)
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"], t[q + "up_proj.weight"], t[q + "down_proj.weight"] = rnd(I, H), rnd(I, H), rnd(H, I)
    else:
        t[p + "block_sparse_moe.gate.weight"] = rnd(E, H, std=0.2)
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            t[q + "w1.weight"], t[q + "w3.weight"], t[q + "w2.weight"] = rnd(I, H), rnd(I, H), rnd(H, I)
    return t


def make_model(width: str, layers: int, out: Path, seed: int = 0) -> Path:
    """A random bf16 checkpoint of ``width`` with ``layers`` decoder layers, one shard per layer."""
    import torch
    from safetensors.torch import save_file

    w = WIDTHS[width]
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    bf = torch.bfloat16
    top = {"model.embed_tokens.weight": (torch.randn(w["vocab"], w["hidden"], generator=gen) * 0.5).to(bf),
           "model.norm.weight": torch.ones(w["hidden"], dtype=bf),
           "lm_head.weight": (torch.randn(w["vocab"], w["hidden"], generator=gen) * (2 / w["hidden"] ** 0.5)).to(bf)}
    save_file(top, out / "model-top.safetensors", metadata={"format": "pt"})
    weight_map.update({k: "model-top.safetensors" for k in top})
    del top
    for l in range(layers):
        t = _layer_tensors(w, l, gen)
        name = f"model-layer-{l:03d}.safetensors"
        save_file(t, out / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in t})
        del t
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(_config(w, layers), indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(TOKENIZER / f, out / f)
    return out


_CHILD = r"""
import json, resource, sys, time, torch
torch.set_num_threads(int(sys.argv[4]))
kind, model, text = sys.argv[1], sys.argv[2], sys.argv[3]
opts = json.loads(sys.argv[5])
c0, w0 = time.process_time(), time.perf_counter()
out = {}
if kind == "calibrate":
    from trtmoe.quant.calibrate import calibrate
    notes = []
    res = calibrate(model, text, None, runner="stream", notes=notes, samples=opts["samples"], seq_len=opts["seq_len"],
                    formats=tuple(opts["formats"]), rounding=opts["rounding"], batch_size=opts["batch_size"],
                    device=opts["device"], min_tokens=1)
    cost = res["cost"]
    out = {"phases_cpu": {k: p["cpu_seconds"] for k, p in cost["phases"].items()},
           "phases_wall": {k: p["wall_seconds"] for k, p in cost["phases"].items()},
           "ratio_own_forward": cost["ratio_to_forward"], "tokens": res["data"]["tokens"],
           "memory_note": [n for n in notes if "layer-streamed" in n]}
else:
    import transformers
    from trtmoe.data import load_texts
    from trtmoe.quant.calibrate import token_batches
    from trtmoe.runtime.load import load_tokenizer
    tok = load_tokenizer(model)
    tok.add_bos = False
    ids = token_batches(load_texts(text), tok, opts["samples"], opts["seq_len"])
    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    c1 = time.process_time()
    with torch.no_grad():
        for b in ids.split(opts["batch_size"]):
            m(b, use_cache=False, logits_to_keep=0)
    out = {"forward_cpu": time.process_time() - c1, "load_cpu": c1 - c0, "tokens": int(ids.numel())}
out["cpu_total"] = time.process_time() - c0
out["wall_total"] = time.perf_counter() - w0
out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print("RESULT " + json.dumps(out))
"""


def run_child(kind: str, model: Path, text: Path, threads: int, opts: dict, timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, "-c", _CHILD, kind, str(model), str(text), str(threads), json.dumps(opts)],
                       capture_output=True, text=True, env=env, timeout=timeout)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit {r.returncode}"], "rc": r.returncode}


def _line(xs: list[int], ys: list[float], at: int) -> float | None:
    """The straight line through (xs, ys) (least squares) evaluated at ``at``."""
    if len(xs) < 2:
        return None
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my + b * (at - mx)


def one_expert(width: str, tokens: int, fmt_name: str, roundings: list[str], experts: int, threads: int,
               seq_len: int = 128) -> dict:
    """CPU seconds of the int4 rounding searches per expert (fc + proj) at ``width``, per rounding,
    with the routed rows the timed experts got: ``{"rows": [min, max], "cpu": {rounding: s}}``. The
    statistics keep at most ``awq.MAX_INPUT_TOKENS`` of the tokens (as calibration does), so the rows
    are those of that many tokens.

    Each rounding runs through calibration's own rounding (``quant.calibrate._AwqRounding``). One that
    fits codes to the rows (error feedback) is then also cross-fitted, as calibration scores it by
    default: the two folds (alternate ``seq_len``-token sequences) refit their codes on the whole
    calibration's searched scales, and ``{rounding}`` is the whole cost (the search and both folds),
    ``{rounding} in-sample`` the search alone. Collecting the statistics (the whole calibration's and
    the folds') is not timed here: calibration counts it in its scoring and statistics phases."""
    import time

    import torch

    from trtmoe.quant import awq
    from trtmoe.quant.calibrate import _AwqRounding
    from trtmoe.quant.formats import FORMATS
    from trtmoe.runtime.experts import FloatExperts

    torch.set_num_threads(threads)
    w = WIDTHS[width]
    H, I, E, k = w["hidden"], w["ffn"], w["experts"], w["top_k"]
    g = torch.Generator().manual_seed(0)
    fc = (torch.randn(experts, 2 * I, H, generator=g) * H ** -0.5).to(torch.bfloat16)
    proj = (torch.randn(experts, H, I, generator=g) * I ** -0.5).to(torch.bfloat16)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16).float()
    routed = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    routed = torch.where(routed < experts, routed, -1)  # routed to an expert that is not timed: not held
    bank = FloatExperts(fc.float(), proj.float(), "float32")
    fmt = FORMATS[fmt_name]
    rows = [int((routed == e).any(-1).sum()) for e in range(experts)]
    print(f"{width}: {experts} expert(s) of {E}, fc {2 * I}x{H}, proj {H}x{I}, {fmt_name}, {tokens} tokens top-{k} "
          f"(routed rows {min(rows)}-{max(rows)}), {threads} thread(s)")
    print(f"{'rounding':>20} | {'rows/expert':>11} | {'CPU-s/expert':>12} | {'x rtn':>6}")
    base = None
    res = {"rows": [min(rows), max(rows)], "cpu": {}}

    def quantize_all(rd) -> float:
        c0 = time.process_time()
        for e in range(experts):
            for m in ("fc", "proj"):
                rd.quantize(fmt, bank.fc[e] if m == "fc" else bank.proj[e], 0, e, m, torch.bfloat16)
        return (time.process_time() - c0) / experts

    seq_of = torch.arange(tokens) // seq_len
    in1 = (seq_of % 2 == 1) if tokens > seq_len else torch.arange(tokens) >= tokens // 2
    work = Path(tempfile.mkdtemp(prefix="trtmoe-bench-expert-"))
    try:
        for r in roundings:
            # Calibration's own rounding object, its statistics kept where calibration keeps them (the
            # MoE inputs, and the searched recipes that the folds reuse).
            rd = _AwqRounding(awq.ActivationStats(inputs_dir=work / r / awq.INPUTS_DIR), r)
            rd.add_layer(0, bank, x, routed)
            cpu = quantize_all(rd)
            cells = [(r, cpu)]
            if r in awq.ERROR_FEEDBACK:
                folds = [rd.fold(0, bank, x[mask], routed[mask]) for mask in (~in1, in1)]
                cells = [(f"{r} in-sample", cpu), (r, cpu + sum(quantize_all(f) for f in folds))]
            for name, c in cells:
                base = c if name == "rtn" else base
                res["cpu"][name] = c
                print(f"{name:>20} | {f'{min(rows)}-{max(rows)}':>11} | {c:>12.2f} | "
                      f"{'-' if not base else f'{c / base:.0f}':>6}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


def projection(width: str, rows: list[dict], searches: dict[int, dict], rounding: str, run_tokens: int,
               targets: tuple[int, ...]) -> None:
    """Calibration CPU-s of the whole model (the width's depth and expert count) at ``targets``
    calibration tokens beside a transformers forward over the same tokens, projected from what this
    run measured: the calibration's phases other than the searches and the transformers forward at the
    full depth (a line through the measured depths, two or more), scaled linearly in tokens (io not: it
    is the files, per layer), scoring and
    statistics by the larger of the token ratio and the expert ratio (the run may have had fewer
    experts: an upper bound of a part per expert plus a part per token); and the searches as the
    width's layers × experts × the CPU-s per expert timed by ``one_expert`` at that many tokens' routed
    rows."""
    w = WIDTHS[width]
    ok = [r for r in rows if r["width"] == width and "error" not in r["calibrate"]]
    if not ok:
        return
    xs = [r["layers"] for r in ok]
    # Scoring and statistics have a part per expert (each expert's quantized weights) and a part per
    # token (the routed rows): p·(E/E_run) + q·(T/T_run) with p + q measured is at most their sum times
    # the larger of the two ratios, which is what is counted (an upper bound).
    per_expert = [r["calibrate"]["phases_cpu"].get("scoring", 0.0) + r["calibrate"]["phases_cpu"].get("statistics", 0.0)
                  for r in ok]
    io = [r["calibrate"]["phases_cpu"].get("io", 0.0) for r in ok]  # the files: per layer, whatever the tokens
    other = [r["calibrate"]["cpu_total"] - r["calibrate"]["phases_cpu"].get("searches", 0.0) - p - i
             for r, p, i in zip(ok, per_expert, io)]
    tf = [r["forward"].get("forward_cpu") for r in ok]
    full, E = w["full_layers"], w["experts"]
    if len(set(xs)) < 2:  # the head and embedding (most of a 1-layer forward) must not count per layer
        print(f"\n{width}: the projection needs two depths or more (--layers 1,2)")
        return

    def at_depth(ys: list[float]) -> float:  # the whole depth at this run's tokens
        return _line(xs, ys, full)

    o_full, s_full, io_full = at_depth(other), at_depth(per_expert), at_depth(io)
    t_full = at_depth(tf) if all(v is not None for v in tf) else None
    e_ratio = E / ok[0]["experts"]
    print(f"\n{width}: projected to {full} layers x {E} experts, rounding {rounding} (measured: the phases "
          f"other than the searches and the transformers forward at {run_tokens} tokens, "
          f"{', '.join(map(str, xs))} layer(s); the searches per expert at each token count's routed rows; "
          f"projected: everything else, linear in layers and tokens (io in layers only); scoring and statistics "
          f"by the larger of the token and expert ratios, an upper bound)")
    hdr = ("tokens", "rows/expert", "search s/expert", "searches", "other phases", "cal CPU-s", "tf fwd CPU-s",
           "x fwd", "searches x fwd")
    print(" | ".join(f"{h:>15}" for h in hdr))
    for T in targets:
        sr = searches.get(T)
        if sr is None or rounding not in sr["cpu"]:
            continue
        k = T / run_tokens
        srch = full * E * sr["cpu"][rounding]
        oth = o_full * k + s_full * max(k, e_ratio) + io_full
        fwd = None if t_full is None else t_full * k
        cells = (T, f"{sr['rows'][0]}-{sr['rows'][1]}", f"{sr['cpu'][rounding]:.2f}", f"{srch:.0f}", f"{oth:.0f}",
                 f"{srch + oth:.0f}", "-" if fwd is None else f"{fwd:.0f}",
                 "-" if fwd is None else f"{(srch + oth) / fwd:.1f}", "-" if fwd is None else f"{srch / fwd:.1f}")
        print(" | ".join(f"{c!s:>15}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="qwen3", help="comma separated: qwen3, mixtral")
    ap.add_argument("--layers", default="1,2,4")
    ap.add_argument("--tokens", type=int, default=512, help="calibration tokens (samples × seq-len)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--rounding", default="rtn")
    ap.add_argument("--formats", default="int8,int4_g128")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts per layer instead of the width's own (top-k kept): a cheaper run "
                         "whose search cost scales with the experts and whose forward does not")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--baseline-max-gib", type=float, default=6.0,
                    help="skip the whole-model transformers forward above this many GiB of bf16 weights")
    ap.add_argument("--one-expert", action="store_true",
                    help="time the int4 rounding searches on single experts of the width instead (see above)")
    ap.add_argument("--experts-timed", type=int, default=2, help="--one-expert: experts timed (averaged)")
    ap.add_argument("--projection", default=None, metavar="TOKENS",
                    help="after the depth runs, time the searches per expert (as --one-expert, at the width's own "
                         "expert count) at each of these comma-separated calibration token counts and project the "
                         "whole model's calibration and transformers forward CPU-s at them (e.g. 4096,65536)")
    ap.add_argument("--work", type=Path, default=None, help="where the random models go (default: a temp dir)")
    ap.add_argument("--timeout", type=int, default=3600)
    a = ap.parse_args(argv)
    if a.one_expert:
        fmt = next((f for f in a.formats.split(",") if f.startswith("int4")), "int4_g128")
        for width in a.widths.split(","):
            one_expert(width, a.tokens, fmt, ["rtn", "awq", "awq_gptq"], a.experts_timed, a.threads, a.seq_len)
        return 0
    from trtmoe.data import write_split_text

    work = a.work or Path(tempfile.mkdtemp(prefix="trtmoe-bench-scale-"))
    text = work / "calib.txt"
    write_split_text("calib", text, max_bytes=400_000)
    opts = {"samples": max(1, a.tokens // a.seq_len), "seq_len": a.seq_len, "formats": a.formats.split(","),
            "rounding": a.rounding, "batch_size": a.batch_size, "device": a.device}
    layers = [int(x) for x in a.layers.split(",")]
    rows = []
    try:
        for width in a.widths.split(","):
            if a.experts:
                WIDTHS[width] = {**WIDTHS[width], "experts": a.experts}
            for L in layers:
                mdir = make_model(width, L, work / f"{width}-{L}")
                gib = sum(f.stat().st_size for f in mdir.glob("*.safetensors")) / 2**30
                cal = run_child("calibrate", mdir, text, a.threads, opts, a.timeout)
                base = (run_child("forward", mdir, text, a.threads, opts, a.timeout) if gib <= a.baseline_max_gib
                        else {"error": [f"skipped: {gib:.1f} GiB > --baseline-max-gib"]})
                rows.append({"width": width, "layers": L, "weights_gib": gib, "calibrate": cal, "forward": base,
                             "experts": WIDTHS[width]["experts"]})
                print(json.dumps(rows[-1]), flush=True)
                shutil.rmtree(mdir)
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"{a.tokens} calibration tokens, rounding {a.rounding}, formats {a.formats}, {a.threads} thread(s), "
          f"device {a.device}" + (f", {a.experts} experts per layer" if a.experts else ""))
    hdr = ("width", "L", "GiB", "rows/expert", "fwd+bwd", "searches", "scoring", "io", "cal CPU-s", "cal RSS",
           "tf fwd CPU-s", "tf RSS", "×fwd")
    print(" | ".join(f"{h:>11}" for h in hdr))
    for r in rows:
        c, f = r["calibrate"], r["forward"]
        if "error" in c:
            print(f"{r['width']:>11} | {r['layers']:>11} | calibrate failed: {c['error']}")
            continue
        ph = c["phases_cpu"]
        fb = ph.get("forward", 0) + ph.get("backward", 0) + ph.get("boundaries", 0)
        tf = f.get("forward_cpu")
        cells = (r["width"], r["layers"], f"{r['weights_gib']:.2f}",
                 f"{c['tokens'] * WIDTHS[r['width']]['top_k'] / r['experts']:.0f}",
                 f"{fb:.1f}", f"{ph.get('searches', 0):.1f}", f"{ph.get('scoring', 0) + ph.get('statistics', 0):.1f}",
                 f"{ph.get('io', 0):.1f}", f"{c['cpu_total']:.1f}", f"{c['peak_rss_gib']:.2f}",
                 "-" if tf is None else f"{tf:.1f}", "-" if tf is None else f"{f['peak_rss_gib']:.2f}",
                 "-" if tf is None else f"{c['cpu_total'] / tf:.1f}")
        print(" | ".join(f"{x:>11}" for x in cells))
    for width in a.widths.split(","):
        ok = [r for r in rows if r["width"] == width and "error" not in r["calibrate"]]
        if len(ok) < 2:
            continue
        xs = [r["layers"] for r in ok]
        full = WIDTHS[width]["full_layers"]
        cpu = _line(xs, [r["calibrate"]["cpu_total"] for r in ok], full)
        rss = [r["calibrate"]["peak_rss_gib"] for r in ok]
        # Peak RSS: the increment between the two deepest runs, carried on to full depth (a line through
        # every depth would carry the first layer's one-off costs along).
        per_layer = (rss[-1] - rss[-2]) / (xs[-1] - xs[-2])
        print(f"{width}: peak RSS {rss[-1]:.2f} GiB at {xs[-1]} layers = {rss[-1] / rss[0]:.2f}× at {xs[0]}; "
              f"extrapolated to {full} layers: {cpu / 3600:.2f} CPU-hours (straight line through the measured "
              f"depths), peak RSS {rss[-1] + per_layer * (full - xs[-1]):.2f} GiB ({per_layer:.3f} GiB per layer "
              f"between the two deepest runs)")
    if a.projection:
        from trtmoe.quant import awq

        targets = tuple(int(t) for t in a.projection.split(","))
        fmt = next((f for f in a.formats.split(",") if f.startswith("int4")), "int4_g128")
        for width in a.widths.split(","):
            WIDTHS[width] = {**WIDTHS[width], "experts": FULL_EXPERTS[width]}
            print()
            timed = {T: one_expert(width, min(T, awq.MAX_INPUT_TOKENS), fmt, ["rtn", a.rounding], a.experts_timed,
                                   a.threads, a.seq_len) for T in targets}
            projection(width, rows, timed, a.rounding, a.tokens, targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
