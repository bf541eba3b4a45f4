#!/usr/bin/env python3
"""In-process speed of the embedded engine: decode and batched prefill tokens/s, against baselines
measured in the same run.

Implementations (each in its own worker process, loaded once):

* ``engine``: this tree's ``EmbeddedEngine`` on a checkpoint converted from ``--model``;
* ``engine@REV`` (``--baseline-rev REV``): the engine as it was at git revision REV (its ``trtmoe``
  package extracted with ``git archive`` and put first on the worker's path; that revision's own
  converter writes its checkpoint);
* ``transformers``: the model's own transformers class on the same HF weights, float32 (what the
  engine computes in on CPU), decoding with its KV cache;
* ``vllm`` (``--vllm-python PY``, a Python whose environment has vLLM, e.g. the CPU build set up as
  in scripts/bench_peers.py; never a dependency of this project): vLLM's offline ``LLM.generate`` on
  the same HF weights, float32, with the given torch/OMP thread count and its engine core in the
  worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so its CPU time is counted). A decode case
  times ``generate`` of --steps + 1 greedy tokens (``ignore_eos``) minus ``generate`` of one token on
  the same prompts (prefill and first token), so both engines are timed on the same steps; a prefill
  case times ``generate`` of one token.

Cases: decode at batch 1 / 8 / 32 (16-token prompts, then ``--steps`` greedy steps timed; prefill
not counted), the batch-8 and batch-32 decodes with the engine's batch listed in the reverse of its
slot order (``decode8r``, ``decode32r``: a serving batch's order; the other implementations run
``decode8``/``decode32`` there), prefill of 8x128 and 64x128 tokens (one batched forward filling the KV cache,
last-position logits only) and ``prefill_mixed``: 16 prefills of 1-8 prompts of 20-200 tokens, sizes
drawn anew every round (a server meets new batch and expert-block shapes all the time, and a
library that builds a kernel per shape pays for it there). Rounds are interleaved (every round runs every case on every
implementation, in a rotating order) and the table shows medians over rounds, wall and CPU time
(the worker's user+system time: less sensitive than wall time to other load on a shared machine,
but not immune to it). Greedy decode tokens are compared across implementations and reported.

    python scripts/bench_engine.py --model tests/fixtures/trained_mixtral --baseline-rev 7741c3e
    python scripts/bench_engine.py --model tests/fixtures/trained_qwen3_moe --quant int4_g64 --rounds 5
    python scripts/bench_engine.py --model tests/fixtures/trained_mixtral --profile decode32
    python scripts/bench_engine.py --vllm-python /tmp/peers/vllm/bin/python --no-transformers

``--threads`` sets torch's intra-op threads in every worker (default 1). ``--quant FMT`` converts
with every routed expert in FMT (``uniform`` policy), so the engine runs from packed bytes;
transformers still runs the float weights then. ``--also-quant FMT`` (repeatable; ``float`` for the
unquantized experts) adds this tree's engine with another expert format, so formats are compared in
one run:

    python scripts/bench_engine.py --model /tmp/realw2 --quant int8 --also-quant float --also-quant int4_g128 --no-transformers
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

CASES = {  # name: (kind, batch, tokens)
    "decode1": ("decode", 1, 16),
    "decode8": ("decode", 8, 16),
    "decode32": ("decode", 32, 16),
    # The same decode with the batch listed in the reverse of its slot order, as a serving batch lists
    # its sequences in arrival order while the engine reuses the lowest free slot.
    "decode8r": ("decode_reordered", 8, 16),
    "decode32r": ("decode_reordered", 32, 16),
    "prefill8x128": ("prefill", 8, 128),
    "prefill64x128": ("prefill", 64, 128),
    # A serving-like stream of prefills: 16 batches of 1-8 prompts of 20-200 tokens (one length per
    # batch, so every implementation runs it unpadded), new sizes in every round.
    "prefill_mixed": ("prefill_mixed", 8, 200),
}


# ------------------------------------------------------------------------------------------------
# worker side
# ------------------------------------------------------------------------------------------------

def _prompts(vocab: int, batch: int, tokens: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (batch, tokens), generator=g).tolist()


def _mixed_batches(vocab: int, batch: int, tokens: int, seed: int, n: int = 16) -> list[list[list[int]]]:
    """``n`` batches of 1-``batch`` prompts of 20-``tokens`` tokens (one length per batch), seeded."""
    import random

    rnd = random.Random(seed)
    sizes = [(rnd.randint(1, batch), rnd.randint(20, tokens)) for _ in range(n)]
    return [_prompts(vocab, b, t, seed=seed * 1000 + i) for i, (b, t) in enumerate(sizes)]


class _EngineRunner:
    def __init__(self, model: str, workdir: Path, quant: str | None, activations: str = "float32"):
        import torch

        from trtmoe.checkpoint.writer import convert
        from trtmoe.runtime.engine import EmbeddedEngine

        plan = None
        if quant:
            from trtmoe.hf.reader import HFCheckpoint
            from trtmoe.quant.plan import uniform_plan

            with HFCheckpoint(model) as src:
                plan = uniform_plan(src.model, quant)
        ck = workdir / "ckpt"
        convert(model, ck, quant=plan, force=True)
        self.eng = EmbeddedEngine.from_checkpoint(ck, device="cpu", **(
            {"cpu_activations": activations} if activations != "float32" else {}))
        self.vocab = self.eng.vocab_size
        self.torch = torch

    def decode(self, prompts: list[list[int]], steps: int, reorder: bool = False
               ) -> tuple[float, float, list[list[int]]]:
        from trtmoe.runtime.engine import SamplingParams

        eng = self.eng
        seqs = eng.start_many(prompts, [SamplingParams(max_new_tokens=steps + 1) for _ in prompts])
        batch = seqs[::-1] if reorder else seqs
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            eng.step(batch)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        return wall, cpu, [s.tokens for s in seqs]

    def count_step(self, prompts: list[list[int]], counter, reorder: bool = False) -> int:
        from trtmoe.runtime.engine import SamplingParams

        seqs = self.eng.start_many(prompts, [SamplingParams(max_new_tokens=4) for _ in prompts])
        if reorder:
            seqs = seqs[::-1]
        self.eng.step(seqs)
        with counter():
            self.eng.step(seqs)
        return counter.n

    def prefill(self, prompts: list[list[int]]) -> tuple[float, float]:
        from trtmoe.runtime.engine import SamplingParams

        t, c = time.perf_counter(), time.process_time()
        seqs = self.eng.start_many(prompts, [SamplingParams(max_new_tokens=2) for _ in prompts])
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        del seqs
        return wall, cpu


class _HFRunner:
    def __init__(self, model: str, workdir: Path, quant: str | None):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.vocab = self.model.config.vocab_size
        # Newer transformers call the KV cache argument ``cache`` (``past_key_values`` before).
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def decode(self, prompts: list[list[int]], steps: int) -> tuple[float, float, list[list[int]]]:
        torch = self.torch
        with torch.inference_mode():
            ids = torch.tensor(prompts)
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache, tok = _cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)
            toks = [tok]
            t, c = time.perf_counter(), time.process_time()
            for _ in range(steps):
                out = self.model(input_ids=tok, use_cache=True, **{self.cache_kw: cache})
                cache, tok = _cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(tok)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
        return wall, cpu, torch.cat(toks, 1).tolist()

    def count_step(self, prompts: list[list[int]], counter) -> int:
        torch = self.torch
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor(prompts), use_cache=True, logits_to_keep=1)
            for i in range(2):
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                if i:
                    with counter():
                        self.model(input_ids=tok, use_cache=True, **{self.cache_kw: _cache_of(out)})
                    return counter.n
                out = self.model(input_ids=tok, use_cache=True, **{self.cache_kw: _cache_of(out)})

    def prefill(self, prompts: list[list[int]]) -> tuple[float, float]:
        torch = self.torch
        with torch.inference_mode():
            t, c = time.perf_counter(), time.process_time()
            self.model(input_ids=torch.tensor(prompts), use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t, time.process_time() - c


class _VllmRunner:
    def __init__(self, model: str, workdir: Path, quant: str | None, threads: int, dtype: str = "float32"):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        import torch
        from vllm import LLM, SamplingParams

        self.torch, self.SamplingParams = torch, SamplingParams
        self.llm = LLM(model=model, dtype=dtype, max_model_len=512, max_num_seqs=64, seed=0)
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()

    def _generate(self, prompts: list[list[int]], n: int):
        sp = self.SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        t, c = time.perf_counter(), time.process_time()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t, time.process_time() - c, [list(o.outputs[0].token_ids) for o in outs]

    def decode(self, prompts: list[list[int]], steps: int) -> tuple[float, float, list[list[int]]]:
        w1, c1, _ = self._generate(prompts, 1)
        wall, cpu, toks = self._generate(prompts, steps + 1)
        return wall - w1, cpu - c1, toks

    def count_step(self, prompts: list[list[int]], counter) -> int:
        return 0  # its steps run partly outside torch's dispatcher (custom CPU kernels): not comparable

    def prefill(self, prompts: list[list[int]]) -> tuple[float, float]:
        wall, cpu, _ = self._generate(prompts, 1)
        return wall, cpu


def _count_ops(runner, kind: str, prompts: list[list[int]]) -> int:
    """Tensor operations dispatched by one decode step (after one untimed step) or by the prefill:
    a count that, unlike time, other load on the machine cannot disturb."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.n += 1
            return func(*args, **(kwargs or {}))

    if kind == "decode_reordered" and isinstance(runner, _EngineRunner):
        return runner.count_step(prompts, Counter, reorder=True)
    if kind.startswith("decode"):  # the peers' batches have no slot order
        return runner.count_step(prompts, Counter)
    if isinstance(runner, _VllmRunner):
        return 0
    with Counter():
        runner.prefill(prompts)
    return Counter.n


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    if args.worker == "vllm":
        runner = _VllmRunner(args.model, workdir, args.quant, args.threads, args.vllm_dtype)
        torch.set_num_threads(args.threads)
        import vllm

        ready = {"ready": True, "vllm": vllm.__version__, "torch_threads": torch.get_num_threads()}
    else:
        runner = (_HFRunner(args.model, workdir, args.quant) if args.worker == "transformers" else
                  _EngineRunner(args.model, workdir, args.quant, args.cpu_activations))
        import trtmoe

        ready = {"ready": True, "trtmoe": str(Path(trtmoe.__file__).parent), "torch_threads": torch.get_num_threads()}
    print(json.dumps(ready), flush=True)
    calls: dict[str, int] = {}
    for line in sys.stdin:
        case = line.strip()
        if not case:
            continue
        count = case.startswith("ops:")
        case = case.removeprefix("ops:")
        kind, batch, tokens = CASES[case]
        calls[case] = calls.get(case, 0) + 1
        if kind == "prefill_mixed":
            if count:
                print(json.dumps({"ops": 0}), flush=True)
                continue
            wall = cpu = 0.0
            n = 0
            for prompts in _mixed_batches(runner.vocab, batch, tokens, seed=calls[case]):
                w, c = runner.prefill(prompts)
                wall, cpu, n = wall + w, cpu + c, n + sum(map(len, prompts))
            print(json.dumps({"wall": wall, "cpu": cpu, "tokens": n}), flush=True)
            continue
        prompts = _prompts(runner.vocab, batch, tokens, seed=batch * 1000 + tokens)
        if count:
            print(json.dumps({"ops": _count_ops(runner, kind, prompts)}), flush=True)
            continue
        if kind.startswith("decode"):
            extra = {"reorder": True} if kind == "decode_reordered" and isinstance(runner, _EngineRunner) else {}
            wall, cpu, toks = runner.decode(prompts, args.steps, **extra)
            res = {"wall": wall, "cpu": cpu, "tokens": batch * args.steps, "out": toks}
        else:
            wall, cpu = runner.prefill(prompts)
            res = {"wall": wall, "cpu": cpu, "tokens": batch * tokens}
        print(json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------------------
# coordinator side
# ------------------------------------------------------------------------------------------------

def _extract_rev(rev: str, dest: Path) -> None:
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", rev, "trtmoe"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


class _Worker:
    def __init__(self, name: str, args, pythonpath: str | None, quant: str | None = "same",
                 activations: str = "float32"):
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
        kind = name if name in ("transformers", "vllm") else "engine"
        python = str(args.vllm_python) if kind == "vllm" else sys.executable
        cmd = [python, str(Path(__file__).resolve()), "--worker", kind, "--model", args.model, "--threads",
               str(args.threads), "--steps", str(args.steps)]
        quant = args.quant if quant == "same" else quant
        if quant:
            cmd += ["--quant", quant]
        if activations != "float32":
            cmd += ["--cpu-activations", activations]
        if kind == "vllm":
            cmd += ["--vllm-dtype", args.vllm_dtype]
        self.name = name
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                  cwd=tempfile.gettempdir())
        self.info = self._read()

    def _read(self) -> dict:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise SystemExit(f"worker {self.name} exited (rc {self.p.wait()})")
            if line.startswith("{"):  # a peer may print its own lines on stdout
                return json.loads(line)

    def run(self, case: str) -> dict:
        self.p.stdin.write(case + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


def profile(args) -> None:
    import cProfile
    import pstats

    import torch

    torch.set_num_threads(args.threads)
    runner = _EngineRunner(args.model, Path(tempfile.mkdtemp(prefix="bench-engine-")), args.quant)
    kind, batch, tokens = CASES[args.profile]
    prompts = _prompts(runner.vocab, batch, tokens, seed=0)
    extra = {"reorder": True} if kind == "decode_reordered" else {}
    fn = (lambda: runner.decode(prompts, args.steps, **extra)) if kind.startswith("decode") else (
        lambda: runner.prefill(prompts))
    if kind == "prefill_mixed":
        fn = lambda: [runner.prefill(p) for p in _mixed_batches(runner.vocab, batch, tokens, seed=0)]  # noqa: E731
    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        fn()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO_ROOT / "tests" / "fixtures" / "trained_mixtral"))
    ap.add_argument("--baseline-rev", action="append", default=[],
                    help="also run the engine at this git revision (repeatable)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--vllm-python", type=Path, default=None,
                    help="also run vLLM's offline LLM.generate with this Python (its environment has vLLM)")
    ap.add_argument("--quant", help="convert with every routed expert in this format (e.g. int8, int4_g64)")
    ap.add_argument("--also-quant", action="append", default=[], metavar="FMT",
                    help="also run this tree's engine with every routed expert in FMT ('float': unquantized), "
                         "as implementation engine[FMT] (repeatable)")
    ap.add_argument("--also-model-activations", action="store_true",
                    help="also run this tree's engine with cpu_activations='model' (the checkpoint's dtype on "
                         "CPU, e.g. bfloat16), as implementation engine[model-act]")
    ap.add_argument("--cpu-activations", default="float32", choices=("float32", "model"),
                    help="what this tree's engine computes in ('model': the checkpoint's dtype); baseline "
                         "revisions keep float32")
    ap.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the dtype vLLM runs in (bfloat16: the peer of --cpu-activations model)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per decode case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="also write the raw measurements here")
    ap.add_argument("--profile", choices=list(CASES), help="cProfile this tree's engine on one case and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = str(Path(args.model).resolve())
    if args.worker:
        return worker(args)
    if args.profile:
        return profile(args)
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; known: {', '.join(CASES)}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-engine-revs-"))
    workers = [_Worker("engine", args, str(REPO_ROOT), activations=args.cpu_activations)]
    for rev in args.baseline_rev:
        d = tmp / rev.replace("/", "_")
        d.mkdir()
        _extract_rev(rev, d)
        workers.append(_Worker(f"engine@{rev}", args, str(d)))
    for fmt in args.also_quant:
        workers.append(_Worker(f"engine[{fmt}]", args, str(REPO_ROOT), None if fmt == "float" else fmt))
    if args.also_model_activations:
        workers.append(_Worker("engine[model-act]", args, str(REPO_ROOT), activations="model"))
    if not args.no_transformers:
        workers.append(_Worker("transformers", args, None))
    if args.vllm_python:
        if args.quant:
            raise SystemExit("--vllm-python runs the float weights; leave out --quant")
        workers.append(_Worker("vllm", args, None))
    for w in workers:
        print(f"# {w.name}: {w.info}", file=sys.stderr)
    results: dict[str, dict[str, list[dict]]] = {w.name: {c: [] for c in cases} for w in workers}
    try:
        for r in range(args.rounds):
            for c in cases:
                k = (r + cases.index(c)) % len(workers)
                for w in workers[k:] + workers[:k]:  # rotate who goes first
                    results[w.name][c].append(w.run(c))
            print(f"# round {r + 1}/{args.rounds} done", file=sys.stderr)
        ops = {w.name: {c: w.run("ops:" + c)["ops"] for c in cases} for w in workers}
    finally:
        for w in workers:
            w.close()
    names = [w.name for w in workers]
    print(f"\nmodel {args.model}{' (' + args.quant + ' experts)' if args.quant else ''}"
          f"{'; engine cpu_activations ' + args.cpu_activations if args.cpu_activations != 'float32' else ''}"
          f"{'; vLLM ' + args.vllm_dtype if args.vllm_python else ''}; torch threads "
          f"{args.threads}; medians of {args.rounds} interleaved rounds; tok/s wall (cpu). "
          f"Shared machine: wall numbers are noisy, CPU numbers less so.\n")
    print("| case | " + " | ".join(names) + " | " + " | ".join(f"engine / {n}" for n in names[1:]) + " |")
    print("|---" * (1 + 2 * len(names) - 1) + "|")
    for c in cases:
        med = {}
        for n in names:
            rs = results[n][c]
            med[n] = (statistics.median(x["tokens"] / x["wall"] for x in rs),
                      statistics.median(x["tokens"] / x["cpu"] for x in rs if x["cpu"] > 0))
        cells = [f"{med[n][0]:,.0f} ({med[n][1]:,.0f})" for n in names]
        ratios = [f"{med['engine'][0] / med[n][0]:.2f}× ({med['engine'][1] / med[n][1]:.2f}×)" for n in names[1:]]
        print(f"| {c} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    print("\ntensor ops dispatched per decode step / per prefill forward (deterministic):\n")
    print("| case | " + " | ".join(names) + " |")
    print("|---" * (1 + len(names)) + "|")
    for c in cases:
        print(f"| {c} | " + " | ".join(f"{ops[n][c]:,}" if n != "vllm" else "n/a" for n in names) + " |")
    same = []
    for c in cases:
        if not CASES[c][0].startswith("decode"):
            continue
        outs = {n: results[n][c][0]["out"] for n in names}
        agree = [n for n in names[1:] if outs[n] == outs["engine"]]
        same.append(f"{c}: engine = {', '.join(agree) if agree else 'none'}")
    print("\ngreedy tokens identical — " + "; ".join(same))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "ops": ops}, indent=1, default=str))


if __name__ == "__main__":
    main()
