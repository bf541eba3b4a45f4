#!/usr/bin/env python3
"""The embedded engine's weight modes on CPU: peak RSS, load CPU time and decode CPU time per step of
``weights="checkpoint"`` (weight matrices held in the checkpoint's bfloat16, converted a block at a
time per product) against ``weights="compute"`` (held in float32, dense weights and large experts
packed for oneDNN: the baseline, measured in the same run), each in a fresh child process on
``--threads`` threads.

The model is a random bfloat16 checkpoint built with ``bench_scale.make_model`` at Qwen3-30B-A3B's
widths (hidden 2048, expert FFN 768, top-8, 32 query / 4 KV heads), with ``--experts`` experts,
``--vocab`` tokens and ``--layers`` layers (the defaults keep the float32 engine near 3 GB).
Decode: ``--steps`` greedy steps after a 16-token prompt, batch 1 and 8; the tokens are compared.

    python scripts/bench_weights.py
    python scripts/bench_weights.py --experts 128 --vocab 151936   # 2.3 GiB checkpoint; float32 needs ~11 GB
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

_CHILD = r"""
import json, resource, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams
ck, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[4])
c0 = time.process_time()
eng = EmbeddedEngine.from_checkpoint(ck, device="cpu", weights=mode)
out = {"load_cpu_s": time.process_time() - c0}
g = torch.Generator().manual_seed(0)
for B in (1, 8):
    prompts = torch.randint(3, eng.vocab_size, (B, 16), generator=g).tolist()
    seqs = eng.start_many(prompts, [SamplingParams(max_new_tokens=steps + 2) for _ in prompts])
    eng.step(seqs)
    c1 = time.process_time()
    for _ in range(steps):
        eng.step(seqs)
    out[f"decode{B}_ms"] = (time.process_time() - c1) / steps * 1e3
    out[f"tokens{B}"] = [s.tokens for s in seqs]
out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print("RESULT " + json.dumps(out))
"""


def run_child(ckpt: Path, mode: str, threads: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt), mode, str(threads), str(steps)],
                       capture_output=True, text=True, env=env, timeout=3600)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{mode}: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None, help="where the model goes (default: a temp dir)")
    args = ap.parse_args(argv)
    import bench_scale
    from trtmoe.checkpoint.writer import convert

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-weights-"))
    bench_scale.WIDTHS["bench"] = {**bench_scale.WIDTHS["qwen3"], "experts": args.experts, "vocab": args.vocab}
    hf = bench_scale.make_model("bench", args.layers, work / "hf")
    ckpt = convert(hf, work / "ckpt").out_dir
    size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors")) / 2**30
    rows = {mode: run_child(ckpt, mode, args.threads, args.steps) for mode in ("compute", "checkpoint")}
    print(f"checkpoint {size:.2f} GiB (bfloat16; {args.layers} layer(s), {args.experts} experts, vocab {args.vocab}), "
          f"{args.threads} thread(s), CPU time")
    print(f"{'weights':<12}{'peak RSS GiB':>14}{'load s':>9}{'decode b1 ms/step':>19}{'decode b8 ms/step':>19}")
    for mode, r in rows.items():
        print(f"{mode:<12}{r['peak_rss_gib']:>14.2f}{r['load_cpu_s']:>9.1f}{r['decode1_ms']:>19.1f}{r['decode8_ms']:>19.1f}")
    same = all(rows["compute"][k] == rows["checkpoint"][k] for k in ("tokens1", "tokens8"))
    print(f"greedy tokens identical: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
