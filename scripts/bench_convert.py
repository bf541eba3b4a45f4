#!/usr/bin/env python3
"""Benchmark ``trtmoe convert`` against a plain copy of the same bytes, at two model sizes.

For each size a synthetic Mixtral-shaped checkpoint is written (seeded random bf16 weights,
Mixtral-8x7B tensor shapes: hidden 4096, expert FFN 14336, vocab 32000, 32 query / 8 KV heads;
only the number of layers and experts shrink), in several shards with an index. Then, in the
same run:

* ``copy``: ``shutil.copyfile`` of every source file into a temporary directory, each fsynced
  (the converter fsyncs its rank files too, so both baselines pay for durable writes);
* ``convert``: ``trtmoe.checkpoint.writer.convert`` to tp=2, moe_ep=2 in a child process; its
  wall time is measured inside the child (interpreter and torch start-up excluded) and its
  peak resident memory is the child's ``ru_maxrss`` (start-up included).

Targets: convert time <= 1.5x copy time; peak RSS <= 1 GiB + the largest single source tensor,
at every size (so the peak does not grow with the model).

    python scripts/bench_convert.py --sizes 2,4 --workdir /tmp/trtmoe-bench
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

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def time_copy(src: Path, dst: Path) -> float:
    """Seconds to copy every file of ``src`` into ``dst`` with ``shutil.copyfile``, fsynced."""
    os.sync()  # start from clean dirty-page state, as the convert run below does
    t0 = time.perf_counter()
    dst.mkdir()
    for f in sorted(src.iterdir()):
        shutil.copyfile(f, dst / f.name)
        _fsync(dst / f.name)
    return time.perf_counter() - t0


_CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from trtmoe.checkpoint.writer import convert
src, out, prof = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
if prof:
    import cProfile
    cProfile.run("convert(src, out, tp=2, moe_ep=2, dtype='auto')", prof)
else:
    convert(src, out, tp=2, moe_ep=2, dtype="auto")
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def time_convert(src: Path, out: Path, profile: Path | None = None) -> tuple[float, float, int]:
    """Run convert in a child process; returns (convert seconds, process wall seconds, peak RSS bytes)."""
    os.sync()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(out), str(profile or "")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    stdout = proc.stdout.read()
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"convert child failed ({proc.returncode}):\n{stderr[-4000:]}")
    inner = json.loads(stdout.strip().splitlines()[-1])["seconds"]
    return inner, wall, usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def largest_tensor_bytes(cfg: dict, dtype_bytes: int = 2) -> tuple[str, int]:
    name, shape = max(mixtral_tensor_shapes(cfg), key=lambda x: math.prod(x[1]))
    return name, math.prod(shape) * dtype_bytes


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def bench_one(size_gb: float, work: Path, profile: bool, repeat: int = 1) -> dict:
    """Generate one size, then time copy and convert ``repeat`` times each (best time, worst RSS)."""
    shape = shape_for_size(size_gb * GB)
    src, cp, out = work / "src", work / "copy", work / "converted"
    t0 = time.perf_counter()
    write_synthetic_mixtral(src, **shape)
    gen_s = time.perf_counter() - t0
    cfg = json.loads((src / "config.json").read_text())
    src_bytes = dir_bytes(src)
    copy_s = conv_s = conv_wall = math.inf
    rss = 0
    prof_path = work.parent / f"convert-{size_gb:g}GB.prof" if profile else None
    for _ in range(repeat):
        copy_s = min(copy_s, time_copy(src, cp))
        shutil.rmtree(cp)  # keep peak disk use at source + converted output
        c, w, r = time_convert(src, out, prof_path)
        out_bytes = dir_bytes(out)
        conv_s, conv_wall, rss = min(conv_s, c), min(conv_wall, w), max(rss, r)
        shutil.rmtree(out)
    big_name, big = largest_tensor_bytes(cfg)
    row = {
        "size_gb": size_gb, "layers": shape["layers"], "experts": shape["experts"],
        "source_bytes": src_bytes, "shards": len(list(src.glob("*.safetensors"))),
        "output_bytes": out_bytes, "generate_s": gen_s,
        "copy_s": copy_s, "convert_s": conv_s, "convert_process_s": conv_wall, "ratio": conv_s / copy_s,
        "peak_rss_bytes": rss, "largest_tensor": big_name, "largest_tensor_bytes": big,
        "rss_limit_bytes": GiB + big, "profile": str(prof_path) if prof_path else None, "repeat": repeat,
    }
    shutil.rmtree(src)
    return row


def print_table(rows: list[dict]) -> None:
    def gb(n):
        return f"{n / GiB:.2f}"

    head = ("source GiB", "layers×experts", "shards", "copy s", "convert s", "ratio", "peak RSS GiB",
            "largest tensor GiB", "RSS limit GiB", "targets")
    lines = []
    for r in rows:
        ok = r["ratio"] <= 1.5 and r["peak_rss_bytes"] <= r["rss_limit_bytes"]
        lines.append((gb(r["source_bytes"]), f"{r['layers']}×{r['experts']}", str(r["shards"]),
                      f"{r['copy_s']:.1f}", f"{r['convert_s']:.1f}", f"{r['ratio']:.2f}",
                      gb(r["peak_rss_bytes"]), gb(r["largest_tensor_bytes"]), gb(r["rss_limit_bytes"]),
                      "met" if ok else "MISSED"))
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for l in lines:
        print("  ".join(c.rjust(w) for c, w in zip(l, widths)))
    print("targets: convert ≤ 1.5 × copy; peak RSS ≤ 1 GiB + largest tensor. convert = tp=2 moe_ep=2, "
          f"best of {rows[0]['repeat']}, timed inside the child (process incl. start-up: "
          + ", ".join(f"{r['convert_process_s']:.1f} s" for r in rows) + ")")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python scripts/bench_convert.py --sizes 2,4")
    ap.add_argument("--sizes", default="2,4", help="model sizes in GB (10^9 bytes), comma separated [2,4]")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory [a new temp dir]")
    ap.add_argument("--profile", action="store_true", help="cProfile the convert child; .prof files kept")
    ap.add_argument("--repeat", type=int, default=1, help="time copy and convert N times each, keep the best [1]")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    base = args.workdir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    # Peak disk use per size: source + fsynced copy (removed before convert) ≈ 2× the largest size.
    need = 2.2 * max(sizes) * GB
    free = shutil.disk_usage(base).free
    if free < need:
        print(f"error: {base} has {free / GB:.1f} GB free; these sizes need about {need / GB:.1f} GB",
              file=sys.stderr)
        return 2
    work_root = Path(tempfile.mkdtemp(prefix="trtmoe-bench-", dir=base))
    rows = []
    try:
        for s in sizes:
            work = work_root / f"{s:g}GB"
            work.mkdir()
            print(f"size {s:g} GB …", file=sys.stderr, flush=True)
            rows.append(bench_one(s, work, args.profile, max(1, args.repeat)))
            shutil.rmtree(work, ignore_errors=True)
    finally:
        keep = [p for p in work_root.glob("*.prof")]
        if keep:
            for p in keep:
                shutil.move(str(p), base / p.name)
            print("profiles: " + ", ".join(str(base / p.name) for p in keep), file=sys.stderr)
        shutil.rmtree(work_root, ignore_errors=True)
    print_table(rows)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
