#!/usr/bin/env python3
"""Serving benchmark: 1, 8 and 32 concurrent gRPC streams against the trained fixture on Triton.

Builds checkpoint -> embedded engine dir -> streaming repository (`trtmoe repo --streaming`) in a
temp dir and starts the CPU Triton server (or uses --url of a running, decoupled one), then runs
closed-loop streaming clients through the `ensemble`. Every request asks for exactly --tokens tokens (min_tokens = max_tokens), so runs are
comparable. Reports output tokens/s (all streams together, and the ratio to the 1-stream baseline
measured in the same run), time to first token and inter-token latency p50/p99 (per token: a
response carrying k tokens after a gap g counts k times g/k), next to what the embedded engine
alone reaches decoding the same number of sequences in this process (the ceiling for the server).

    python scripts/bench_serve.py                      # fixture, 1/8/32 streams
    python scripts/bench_serve.py --url 127.0.0.1:8001 --concurrency 1 4 16
    python scripts/bench_serve.py --concurrency 1 8 --torch-threads 2   # compare with the default

It also prints the resident memory of the served stack (tritonserver and each backend process),
idle after loading and after the run.

Targets: tokens/s at 32 streams >= 8x single-stream; p99 ITL <= 3x p50.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from trtmoe.triton.client import generate  # noqa: E402

PROMPTS = ["def main(", "import os\n", "class Parser:\n    def __init__(self", "    return self.", "for i in range(",
           "x = [", "if __name__ ==", "try:\n    import"]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_level(url: str, concurrency: int, rounds: int, tokens: int) -> dict:
    """``concurrency`` workers, each sending ``rounds`` streaming requests back to back."""
    results, errors = [], []
    barrier = threading.Barrier(concurrency + 1)
    extra = {"min_tokens": np.array([[tokens]], dtype=np.int32),
             "return_num_output_tokens": np.array([[True]], dtype=bool)}

    def worker(w: int) -> None:
        client = grpcclient.InferenceServerClient(url)  # one connection per stream, reused
        barrier.wait()
        for r in range(rounds):
            prompt = PROMPTS[(w + r) % len(PROMPTS)]
            try:
                res = generate(url, prompt, max_tokens=tokens, check=False, client=client, extra=extra)
                results.append(res)
            except Exception as e:  # noqa: BLE001 - reported in the table
                errors.append(str(e))
        client.close()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    out_tokens = sum(r.output_token_counts[-1] if r.output_token_counts else len(r.pieces) for r in results)
    ttft = [r.response_times[0] * 1e3 for r in results if r.response_times]
    itl = []  # one sample per token: a response carrying k tokens after a gap g counts k times g/k
    for r in results:
        counts = r.output_token_counts or list(range(1, len(r.response_times) + 1))
        for (a, b), (na, nb) in zip(zip(r.response_times, r.response_times[1:]), zip(counts, counts[1:])):
            k = max(nb - na, 1)
            itl += [(b - a) * 1e3 / k] * k
    return {"concurrency": concurrency, "requests": len(results), "errors": len(errors), "first_error": errors[:1],
            "tokens": out_tokens, "wall_s": wall, "tok_s": out_tokens / wall if wall else 0.0,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99)}


def engine_only(ckpt: Path, levels: list[int], tokens: int, threads: int) -> dict[int, float]:
    """Tokens/s of the embedded engine alone (no server) decoding B sequences together: the ceiling
    the served numbers are measured against."""
    import torch

    from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        eng = EmbeddedEngine.from_checkpoint(ckpt, device="cpu", max_seq_len=64 + tokens + 8)
        out = {}
        for b in levels:
            t0 = time.perf_counter()
            seqs = [eng.start([1, 5 + i % 50, 9, 12], SamplingParams(max_new_tokens=tokens, min_tokens=tokens, end_id=2))
                    for i in range(b)]
            while not all(s.finished for s in seqs):
                eng.step(seqs)
            out[b] = b * tokens / (time.perf_counter() - t0)
        return out
    finally:
        torch.set_num_threads(old)


def serve_fixture(workdir: Path, args):
    from trtmoe.checkpoint.writer import convert
    from trtmoe.triton.repository import default_torch_threads, generate_repository
    from trtmoe.triton.serve import serve_repository

    if not args.torch_threads:  # what `trtmoe repo` picks: cores less one per two pre/post/BLS instances
        args.torch_threads = default_torch_threads(3)
    ckpt = workdir / "ckpt"
    convert(args.fixture, ckpt, dtype=args.dtype)
    print("engine alone (no server), same dtype and threads ...", flush=True)
    args.engine_rates = engine_only(ckpt, args.concurrency, args.tokens, args.torch_threads)
    engine = workdir / "engine"
    engine.mkdir()
    build = {"max_batch_size": args.max_batch_size, "max_input_len": 64, "max_seq_len": 64 + args.tokens + 8,
             "max_beam_width": 1, "tokens_per_block": 32}
    (engine / "config.json").write_text(json.dumps({"backend": "embedded", "checkpoint": "../ckpt", "build_config": build}))
    repo = generate_repository(engine, workdir / "repo", torch_num_threads=args.torch_threads,
                               stream_interval=args.stream_interval, streaming=True)
    return serve_repository(repo.path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=300)


def stack_rss_mb(server) -> dict[str, float]:
    """Resident memory (MB) of tritonserver and each Python-backend process of ``server``."""
    import subprocess

    ps = subprocess.run(["ps", "-ww", "-o", "rss=,args=", "-g", str(server.process.pid)], capture_output=True,
                        text=True).stdout
    out: dict[str, float] = {}
    for line in ps.splitlines():
        rss, cmd = line.split(None, 1)
        name = "tritonserver"
        if "triton_python_backend_stub" in cmd:
            name = Path(cmd.split()[1]).parent.parent.name  # .../<model>/1/model.py
        out[name] = out.get(name, 0.0) + int(rss) / 1024
    out["total"] = sum(out.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="gRPC endpoint of a running server (default: start one)")
    ap.add_argument("--fixture", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "trained_mixtral")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="requests per stream")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch threads in the server's engine [default: the repository's default, chosen from "
                         "the cores and the model instances]")
    ap.add_argument("--stream-interval", type=int, default=None,
                    help="tokens per streamed response (trtmoe repo --stream-interval; first and last at once); "
                         "default: the repository's default, auto")
    ap.add_argument("--min-requests", type=int, default=12,
                    help="at least this many requests per level (more rounds for few streams), so the "
                         "1-stream baseline is not a one-second sample")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                    help="checkpoint dtype to serve (float32 is the fastest on CPU)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()

    server = None
    tmp = tempfile.TemporaryDirectory(prefix="trtmoe-bench-")
    try:
        if args.url is None:
            print(f"starting Triton on {args.fixture.name} (max_batch_size {args.max_batch_size}, "
                  f"torch threads {args.torch_threads or 'default'}) ...", flush=True)
            server = serve_fixture(Path(tmp.name), args)
            url = server.endpoints.grpc
            time.sleep(2.0)
            idle = stack_rss_mb(server)
            print(f"torch threads {args.torch_threads}; RSS idle after load: "
                  + ", ".join(f"{k} {v:.0f} MB" for k, v in idle.items()), flush=True)
        else:
            url = args.url
        run_level(url, 2, 1, 8)  # warm-up: first-call costs stay out of the numbers
        rows = []
        for c in args.concurrency:
            rows.append(run_level(url, c, max(args.rounds, -(-args.min_requests // c)), args.tokens))
            r = rows[-1]
            print(f"  {c:>3} streams: {r['tok_s']:.1f} tok/s ({r['requests']} requests, {r['errors']} errors)", flush=True)
        base = rows[0]["tok_s"] or float("nan")
        rates = getattr(args, "engine_rates", None) or {}
        for r in rows:
            r["engine_only_tok_s"] = rates.get(r["concurrency"])
        print()
        si = ("of the running server" if args.url is not None else
              "auto" if not args.stream_interval else args.stream_interval)
        print(f"cpu cores: {os.cpu_count()}; {args.tokens} tokens/request; >= {args.rounds} requests/stream and "
              f">= {args.min_requests} per level; stream interval {si}")
        ebase = rates.get(rows[0]["concurrency"])
        print(f"{'streams':>7} {'req':>4} {'tok/s':>8} {'x 1-stream':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'ITL p50':>8} {'ITL p99':>8} {'p99/p50':>7} {'engine-only tok/s (x)':>22}")
        for r in rows:
            eo = r["engine_only_tok_s"]
            eo_txt = f"{eo:.1f} ({eo / ebase:.2f}x)" if eo and ebase else "-"
            print(f"{r['concurrency']:>7} {r['requests']:>4} {r['tok_s']:>8.1f} {r['tok_s'] / base:>10.2f} "
                  f"{r['ttft_p50_ms']:>7.1f}ms {r['ttft_p99_ms']:>7.1f}ms {r['itl_p50_ms']:>6.1f}ms "
                  f"{r['itl_p99_ms']:>6.1f}ms {r['itl_p99_ms'] / r['itl_p50_ms']:>7.2f} {eo_txt:>22}")
        top = rows[-1]
        print()
        print(f"target tok/s at {top['concurrency']} streams >= 8x 1-stream: {top['tok_s'] / base:.2f}x "
              f"-> {'met' if top['tok_s'] / base >= 8 else 'NOT met'}")
        worst = max(r["itl_p99_ms"] / r["itl_p50_ms"] for r in rows)
        print(f"target ITL p99 <= 3x p50 (worst row): {worst:.2f}x -> {'met' if worst <= 3 else 'NOT met'}")
        if any(r["errors"] for r in rows):
            print("errors:", [r["first_error"] for r in rows if r["errors"]])
        if server is not None:
            print("RSS after the run: " + ", ".join(f"{k} {v:.0f} MB" for k, v in stack_rss_mb(server).items()))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    finally:
        if server is not None:
            server.stop()
        tmp.cleanup()


if __name__ == "__main__":
    main()
