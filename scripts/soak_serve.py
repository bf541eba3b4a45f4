#!/usr/bin/env python3
"""Bounded soak of the served stack with faults (a benchmark, not a CI test).

Builds checkpoint -> embedded engine dir -> decoupled (streaming) repository from the trained
fixture in a temp dir and starts the CPU Triton server, then sends --requests requests from
--concurrency closed-loop gRPC clients, spread over `ensemble`, `tensorrt_llm_bls` and
`tensorrt_llm`. Of them, --bad are malformed (missing or out-of-range inputs, a prompt over the
input limit), --cancel are cancelled by the client after their first response (gRPC stream
cancel), --disconnect are sent by a client process that is SIGKILLed mid-stream; the rest are greedy
requests whose text must equal the reference text of their prompt. Once, halfway, the
tensorrt_llm backend stub process is SIGKILLed; the server's watchdog takes the server down (clients
in flight get an error) and the soak restarts it, as a supervisor restarts `trtmoe serve`.

Reported: how every request ended (final response / clean error / past its deadline = hung), by
kind; wrong greedy texts; resident memory (RSS) of tritonserver and every backend stub after
warm-up and at the end of each server lifetime; greedy outputs of a fixed prompt set before the
soak, after the restart and at the end (must be identical). With --cancel-rss N, also the
tritonserver RSS growth per cancelled request over N cancels through each entry point; with
--cancel-tokens N, the tokens generated for N cancelled 150-token streams per entry point. With
--oversized N, N HTTP generate requests with bodies of --oversized-mb MB or more (a prompt that
long, the same bytes in a field no model reads, a prompt that long to generate_stream, over the
ensemble and tensorrt_llm_bls in turn), after the soak: how each was answered, how long it took, and
how many times tritonserver crashed (the soak restarts it and goes on); any crash fails the run.

    python scripts/soak_serve.py                        # 5000 requests, concurrency 32
    python scripts/soak_serve.py --requests 600 --json soak.json
    python scripts/soak_serve.py --requests 0 --cancel-rss 200   # only the cancel-leak measurement
    python scripts/soak_serve.py --requests 200 --oversized 30    # plus 30 bodies of 4 MB and more

Exit code 0 when every request ended inside its deadline, every greedy text matched and the
before/after outputs are identical; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXTURE = ROOT / "tests" / "fixtures" / "trained_mixtral"
BUILD = {"max_batch_size": 16, "max_input_len": 64, "max_seq_len": 160, "max_beam_width": 1, "tokens_per_block": 32}
PROMPTS = ["def main(", "import os\n", "class Parser:\n    def __init__(self", "    return self.", "for i in range(",
           "x = [", "if __name__ ==", "try:\n    import"]
MODELS = ("ensemble", "tensorrt_llm_bls", "tensorrt_llm")


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def stack_rss(srv) -> dict[str, int]:
    """{process: RSS in KiB} of tritonserver and each backend stub."""
    from trtmoe.triton.serve import backend_stubs

    out = {"tritonserver": rss_kb(srv.process.pid) or 0}
    for pid, name in backend_stubs(srv.process.pid).items():
        out[name] = rss_kb(pid) or 0
    return out


def _tensor(name, arr, dtype):
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


class Soak:
    def __init__(self, args, srv, tok):
        self.args, self.srv, self.tok = args, srv, tok
        self.up = threading.Event()
        self.up.set()
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()  # (kind, outcome)
        self.latest: list[float] = []
        self.wrong: list[str] = []
        self.errors: Counter = Counter()
        self.hung: list[str] = []
        self.done = 0
        self.reference: dict[tuple[str, str], object] = {}  # (model, prompt) -> text, or token ids

    # -- one request -------------------------------------------------------------------------
    def inputs(self, model: str, prompt: str, n: int, *, bad: str | None = None) -> list:
        if model == "tensorrt_llm":
            ids = self.tok.encode(prompt)
            if bad == "too_long":
                ids = ids * (BUILD["max_input_len"] // max(len(ids), 1) + 2)
            ins = [_tensor("input_ids", np.array([ids], np.int32), "INT32"),
                   _tensor("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
                   _tensor("streaming", np.array([[True]]), "BOOL")]
            if bad != "missing":
                ins.append(_tensor("request_output_len", np.array([[-3 if bad == "negative" else n]], np.int32), "INT32"))
            return ins
        if bad == "too_long":
            prompt = prompt * 40
        ins = [_tensor("text_input", np.array([[prompt]], dtype=object), "BYTES"),
               _tensor("stream", np.array([[True]]), "BOOL")]
        if bad != "missing":
            ins.append(_tensor("max_tokens", np.array([[-3 if bad == "negative" else n]], np.int32), "INT32"))
        return ins

    def decode(self, model: str, res) -> tuple[str, list[int]]:
        if model == "tensorrt_llm":
            ids = res.as_numpy("output_ids")
            return "", ([] if ids is None else [int(x) for x in np.asarray(ids).reshape(-1)])
        out = res.as_numpy("text_output")
        if out is None:
            return "", []
        return "".join(x.decode() if isinstance(x, bytes) else str(x) for x in np.asarray(out).reshape(-1)), []

    def call(self, model: str, prompt: str, n: int, *, bad: str | None = None, cancel: bool = False):
        """('final' | 'error' | 'hung', text, token ids, error message)."""
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.srv.endpoints.grpc)
        q: queue.Queue = queue.Queue()
        text, ids = [], []
        try:
            client.start_stream(callback=lambda result, error: q.put((result, error)))
            client.async_stream_infer(model, self.inputs(model, prompt, n, bad=bad), enable_empty_final_response=True)
            deadline = time.monotonic() + self.args.deadline_s
            while True:
                try:
                    res, err = q.get(timeout=max(deadline - time.monotonic(), 0.01))
                except queue.Empty:
                    return "hung", "".join(text), ids, ""
                if err is not None:
                    return "error", "".join(text), ids, str(err)
                t, i = self.decode(model, res)
                text.append(t)
                ids += i
                if cancel:
                    client.stop_stream(cancel_requests=True)
                    return "final", "".join(text), ids, "cancelled by the client"
                if res.get_response().parameters["triton_final_response"].bool_param:
                    return "final", "".join(text), ids, ""
        except Exception as e:  # noqa: BLE001 - the server went away under us: a clean error
            return "error", "".join(text), ids, str(e)
        finally:
            try:  # cancel_requests: never wait here for a server that does not end the stream
                client.stop_stream(cancel_requests=True)
                client.close()
            except Exception:  # noqa: BLE001
                pass

    def disconnect(self, model: str, prompt: str) -> tuple[str, str]:
        """A client process that streams and is SIGKILLed after its first response."""
        code = f"""
import queue, sys, numpy as np, tritonclient.grpc as g
def t(n, a, d):
    x = g.InferInput(n, list(a.shape), d); x.set_data_from_numpy(a); return x
c = g.InferenceServerClient({self.srv.endpoints.grpc!r}); q = queue.Queue()
c.start_stream(callback=lambda result, error: q.put(error))
c.async_stream_infer("tensorrt_llm_bls" if {model!r} == "tensorrt_llm" else {model!r},
    [t("text_input", np.array([[{prompt!r}]], dtype=object), "BYTES"), t("max_tokens", np.array([[120]], np.int32), "INT32"),
     t("min_tokens", np.array([[120]], np.int32), "INT32"), t("stream", np.array([[True]]), "BOOL")])
e = q.get(timeout={self.args.deadline_s})
print("streaming" if e is None else "error", flush=True)
sys.stdin.read()
"""
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline().strip()
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            if line != "streaming":
                tail = proc.stderr.read().strip().splitlines()
                line = f"{line} {tail[-1] if tail else ''}"[:200]
        finally:
            if proc.poll() is None:
                proc.kill()
        return ("final" if line == "streaming" else "error"), line

    # -- workers -----------------------------------------------------------------------------
    def plan(self) -> list[tuple[str, str, str, str | None]]:
        """(kind, model, prompt, bad kind) for every request, shuffled with a fixed seed."""
        a = self.args
        rng = random.Random(a.seed)
        n_bad, n_cancel, n_disc = (round(a.requests * f) for f in (a.bad, a.cancel, a.disconnect))
        kinds = ["bad"] * n_bad + ["cancel"] * n_cancel + ["disconnect"] * n_disc
        kinds += ["greedy"] * (a.requests - len(kinds))
        rng.shuffle(kinds)
        bads = ["missing", "negative", "too_long"]
        return [(k, MODELS[i % len(MODELS)], PROMPTS[rng.randrange(len(PROMPTS))],
                 bads[(i // len(MODELS)) % len(bads)] if k == "bad" else None)  # every bad kind on every model
                for i, k in enumerate(kinds)]

    def run_one(self, item) -> None:
        kind, model, prompt, bad = item
        self.up.wait()
        t0 = time.monotonic()
        if kind == "disconnect":
            outcome, msg = self.disconnect(model, prompt)
            text, ids = "", []
        else:
            outcome, text, ids, msg = self.call(model, prompt, self.args.max_tokens, bad=bad, cancel=kind == "cancel")
        took = time.monotonic() - t0
        with self.lock:
            self.done += 1
            self.latest.append(took)
            self.outcomes[(kind, outcome)] += 1
            if outcome == "error":
                self.errors[(kind, msg[:90])] += 1
            if outcome == "hung":
                self.hung.append(f"{kind} {model} {prompt!r} {bad or ''} after {len(text)} chars / {len(ids)} ids")
            if kind == "bad" and outcome == "final":
                self.wrong.append(f"bad request ({bad}, {model}) got a successful response")
            if kind == "greedy" and outcome == "final":
                got = ids if model == "tensorrt_llm" else text
                want = self.reference[(model, prompt)]
                if got != want:
                    self.wrong.append(f"{model} {prompt!r}: {got!r} != {want!r}")

    def run(self, items, on_progress) -> None:
        it = iter(items)
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    item = next(it, None)
                if item is None:
                    return
                self.run_one(item)
                on_progress(self)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(self.args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def greedy_outputs(self) -> dict[tuple[str, str], object]:
        """Greedy output of every prompt through every entry point (text; token ids for tensorrt_llm)."""
        out = {}
        for model in MODELS:
            for p in PROMPTS:
                outcome, text, ids, msg = self.call(model, p, self.args.max_tokens)
                out[(model, p)] = (ids if model == "tensorrt_llm" else text) if outcome == "final" else f"<{outcome}: {msg}>"
        return out


def build(tmp: Path, templates: str | None):
    from trtmoe.checkpoint.writer import convert
    from trtmoe.triton.repository import generate_repository

    convert(FIXTURE, tmp / "ckpt", dtype="float32")
    (tmp / "engine").mkdir()
    (tmp / "engine" / "config.json").write_text(json.dumps({"backend": "embedded", "checkpoint": "../ckpt",
                                                           "build_config": BUILD}))
    return generate_repository(tmp / "engine", tmp / "repo", streaming=True, torch_num_threads=1,
                               templates=templates)


OVERSIZED_KINDS = ("prompt", "unread_field", "stream_prompt")


def oversized_bodies(srv, n: int, mb: float) -> dict:
    """``n`` HTTP generate requests of ``mb`` MB or more, one at a time: statuses, seconds, crashes."""
    import http.client

    size = int(mb * 2**20)
    statuses: Counter = Counter()
    crashes: list[str] = []
    seconds: list[float] = []
    for i in range(n):
        kind = OVERSIZED_KINDS[i % len(OVERSIZED_KINDS)]
        model = MODELS[(i // len(OVERSIZED_KINDS)) % 2]  # ensemble, tensorrt_llm_bls
        body = {"text_input": "def main(", "max_tokens": 1, "note": "x" * size} if kind == "unread_field" else \
            {"text_input": "def main(" + "x" * size, "max_tokens": 1}
        path = f"/v2/models/{model}/generate" + ("_stream" if kind == "stream_prompt" else "")
        data = json.dumps(body).encode()
        t0 = time.monotonic()
        try:
            c = http.client.HTTPConnection(srv.endpoints.host, srv.endpoints.http_port, timeout=300)
            c.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            outcome = str(r.status)
            c.close()
        except Exception as e:  # noqa: BLE001 - a dropped connection is what a crash looks like to a client
            outcome = type(e).__name__
        seconds.append(time.monotonic() - t0)
        statuses[f"{kind} -> {outcome}"] += 1
        time.sleep(0.5)  # the watchdog checks twice a second
        if srv.failure or not srv.is_alive():
            crashes.append(f"request {i} ({kind}, {len(data)} bytes): {srv.failure or srv.check()}")
            srv.join_watchdog(60)
            srv.restart(600)
    return {"requests": n, "body_bytes_min": size, "answers": dict(sorted(statuses.items())), "crashes": len(crashes),
            "crash_reasons": crashes[:10], "seconds_max": round(max(seconds or [0.0]), 2),
            "seconds_p50": round(sorted(seconds or [0.0])[len(seconds) // 2], 2)}


def cancel_rss(soak: Soak, n: int) -> dict:
    """tritonserver RSS growth per cancelled request, per entry point (after 20 warm-up cancels)."""
    out = {}
    for model in ("tensorrt_llm", "tensorrt_llm_bls", "ensemble"):
        for _ in range(20):
            soak.call(model, PROMPTS[0], 120, cancel=True)
        time.sleep(2.0)
        before = rss_kb(soak.srv.process.pid)
        t0 = time.monotonic()
        for _ in range(n):
            soak.call(model, PROMPTS[0], 120, cancel=True)
        time.sleep(5.0)  # let cancelled generations that did not stop finish
        after = rss_kb(soak.srv.process.pid)
        if before is None or after is None:
            print(f"cancel RSS {model}: the server is not running ({soak.srv.failure})", flush=True)
            break
        out[model] = {"cancels": n, "rss_before_kb": before, "rss_after_kb": after,
                      "growth_per_cancel_kb": round((after - before) / n, 2), "seconds": round(time.monotonic() - t0, 1)}
        print(f"cancel RSS {model:17s}: {before} -> {after} KiB over {n} cancels "
              f"= {out[model]['growth_per_cancel_kb']:+.2f} KiB/cancel", flush=True)
    return out


def _idle_tokens(srv, timeout: float = 60.0) -> float:
    from trtmoe.triton.metrics import tokens_when_idle

    return tokens_when_idle(srv.endpoints.metrics, timeout)


def cancel_tokens(soak: Soak, trials: int, n: int = 150) -> dict:
    """Tokens the engine generates for an n-token stream (min_tokens n) cancelled after its 2nd
    response, per entry point: the tokens already sent and the engine-to-client lag included."""
    out = {}
    for model in ("tensorrt_llm", "tensorrt_llm_bls", "ensemble"):
        counts = []
        for _ in range(trials):
            import tritonclient.grpc as grpcclient

            before = _idle_tokens(soak.srv)
            ins = soak.inputs(model, PROMPTS[0], n)
            ins.append(_tensor("min_tokens", np.array([[n]], np.int32), "INT32"))
            client = grpcclient.InferenceServerClient(soak.srv.endpoints.grpc)
            q: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: q.put(error))
            client.async_stream_infer(model, ins)
            for _ in range(2):
                q.get(timeout=soak.args.deadline_s)
            client.stop_stream(cancel_requests=True)
            client.close()
            counts.append(int(_idle_tokens(soak.srv) - before))
        counts.sort()
        out[model] = {"of": n, "median": counts[len(counts) // 2], "max": counts[-1], "all": counts}
        print(f"cancel tokens {model:17s}: median {out[model]['median']}, max {out[model]['max']} of {n}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--bad", type=float, default=0.05)
    ap.add_argument("--cancel", type=float, default=0.05)
    ap.add_argument("--disconnect", type=float, default=0.01)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=120.0, help="per request")
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of requests done when the stub is killed "
                                                                "(negative: no kill)")
    ap.add_argument("--warmup", type=float, default=0.1, help="fraction of requests before the first RSS sample")
    ap.add_argument("--cancel-rss", type=int, default=0, help="also measure RSS growth over this many cancels")
    ap.add_argument("--cancel-tokens", type=int, default=0,
                    help="also count the tokens generated for this many cancelled 150-token streams per entry point")
    ap.add_argument("--oversized", type=int, default=0,
                    help="also send this many HTTP generate requests with oversized bodies (see above)")
    ap.add_argument("--oversized-mb", type=float, default=4.0, help="their body size in MiB (at least)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--templates", default=None, help="model_repo templates (default: the project's)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--log-file", default=None, help="keep the tritonserver log here")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from trtmoe.triton.serve import serve_repository, shm_regions

    with tempfile.TemporaryDirectory(prefix="trtmoe-soak-") as tmp:
        repo = build(Path(tmp), args.templates)
        tok = AutoTokenizer.from_pretrained(str(repo.tokenizer_dir))
        t_start = time.monotonic()
        srv = serve_repository(repo.path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=600,
                               log_file=args.log_file)
        report: dict = {"args": vars(args)}
        ok = True
        try:
            soak = Soak(args, srv, tok)
            soak.reference = before = soak.greedy_outputs()
            bls_vs_ensemble = all(before[("ensemble", p)] == before[("tensorrt_llm_bls", p)] for p in PROMPTS)
            print(f"server ready, references taken in {time.monotonic() - t_start:.0f} s", flush=True)
            items = soak.plan()
            samples: dict[str, dict] = {}
            state = {"killed": False, "kill_s": None, "restart_s": None, "after_restart": None}
            kill_at = int(args.requests * args.kill_at) if args.kill_at >= 0 else -1
            warm = max(int(args.requests * args.warmup), 1)
            rewarm = kill_at + warm if kill_at >= 0 else -1
            progress_lock = threading.Lock()

            def on_progress(s: Soak):
                with progress_lock:
                    # Workers count their request outside this lock, so `done` may have moved past a
                    # milestone before its call gets here: compare a snapshot with >=, never ==.
                    done = s.done
                    if srv.failure and not state["killed"] and "unplanned" not in state:
                        state["unplanned"] = srv.failure
                        print(f"  UNPLANNED server failure after {done} requests: {srv.failure}\n{srv.log_tail()}",
                              flush=True)
                    if done >= warm and "warm" not in samples:
                        samples["warm"] = stack_rss(srv)
                    if state["killed"] and done >= rewarm and "rewarm" not in samples:
                        samples["rewarm"] = stack_rss(srv)
                    step = max(args.requests // 10, 1)
                    if done // step > state.get("printed", 0) // step:
                        state["printed"] = done
                        print(f"  {done}/{args.requests} requests, {dict(s.outcomes)}", flush=True)
                    if 0 <= kill_at <= done and not state["killed"]:
                        samples["before_kill"] = stack_rss(srv)
                        state["killed"] = True
                        stub = next(pid for pid, name in srv.stubs.items() if name == "tensorrt_llm_0_0")
                        s.up.clear()  # new requests wait for the restart; those in flight meet the kill
                        t0 = time.monotonic()
                        os.kill(stub, signal.SIGKILL)
                        srv.join_watchdog(60)
                        state["kill_s"] = round(time.monotonic() - t0, 2)
                        state["failure"] = srv.failure
                        state["shm_left_after_kill"] = len(shm_regions(srv.shm_prefix))
                        t1 = time.monotonic()
                        srv.restart(600)
                        state["restart_s"] = round(time.monotonic() - t1, 1)
                        state["after_restart"] = s.greedy_outputs()
                        s.up.set()
                        print(f"  backend killed: server down in {state['kill_s']} s ({state['failure']}), "
                              f"restarted in {state['restart_s']} s", flush=True)

            t0 = time.monotonic()
            if args.requests:
                soak.run(items, on_progress)
            soak_s = time.monotonic() - t0
            samples["end"] = stack_rss(srv)
            after = soak.greedy_outputs()
            if args.cancel_tokens:
                report["cancel_tokens"] = cancel_tokens(soak, args.cancel_tokens)
            if args.cancel_rss:
                report["cancel_rss"] = cancel_rss(soak, args.cancel_rss)
            if args.oversized:
                report["oversized"] = oversized_bodies(srv, args.oversized, args.oversized_mb)
                print(f"oversized bodies: {report['oversized']}", flush=True)
                after = soak.greedy_outputs()  # the server (restarted or not) still answers the same
        finally:
            srv.stop()
        shm_left = len(shm_regions(srv.shm_prefix))

    by_kind: dict[str, dict[str, int]] = {}
    for (kind, outcome), n in sorted(soak.outcomes.items()):
        by_kind.setdefault(kind, {})[outcome] = n
    hung = sum(n for (k, o), n in soak.outcomes.items() if o == "hung")
    same = before == after and (state["after_restart"] is None or state["after_restart"] == before)
    report["greedy_outputs_compared"] = len(before)
    lat = sorted(soak.latest) or [0.0]
    restart_outputs = state.pop("after_restart")
    report.update(requests=soak.done, seconds=round(soak_s, 1), outcomes=by_kind, hung=hung,
                  errors={f"{k}: {m}": n for (k, m), n in soak.errors.most_common()},
                  wrong=soak.wrong[:20], wrong_count=len(soak.wrong), hung_requests=soak.hung[:20], kill=state, rss_kb=samples,
                  greedy_identical_before_after=same, request_seconds_p50=round(lat[len(lat) // 2], 2),
                  request_seconds_max=round(lat[-1], 2), shm_left_at_end=shm_left)
    planned_kill = args.requests > 0 and args.kill_at >= 0
    if planned_kill and not state["killed"]:
        print("the planned backend kill did not happen", flush=True)
    ok = hung == 0 and not soak.wrong and same and shm_left == 0 and (state["killed"] or not planned_kill) \
        and report.get("oversized", {}).get("crashes", 0) == 0
    report["ensemble_text_equals_bls_text"] = bls_vs_ensemble
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, indent=1, default=str))
    if not same:
        for key in before:
            if after.get(key) != before[key] or (restart_outputs or before).get(key) != before[key]:
                print("differs:", key, before[key], (restart_outputs or {}).get(key), after.get(key))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
