#!/usr/bin/env python3
"""Benchmark ``trtmoe convert`` against a plain fsynced copy of the same bytes, at several model sizes
and layouts, interleaved.

For each size a synthetic Mixtral-shaped checkpoint is written (seeded random bf16 weights,
Mixtral-8x7B tensor shapes: hidden 4096, expert FFN 14336, vocab 32000, 32 query / 8 KV heads;
only the number of layers and experts shrink), in several shards with an index. Then, for
``--rounds`` rounds (the order of the runs rotates from round to round, so a slow spell of the
machine does not land on one of them every time):

* ``copy``: ``shutil.copyfile`` of every source file into a temporary directory, each fsynced
  (the converter fsyncs its rank files too, so both pay for durable writes), in a child process
  like convert;
* ``convert LAYOUT``: ``trtmoe.checkpoint.writer.convert`` in a child process, for each layout
  (``tp2`` = tp 2 with the experts split by rows/columns, ``ep2`` = tp 2 with moe_ep 2, ``pp2``);
  its wall time is measured inside the child (interpreter and torch start-up excluded), with the
  child's CPU seconds, and its peak resident memory is the child's ``ru_maxrss`` (start-up included);
* with ``--against TREE`` also the same converts run from another checkout of trtmoe (an A/B in
  the same run, e.g. a ``git archive`` of an older commit).

The table gives medians over the rounds, the ratio of the median convert to the median copy, the
range of the per-round ratios, the largest peak RSS and the load average before and after.

Targets: convert time <= 1.2x copy time; peak RSS <= 1 GiB + the largest single source tensor,
at every size (so the peak does not grow with the model).

    python scripts/bench_convert.py --sizes 1.2,2 --layouts tp2,ep2 --rounds 3 --workdir /tmp/trtmoe-bench
    python scripts/bench_convert.py --sizes 1.2 --against /tmp/old-trtmoe     # A/B against another tree
    python scripts/bench_convert.py --sizes 0.5 --profile       # cProfile the convert child

``write_synthetic_mixtral`` is also used by the tests (interrupted-convert checks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from trtmoe.hf.safetensors_io import StreamingWriter  # noqa: E402

GiB = 1 << 30
GB = 10**9
# Rows of random values generated at a time (bounded memory while writing big tensors).
_CHUNK_ELEMS = 16 << 20

MIXTRAL_SHAPE = dict(hidden=4096, intermediate=14336, vocab=32000, heads=32, kv_heads=8)


# ------------------------------------------------------------------------------------------------
# Synthetic checkpoint
# ------------------------------------------------------------------------------------------------

def mixtral_config(*, hidden: int, intermediate: int, layers: int, experts: int, vocab: int, heads: int,
                   kv_heads: int, top_k: int = 2, dtype: str = "bfloat16") -> dict:
    """An HF ``config.json`` dict for a Mixtral-architecture model of the given sizes."""
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "num_local_experts": experts, "num_experts_per_tok": top_k, "vocab_size": vocab,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2,
    }


def mixtral_tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes of a Mixtral checkpoint, in the order HF writes them."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (V, H))]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (H,)),
                (p + "self_attn.q_proj.weight", (q, H)), (p + "self_attn.k_proj.weight", (kv, H)),
                (p + "self_attn.v_proj.weight", (kv, H)), (p + "self_attn.o_proj.weight", (H, q)),
                (p + "post_attention_layernorm.weight", (H,)),
                (p + "block_sparse_moe.gate.weight", (cfg["num_local_experts"], H))]
        for e in range(cfg["num_local_experts"]):
            x = f"{p}block_sparse_moe.experts.{e}."
            out += [(x + "w1.weight", (I, H)), (x + "w2.weight", (H, I)), (x + "w3.weight", (I, H))]
    out += [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    return out


def _fill(writer: StreamingWriter, name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> None:
    """Stream seeded N(0, 0.02) values (norms: N(1, 0.02)) into the writer, chunk by chunk."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    n = math.prod(shape)
    mean = 1.0 if name.endswith("norm.weight") else 0.0
    done = 0
    while done < n:
        k = min(_CHUNK_ELEMS, n - done)
        writer.write(torch.empty(k, dtype=dtype).normal_(mean, 0.02, generator=g))
        done += k


def write_synthetic_mixtral(out_dir: str | Path, *, hidden: int, intermediate: int, layers: int, experts: int,
                            vocab: int, heads: int, kv_heads: int, shard_bytes: int = GiB,
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Write a seeded random Mixtral-architecture HF checkpoint: ``config.json``, shards of at
    most ``shard_bytes`` bytes (a bigger tensor gets its own) and ``model.safetensors.index.json``.
    Memory stays at one 16M-element chunk whatever the model size. Returns ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dname = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    cfg = mixtral_config(hidden=hidden, intermediate=intermediate, layers=layers, experts=experts, vocab=vocab,
                         heads=heads, kv_heads=kv_heads, dtype=dname)
    esize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    total = 0
    for name, shape in mixtral_tensor_shapes(cfg):
        nb = math.prod(shape) * esize
        if shards[-1] and used + nb > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += nb
        total += nb
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        w = StreamingWriter(out / fname, [(n, dtype, s) for n, s in shard], {"format": "pt"})
        try:
            for name, shape in shard:
                _fill(w, name, shape, dtype, seed)
                weight_map[name] = fname
            w.close()
        except BaseException:
            w.abort()
            raise
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def shape_for_size(target_bytes: float, *, max_experts: int = 8, ep: int = 2) -> dict:
    """Layers and experts (a multiple of ``ep``, at most ``max_experts`` per layer) that bring a
    Mixtral-8x7B-shaped model to at least ``target_bytes`` in bf16, with as few layers as possible."""
    H, I, V, nh, nkv = (MIXTRAL_SHAPE[k] for k in ("hidden", "intermediate", "vocab", "heads", "kv_heads"))
    hd = H // nh
    fixed = 2 * V * H * 2 + H * 2  # embedding, lm_head, final norm
    per_layer = (2 * nh * hd * H + 2 * nkv * hd * H + 2 * H) * 2  # attention + norms
    per_expert = 3 * H * I * 2
    layers = 1
    while fixed + layers * (per_layer + max_experts * per_expert) < target_bytes:
        layers += 1
    experts = max(ep, math.ceil(max(0, target_bytes - fixed - layers * per_layer) / (layers * per_expert)))
    experts = -(-experts // ep) * ep
    return dict(MIXTRAL_SHAPE, layers=layers, experts=experts)


# ------------------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------------------

LAYOUTS = {"tp2": dict(tp=2), "ep2": dict(tp=2, moe_ep=2), "pp2": dict(pp=2), "tp1": dict()}

_COPY_CHILD = r"""
import json, os, resource, shutil, sys, time
src, dst = sys.argv[1], sys.argv[2]
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
os.mkdir(dst)
for name in sorted(os.listdir(src)):
    shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    fd = os.open(os.path.join(dst, name), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "cpu": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime}))
"""

_CONVERT_CHILD = r"""
import json, resource, sys, time, torch
torch.set_num_threads(1)
from trtmoe.checkpoint.writer import convert
src, out, prof, kw = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
if prof:
    import cProfile
    cProfile.run("convert(src, out, dtype='auto', **kw)", prof)
else:
    convert(src, out, dtype="auto", **kw)
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "cpu": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime}))
"""


def _run_child(code: str, args: list[str], cwd: Path) -> tuple[dict, int]:
    """Run ``code`` in a fresh interpreter whose working directory (first on its path) is ``cwd``;
    its last stdout line is JSON. Returns that and the child's peak RSS in bytes (reaped with wait4
    to read the child's own rusage)."""
    os.sync()
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd)
    stdout = proc.stdout.read()
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{stderr[-4000:]}")
    return json.loads(stdout.strip().splitlines()[-1]), usage.ru_maxrss * 1024  # KiB on Linux


def time_copy(src: Path, dst: Path) -> tuple[float, float]:
    """(seconds, CPU seconds) to copy every file of ``src`` into ``dst`` with ``shutil.copyfile``, fsynced."""
    res, _ = _run_child(_COPY_CHILD, [str(src), str(dst)], REPO_ROOT)
    return res["seconds"], res["cpu"]


def time_convert(src: Path, out: Path, layout: str = "ep2", profile: Path | None = None,
                 tree: Path = REPO_ROOT) -> tuple[float, float, int]:
    """Run convert from ``tree`` in a child; returns (convert seconds, CPU seconds, peak RSS bytes)."""
    res, rss = _run_child(_CONVERT_CHILD, [str(src), str(out), str(profile or ""), json.dumps(LAYOUTS[layout])], tree)
    return res["seconds"], res["cpu"], rss


def largest_tensor_bytes(cfg: dict, dtype_bytes: int = 2) -> tuple[str, int]:
    name, shape = max(mixtral_tensor_shapes(cfg), key=lambda x: math.prod(x[1]))
    return name, math.prod(shape) * dtype_bytes


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def bench_one(size_gb: float, work: Path, layouts: list[str], rounds: int, profile: bool = False,
              against: Path | None = None) -> list[dict]:
    """Generate one size, then run copy and every convert ``rounds`` times, interleaved (the order
    rotates each round). One row per convert variant."""
    shape = shape_for_size(size_gb * GB)
    src, cp, out = work / "src", work / "copy", work / "converted"
    t0 = time.perf_counter()
    write_synthetic_mixtral(src, **shape)
    gen_s = time.perf_counter() - t0
    cfg = json.loads((src / "config.json").read_text())
    src_bytes = dir_bytes(src)
    variants = [("copy", None, None)] + [(f"{lay}", lay, REPO_ROOT) for lay in layouts]
    if against is not None:
        variants += [(f"{lay}@against", lay, against) for lay in layouts]
    times = {v[0]: [] for v in variants}
    cpu = {v[0]: [] for v in variants}
    rss = {v[0]: 0 for v in variants}
    out_bytes = {}
    prof_path = work.parent / f"convert-{size_gb:g}GB.prof" if profile else None
    for r in range(rounds):
        k = r % len(variants)
        for name, lay, tree in variants[k:] + variants[:k]:
            if lay is None:
                s, c = time_copy(src, cp)
                shutil.rmtree(cp)  # keep peak disk use at source + one output
            else:
                s, c, m = time_convert(src, out, lay, prof_path if tree == REPO_ROOT else None, tree)
                out_bytes[name] = dir_bytes(out)
                rss[name] = max(rss[name], m)
                shutil.rmtree(out)
            times[name].append(s)
            cpu[name].append(c)
    big_name, big = largest_tensor_bytes(cfg)
    copy_med = _median(times["copy"])
    rows = []
    for name, lay, tree in variants[1:]:
        ratios = [c / p for c, p in zip(times[name], times["copy"])]
        rows.append({
            "size_gb": size_gb, "layout": name, "layers": shape["layers"], "experts": shape["experts"],
            "source_bytes": src_bytes, "shards": len(list(src.glob("*.safetensors"))),
            "output_bytes": out_bytes[name], "generate_s": gen_s,
            "copy_s": copy_med, "convert_s": _median(times[name]), "ratio": _median(times[name]) / copy_med,
            "round_ratios": ratios, "copy_rounds": times["copy"], "convert_rounds": times[name],
            "copy_cpu_s": _median(cpu["copy"]), "convert_cpu_s": _median(cpu[name]),
            "peak_rss_bytes": rss[name], "largest_tensor": big_name, "largest_tensor_bytes": big,
            "rss_limit_bytes": GiB + big, "profile": str(prof_path) if prof_path else None, "rounds": rounds,
            "tree": str(tree),
        })
    shutil.rmtree(src)
    return rows


RATIO_TARGET = 1.2


def print_table(rows: list[dict], load: tuple[tuple[float, ...], tuple[float, ...]]) -> None:
    def gb(n):
        return f"{n / GiB:.2f}"

    head = ("source GiB", "output GiB", "layout", "layers×experts", "copy s", "convert s", "ratio", "round ratios",
            "copy CPU s", "convert CPU s", "peak RSS GiB", "RSS limit GiB", "targets")
    lines = []
    for r in rows:
        ok = r["ratio"] <= RATIO_TARGET and r["peak_rss_bytes"] <= r["rss_limit_bytes"]
        lines.append((gb(r["source_bytes"]), gb(r["output_bytes"]), r["layout"], f"{r['layers']}×{r['experts']}",
                      f"{r['copy_s']:.2f}", f"{r['convert_s']:.2f}", f"{r['ratio']:.2f}",
                      f"{min(r['round_ratios']):.2f}–{max(r['round_ratios']):.2f}",
                      f"{r['copy_cpu_s']:.2f}", f"{r['convert_cpu_s']:.2f}",
                      gb(r["peak_rss_bytes"]), gb(r["rss_limit_bytes"]), "met" if ok else "MISSED"))
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for l in lines:
        print("  ".join(c.rjust(w) for c, w in zip(l, widths)))
    print(f"targets: convert ≤ {RATIO_TARGET} × copy; peak RSS ≤ 1 GiB + largest tensor. Medians of "
          f"{rows[0]['rounds']} interleaved rounds, convert timed inside its child (start-up excluded); "
          f"load average before {' '.join(f'{x:.2f}' for x in load[0])}, after {' '.join(f'{x:.2f}' for x in load[1])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python scripts/bench_convert.py --sizes 1.2,2 --layouts tp2,ep2")
    ap.add_argument("--sizes", default="1.2,2", help="model sizes in GB (10^9 bytes), comma separated [1.2,2]")
    ap.add_argument("--layouts", default="tp2,ep2", help=f"convert layouts, comma separated, of {','.join(LAYOUTS)} "
                                                         "[tp2,ep2]")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of copy and every convert [3]")
    ap.add_argument("--against", type=Path, default=None,
                    help="another trtmoe checkout: also time its convert in the same rounds (A/B)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory [a new temp dir]")
    ap.add_argument("--profile", action="store_true", help="cProfile the convert child; .prof files kept")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    unknown = [lay for lay in layouts if lay not in LAYOUTS]
    if unknown:
        print(f"error: unknown layout {unknown[0]!r} (choose from {', '.join(LAYOUTS)})", file=sys.stderr)
        return 2
    if args.against is not None and not (args.against / "trtmoe" / "checkpoint" / "writer.py").is_file():
        print(f"error: --against {args.against} is not a trtmoe checkout", file=sys.stderr)
        return 2
    base = args.workdir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    # Peak disk use per size: source + one output (copy or convert) ≈ 2× the largest size.
    need = 2.2 * max(sizes) * GB
    free = shutil.disk_usage(base).free
    if free < need:
        print(f"error: {base} has {free / GB:.1f} GB free; these sizes need about {need / GB:.1f} GB",
              file=sys.stderr)
        return 2
    work_root = Path(tempfile.mkdtemp(prefix="trtmoe-bench-", dir=base))
    rows = []
    load0 = os.getloadavg()
    try:
        for s in sizes:
            work = work_root / f"{s:g}GB"
            work.mkdir()
            print(f"size {s:g} GB …", file=sys.stderr, flush=True)
            rows += bench_one(s, work, layouts, max(1, args.rounds), args.profile, args.against)
            shutil.rmtree(work, ignore_errors=True)
    finally:
        keep = [p for p in work_root.glob("*.prof")]
        if keep:
            for p in keep:
                shutil.move(str(p), base / p.name)
            print("profiles: " + ", ".join(str(base / p.name) for p in keep), file=sys.stderr)
        shutil.rmtree(work_root, ignore_errors=True)
    print_table(rows, (load0, os.getloadavg()))
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
