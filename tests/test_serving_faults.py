"""Serving faults through a real tritonserver (nvidia-pytriton's Triton 2.51, CPU, Python backend):
cancelled streams stop generating wherever they entered (tensorrt_llm, tensorrt_llm_bls, ensemble),
and a dead backend stub process turns into an error for its clients, a server that stops
answering and no shared memory left behind; `trtmoe serve --restart N` brings it back N times,
then exits non-zero.

The repository is generated decoupled (streaming) explicitly; the tests do not depend on the
repository's defaults."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import require, require_fixture, start_serve_command, wait_until

require("tritonclient.grpc")
require("pytriton")

import tritonclient.grpc as grpcclient  # noqa: E402

from trtmoe.checkpoint.writer import convert  # noqa: E402
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams  # noqa: E402
from trtmoe.triton.batcher import FINISH_CANCELLED, InflightBatcher  # noqa: E402
from trtmoe.triton.metrics import engine_activity, scrape, tokens_when_idle  # noqa: E402
from trtmoe.triton.repository import generate_repository  # noqa: E402
from trtmoe.errors import TrtmoeError  # noqa: E402
from trtmoe.triton.serve import (STUB_NAME, Endpoints, RestartBudget, TritonServer, backend_stubs,  # noqa: E402
                                 free_port, run_until_signalled, serve_repository, shm_regions)

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "trained_mixtral"
BUILD = {"max_batch_size": 16, "max_input_len": 64, "max_seq_len": 512, "max_beam_width": 1, "tokens_per_block": 32}
# Tokens asked for (min_tokens too, so no end token cuts it short): as many as the context allows, so
# that a cancel landing late on a loaded machine still leaves most of them ungenerated. A cancelled
# request must stop before 3/4 of them.
LONG = 500
# The served model: a tiny random Mixtral DEEP layers deep with the trained fixture's tokenizer. The
# fixture itself (4 layers) generated all LONG tokens in 0.3 s on a fast machine, before these tests'
# cancels landed; at 64 layers a token costs 16x the per-layer work (6.7 ms in-process on that
# machine), so a generation lasts seconds on any machine and its cancel lands inside it.
DEEP = 64

require_fixture(FIXTURE)


@pytest.fixture(scope="module")
def built(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model = Path(shutil.copytree(tiny_model("mixtral", vocab_size=2048, num_hidden_layers=DEEP), root / "model"))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(FIXTURE / f, model / f)
    convert(model, root / "ckpt", dtype="float32")
    engine = root / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"backend": "embedded", "checkpoint": "../ckpt", "build_config": BUILD}))
    repo = generate_repository(engine, root / "repo", streaming=True, torch_num_threads=1)
    return {"root": root, "ckpt": root / "ckpt", "repo": repo}


@pytest.fixture(scope="module")
def served(built):
    server = serve_repository(built["repo"].path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=240)
    try:
        yield server
    finally:
        server.stop()


def _tensor(name, arr, dtype):
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def _inputs(model: str, n: int = LONG) -> list:
    if model == "tensorrt_llm":
        return [_tensor("input_ids", np.array([[1, 5, 9, 12]], np.int32), "INT32"),
                _tensor("input_lengths", np.array([[4]], np.int32), "INT32"),
                _tensor("request_output_len", np.array([[n]], np.int32), "INT32"),
                _tensor("min_tokens", np.array([[n]], np.int32), "INT32"),
                _tensor("streaming", np.array([[True]]), "BOOL")]
    return [_tensor("text_input", np.array([["def main("]], dtype=object), "BYTES"),
            _tensor("max_tokens", np.array([[n]], np.int32), "INT32"),
            _tensor("min_tokens", np.array([[n]], np.int32), "INT32"),
            _tensor("stream", np.array([[True]]), "BOOL")]


def _wait_idle(server, timeout: float = 30.0) -> float:
    """Tokens generated so far, once no request is in the batch."""
    return tokens_when_idle(server.endpoints.metrics, timeout)


# -- the batcher: is_cancelled is polled by a watcher, not on the decode thread ---------------------

def test_batcher_polls_cancellation_off_the_decode_thread(built):
    import torch

    torch.set_num_threads(1)
    engine = EmbeddedEngine.from_checkpoint(built["ckpt"], device="cpu", max_seq_len=BUILD["max_seq_len"])
    b = InflightBatcher(engine, max_batch_size=2, prefill_budget_s=0.0)
    calls: list[str] = []
    done = threading.Event()
    events = []

    def is_cancelled() -> bool:
        calls.append(threading.current_thread().name)
        return len(calls) >= 3

    def cb(ev):
        events.append(ev)
        if ev.finished:
            done.set()

    try:
        b.submit([1, 5, 9], SamplingParams(max_new_tokens=LONG, min_tokens=LONG), cb, is_cancelled=is_cancelled)
        assert done.wait(30)
    finally:
        b.shutdown()
    assert events[-1].finish_reason == FINISH_CANCELLED
    assert sum(len(e.new_tokens) for e in events) < LONG
    assert calls and b._thread.name not in calls  # never an IPC call on the decode thread


# -- cancellation through every entry point -----------------------------------------------------

@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_bls", "ensemble"])
def test_cancelled_stream_frees_its_slot(served, model):
    """gRPC stream cancel after two responses: the generation ends far before its 150 tokens and
    the batch slot is free again within seconds; the next request is served. Through the ensemble,
    postprocessing sees the cancellation on the next streamed response and stops tensorrt_llm."""
    before = _wait_idle(served)
    client = grpcclient.InferenceServerClient(served.endpoints.grpc)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer(model, _inputs(model))
    for _ in range(2):
        assert q.get(timeout=60)[1] is None
    client.stop_stream(cancel_requests=True)
    client.close()
    generated = _wait_idle(served, timeout=10) - before
    assert 2 <= generated < LONG * 3 // 4, generated
    _assert_serves(served, model)


def _llm_metric(server, name: str, **labels) -> float:
    want = {"model": "tensorrt_llm", **labels}
    return sum(v for got, v in scrape(server.endpoints.metrics).get(name, [])
               if all(dict(got).get(k) == x for k, x in want.items()))


def _stream(url: str):
    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    return client, q


def test_cancel_frees_the_slot_with_the_queue_full(built, tmp_path):
    """One batch slot and one place in the queue (max_batch_size 1, max_queue_size 1): a stream
    through the ensemble or BLS holds the slot, a request to tensorrt_llm waits and a third is
    refused. Cancelling the stream still ends it and the waiting request gets the slot; the cancel
    reached the engine over its cancel socket, not as a request in tensorrt_llm's queue (Triton
    counted no request there beyond the three)."""
    repo = generate_repository(built["root"] / "engine", tmp_path / "repo", streaming=True, torch_num_threads=1,
                               max_batch_size=1, max_queue_size=1)
    server = serve_repository(repo.path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=240)
    counted = ("nv_inference_request_success", "nv_inference_request_failure")
    try:
        for model in ("ensemble", "tensorrt_llm_bls"):
            before = _wait_idle(server)
            requests = sum(_llm_metric(server, m) for m in counted)
            holder, held = _stream(server.endpoints.grpc)
            holder.async_stream_infer(model, _inputs(model) + [
                _tensor("return_num_output_tokens", np.array([[True]]), "BOOL")])
            for _ in range(2):
                assert held.get(timeout=60)[1] is None
            waiter, waits = _stream(server.endpoints.grpc)
            waiter.async_stream_infer("tensorrt_llm", _inputs("tensorrt_llm", 4), enable_empty_final_response=True)
            deadline = time.monotonic() + 60
            while _llm_metric(server, "trtmoe_batcher_requests", state="waiting") < 1:  # refreshed every 0.5 s
                assert time.monotonic() < deadline, "the second request never waited"
                time.sleep(0.1)
            refused, refusals = _stream(server.endpoints.grpc)
            refused.async_stream_infer("tensorrt_llm", _inputs("tensorrt_llm", 4))
            err = refusals.get(timeout=60)[1]
            assert err is not None and "waiting" in str(err), err
            # What the holder had received when it cancelled: the setup above takes a metrics refresh
            # or two (0.5 s each), so the holder's own progress before the cancel varies a lot.
            received = 0
            while not held.empty():
                res, err = held.get()
                n_out = res.as_numpy("num_output_tokens") if err is None else None
                received = max(received, int(n_out.reshape(-1)[0])) if n_out is not None else received
            holder.stop_stream(cancel_requests=True)
            tokens = 0
            while True:
                res, err = waits.get(timeout=60)  # the slot is freed: the waiting request runs
                assert err is None, err
                tokens += int(np.asarray(res.as_numpy("sequence_length") if res.as_numpy("output_ids") is not None
                                         else [0]).sum())
                if res.get_response().parameters["triton_final_response"].bool_param:
                    break
            assert tokens == 4
            generated = _wait_idle(server, timeout=30) - before
            # The holder stopped soon after its cancel, far before its LONG tokens.
            assert received >= 2 and 4 + received <= generated < 4 + LONG, (model, received, generated)
            assert generated - 4 - received < LONG // 4, (model, received, generated)
            assert sum(_llm_metric(server, m) for m in counted) - requests == 3, model
            for c in (holder, waiter, refused):
                c.stop_stream()
                c.close()
        _assert_serves(server, "ensemble")
    finally:
        server.stop()


def _client_script(url: str, model: str) -> str:
    """A client that streams a long request, says so after two responses and waits to be killed."""
    return f"""
import os, queue, sys, numpy as np, tritonclient.grpc as g
def t(n, a, d):
    x = g.InferInput(n, list(a.shape), d); x.set_data_from_numpy(a); return x
c = g.InferenceServerClient({url!r}); q = queue.Queue()
c.start_stream(callback=lambda result, error: q.put(error))
model = {model!r}
if model == "tensorrt_llm":
    ins = [t("input_ids", np.array([[1, 5, 9, 12]], np.int32), "INT32"), t("input_lengths", np.array([[4]], np.int32), "INT32"),
           t("request_output_len", np.array([[{LONG}]], np.int32), "INT32"), t("min_tokens", np.array([[{LONG}]], np.int32), "INT32"),
           t("streaming", np.array([[True]]), "BOOL")]
else:
    ins = [t("text_input", np.array([["def main("]], dtype=object), "BYTES"), t("max_tokens", np.array([[{LONG}]], np.int32), "INT32"),
           t("min_tokens", np.array([[{LONG}]], np.int32), "INT32"), t("stream", np.array([[True]]), "BOOL")]
c.async_stream_infer(model, ins)
for _ in range(2):
    try:
        err = q.get(timeout=60)
    except queue.Empty:
        err = "no response in 60 s"
    if err is not None:  # say why and leave at once (the stream's threads would keep the process alive)
        print("error", err, flush=True)
        os._exit(1)
print("streaming", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_bls", "ensemble"])
def test_killed_client_stops_generation(served, model):
    """A client process SIGKILLed mid-stream (its connection dropped, no cancel sent)."""
    before = _wait_idle(served)
    proc = subprocess.Popen([sys.executable, "-c", _client_script(served.endpoints.grpc, model)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "streaming"
        proc.kill()
        proc.wait(10)
        generated = _wait_idle(served, timeout=10) - before
    finally:
        if proc.poll() is None:
            proc.kill()
    assert 2 <= generated < LONG * 3 // 4, generated
    _assert_serves(served, model)


@pytest.mark.parametrize("model", ["tensorrt_llm_bls", "ensemble"])
def test_dropped_sse_connection_stops_generation(served, model):
    """HTTP generate_stream; the socket is reset after the first event."""
    import socket
    import struct

    before = _wait_idle(served)
    body = json.dumps({"text_input": "def main(", "max_tokens": LONG, "min_tokens": LONG, "stream": True}).encode()
    sock = socket.create_connection((served.endpoints.host, served.endpoints.http_port), timeout=60)
    try:
        sock.sendall(b"POST /v2/models/%s/generate_stream HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (model.encode(), len(body), body))
        seen = b""
        while b"data:" not in seen:
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
        assert b" 200 " in seen.split(b"\r\n", 1)[0], seen
    finally:  # SO_LINGER 0: close() resets the connection, as a killed client's kernel does
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    generated = _wait_idle(served, timeout=10) - before
    assert 1 <= generated < LONG * 3 // 4, generated
    _assert_serves(served, model)


def test_unary_cancel_in_a_non_decoupled_repository(built, tmp_path):
    """Upstream's default repository (not decoupled): a unary gRPC request cancelled by the client
    once it has generated tokens stops generating, sent to tensorrt_llm or to tensorrt_llm_bls."""
    repo = generate_repository(built["root"] / "engine", tmp_path / "repo", streaming=False, torch_num_threads=1)
    server = serve_repository(repo.path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=240)
    try:
        for model in ("tensorrt_llm", "tensorrt_llm_bls"):
            before = _wait_idle(server)
            inputs = [t for t in _inputs(model, LONG) if t.name() not in ("stream", "streaming")]
            client = grpcclient.InferenceServerClient(server.endpoints.grpc)
            q: queue.Queue = queue.Queue()
            ctx = client.async_infer(model, inputs, callback=lambda result, error: q.put(error))
            wait_until(lambda: engine_activity(server.endpoints.metrics)[0] > before, 60,
                       f"the first tokens of the request to {model}")  # published every 0.5 s
            ctx.cancel()
            assert "CANCELLED" in str(q.get(timeout=60))
            generated = _wait_idle(server, timeout=10) - before
            assert 1 <= generated < LONG * 3 // 4, (model, generated)
            client.close()
    finally:
        server.stop()


def _generate_text(url: str, model: str, prompt: str, n: int) -> str:
    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    ins = [_tensor("text_input", np.array([[prompt]], dtype=object), "BYTES"),
           _tensor("max_tokens", np.array([[n]], np.int32), "INT32"),
           _tensor("stream", np.array([[True]]), "BOOL")]
    pieces = []
    try:
        client.async_stream_infer(model, ins, enable_empty_final_response=True)
        while True:
            res, err = q.get(timeout=60)
            if err is not None:
                raise err
            out = res.as_numpy("text_output")
            if out is not None:
                pieces += [x.decode() if isinstance(x, bytes) else str(x) for x in np.asarray(out).reshape(-1)]
            if res.get_response().parameters["triton_final_response"].bool_param:
                return "".join(pieces)
    finally:
        client.stop_stream()
        client.close()


def _assert_serves(server, model: str):
    assert server.is_ready()
    if model == "tensorrt_llm":
        model = "tensorrt_llm_bls"
    assert _generate_text(server.endpoints.grpc, model, "def main(", 4)


# -- a dead backend stub ------------------------------------------------------------------------

def test_dead_backend_stub_fails_clients_and_stops_the_server(built, tmp_path):
    """SIGKILL the tensorrt_llm stub with a stream in flight: the client gets an error within
    seconds, health stops answering 200, the group is gone, no /dev/shm region of the server is
    left; restart() serves the same greedy text again."""
    server = serve_repository(built["repo"].path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=240)
    try:
        want = _generate_text(server.endpoints.grpc, "tensorrt_llm_bls", "def main(", 12)
        assert shm_regions(server.shm_prefix)
        client = grpcclient.InferenceServerClient(server.endpoints.grpc)
        q: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((time.monotonic(), error)))
        client.async_stream_infer("tensorrt_llm_bls", _inputs("tensorrt_llm_bls"))
        assert q.get(timeout=60)[1] is None
        names = sorted(server.stubs.values())
        assert "tensorrt_llm_0_0" in names and "tensorrt_llm_bls_0_0" in names
        stub = next(pid for pid, name in server.stubs.items() if name == "tensorrt_llm_0_0")
        killed = time.monotonic()
        os.kill(stub, signal.SIGKILL)
        while True:
            at, err = q.get(timeout=30)  # a hang fails here
            if err is not None:
                break
        assert at - killed < 10
        server.join_watchdog(30)
        assert "tensorrt_llm_0_0" in server.failure and "died" in server.failure
        assert not server.is_alive() and not server.is_ready()
        assert backend_stubs(server.process.pid) == {}
        assert shm_regions(server.shm_prefix) == []
        client.stop_stream()
        client.close()
        server.restart(240)
        assert server.failure is None and sorted(server.stubs.values()) == names
        assert _generate_text(server.endpoints.grpc, "tensorrt_llm_bls", "def main(", 12) == want
    finally:
        server.stop()
    assert shm_regions(server.shm_prefix) == []


def _server_of(proc) -> tuple[int, str]:
    """(pid, shm prefix) of the tritonserver a `trtmoe serve` process runs now."""
    pid = next(int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid), "tritonserver"],
                                              capture_output=True, text=True).stdout.split())
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        prefix = f.read().decode().split("shm-region-prefix-name=")[1].split("\0")[0].split(",")[0]
    return pid, prefix


def _kill_engine_stub(server_pid: int) -> None:
    stubs = backend_stubs(server_pid)
    os.kill(next(pid for pid, name in stubs.items() if name.startswith("tensorrt_llm_0")), signal.SIGKILL)


def _fake_server(tmp_path, with_stub: bool, stubs: tuple[str, ...] = ("tensorrt_llm_0_0",)) -> "TritonServer":
    """A process group shaped like tritonserver's: a leader and (``with_stub``) children whose
    argv looks like a Python-backend stub's (``<stub> ... <instance name> <device kind>``)."""
    stub = "".join(f"(exec -a /opt/{STUB_NAME} {sys.executable} -c 'import time; time.sleep(60)' "
                   f"{name} CPU) & " for name in stubs) if with_stub else ""
    srv = TritonServer(repo=tmp_path, endpoints=Endpoints("127.0.0.1", 1, 2, 3), install=None,
                       command=["bash", "-c", stub + "sleep 60 & wait"], env=dict(os.environ),
                       log_path=tmp_path / "log.txt", workspace=tmp_path, keep_workspace=True, watch_period_s=0.05)
    srv.start()
    deadline = time.monotonic() + 10
    while with_stub and len(backend_stubs(srv.process.pid)) < len(stubs) and time.monotonic() < deadline:
        time.sleep(0.02)
    return srv


def test_watchdog_ends_the_other_stubs_when_the_server_aborted_itself(tmp_path):
    """Triton 2.51 can abort itself when a stub dies mid-request; the stubs of the other models
    outlive it in its group. The watchdog must end those too, not only a server that still runs."""
    srv = _fake_server(tmp_path, with_stub=True, stubs=("tensorrt_llm_0_0", "preprocessing_0_0"))
    srv.watch_period_s = 1.0  # both deaths land before the first look
    try:
        srv.start_watchdog()
        assert sorted(srv.stubs.values()) == ["preprocessing_0_0", "tensorrt_llm_0_0"]
        engine = next(pid for pid, name in srv.stubs.items() if name == "tensorrt_llm_0_0")
        os.kill(srv.process.pid, signal.SIGKILL)
        srv.process.wait(10)
        os.kill(engine, signal.SIGKILL)
        srv.join_watchdog(20)
        assert "tritonserver exited" in srv.failure  # the stub's death too, unless the watchdog looked in between
        assert backend_stubs(srv.process.pid) == {}
    finally:
        srv.stop(grace_s=1)


def test_watchdog_sees_a_stub_that_died_before_a_restart_was_watched(tmp_path):
    """The watchdog records the stubs when the server gets ready; a restarted server must show the
    same stub names, so one killed between readiness and that record still fails the server (the
    race a fast client can win), and the watchdog of the first start does not outlive it."""
    srv = _fake_server(tmp_path, with_stub=True)
    try:
        srv.start_watchdog()
        assert set(srv.stubs.values()) == {"tensorrt_llm_0_0"} and srv.check() is None
        first = srv._watchdog
        os.kill(next(iter(srv.stubs)), signal.SIGKILL)
        srv.join_watchdog(20)
        assert not first.is_alive() and "tensorrt_llm_0_0 (pid" in srv.failure
        assert srv.process.poll() is not None  # the group was ended
        srv.command = ["bash", "-c", "sleep 60 & wait"]  # restarted, but its stub is already gone
        srv.start(append_log=True)
        srv.start_watchdog()
        assert srv._watchdog is not first
        srv.join_watchdog(20)
        assert srv.failure == "Python backend stub process died: tensorrt_llm_0_0 (gone before it was watched)"
        assert srv.process.poll() is not None
    finally:
        srv.stop(grace_s=1)


def test_restart_budget_counts_restarts_within_its_window():
    now = [0.0]
    b = RestartBudget(2, 100, clock=lambda: now[0])
    assert b.allows() and b.record() == 1
    now[0] = 50
    assert b.allows() and b.record() == 2
    now[0] = 99
    assert not b.allows() and b.describe() == "restarted 2 time(s) in the last 100 s (limit 2)"
    now[0] = 100.5  # the first restart has left the window
    assert b.allows() and b.record() == 2
    assert not b.allows() and b.describe() == "restarted 2 time(s) in the last 100 s (limit 2, 3 in all)"
    whole = RestartBudget(1, 0, clock=lambda: now[0])
    whole.record()
    now[0] = 1e9
    assert not whole.allows() and whole.describe() == "restarted 1 time(s) in this run (limit 1)"
    assert not RestartBudget(0).allows()


_FAKE_TRITON = f"""
import http.server, subprocess, sys
# A Python-backend stub's argv: <stub> ... <instance name> <device kind>
subprocess.Popen(["/opt/{STUB_NAME}", "-c", "import time; time.sleep(600)", "tensorrt_llm_0_0", "CPU"],
                 executable=sys.executable)
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready).serve_forever()
"""


@pytest.mark.parametrize("window_s", [60, 0])
def test_serve_loop_restarts_within_its_window(tmp_path, window_s):
    """run_until_signalled with --restart 1 on a process group shaped like tritonserver's (a leader
    answering /v2/health/ready and one backend stub), on a clock the test moves: the stub is
    killed at once after every (re)start. With a 60 s window the first restart has left it when
    the clock is 61 s on, so a second restart is made; the third death, inside the window, ends the
    loop with the count and the window. Over the whole run (0) the second death ends it."""
    port = free_port()
    srv = TritonServer(repo=tmp_path, endpoints=Endpoints("127.0.0.1", port, 2, 3), install=None,
                       command=[sys.executable, "-c", _FAKE_TRITON, str(port)], env=dict(os.environ),
                       log_path=tmp_path / "log.txt", workspace=tmp_path, keep_workspace=True, watch_period_s=0.05)
    now = [1000.0]
    events: list = []

    def kill_stub(s):
        assert list(s.stubs.values()) == ["tensorrt_llm_0_0"]
        os.kill(next(iter(s.stubs)), signal.SIGKILL)

    def ready(s):
        events.append("ready")
        kill_stub(s)

    def restarting(s, reason, n):
        events.append(("restart", n, reason.split(" (pid")[0]))

    def restarted(s, n):
        events.append(("restarted", n))
        if events.count(("restarted", 1)) == 1:
            now[0] += 61  # the first restart leaves a 60 s window
        kill_stub(s)

    srv.start().wait_ready(60)
    with pytest.raises(TrtmoeError) as e:
        run_until_signalled(srv, ready, restarts=1, restart_window_s=window_s, timeout_s=60, on_restart=restarting,
                            on_restarted=restarted, clock=lambda: now[0])
    died = "Python backend stub process died: tensorrt_llm_0_0"
    one = [("restart", 1, died), ("restarted", 1)]
    assert events == ["ready"] + one * (2 if window_s else 1)
    expect = ("restarted 1 time(s) in the last 60 s (limit 1, 2 in all)" if window_s
              else "restarted 1 time(s) in this run (limit 1)")
    assert str(e.value).startswith(f"{died} (pid ") and f"; {expect}; tritonserver was stopped" in str(e.value)
    assert srv.process.poll() is not None and backend_stubs(srv.process.pid) == {}


def test_a_spent_restart_budget_backs_off_instead_of_ending_the_service(tmp_path):
    """With a back-off, deaths past the budget (here 1 restart within 60 s) are restarted after a
    wait that doubles up to its cap, never ending the loop: five deaths in a row, five restarts
    (the last four after a back-off each), and the loop still ends only on SIGTERM, with exit 0."""
    port = free_port()
    srv = TritonServer(repo=tmp_path, endpoints=Endpoints("127.0.0.1", port, 2, 3), install=None,
                       command=[sys.executable, "-c", _FAKE_TRITON, str(port)], env=dict(os.environ),
                       log_path=tmp_path / "log.txt", workspace=tmp_path, keep_workspace=True, watch_period_s=0.05)
    events: list = []

    def kill_stub(s):
        os.kill(next(iter(s.stubs)), signal.SIGKILL)

    def restarted(s, n):
        events.append(("restarted", n))
        if n < 5:
            kill_stub(s)
        else:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()

    srv.start().wait_ready(60)
    rc = run_until_signalled(srv, kill_stub, restarts=1, restart_window_s=60, timeout_s=60,
                             on_restarted=restarted, backoff_max_s=0.25,
                             on_backoff=lambda s, reason, why, wait_s: events.append(("backoff", wait_s, why)))
    assert rc == 0
    backoffs = [e for e in events if e[0] == "backoff"]
    assert [e for e in events if e[0] == "restarted"] == [("restarted", n) for n in range(1, 6)]
    assert [b[1] for b in backoffs] == [0.25] * 4  # min(cap, 1 s, 2 s, ...)
    assert backoffs[0][2] == "restarted 1 time(s) in the last 60 s (limit 1)"
    assert srv.process.poll() is not None and backend_stubs(srv.process.pid) == {}


# The same group, except that once MARKER exists (the first start makes it) the leader never answers
# ready: a restart that hangs in model loading.
_FAKE_TRITON_HANGS_ON_RESTART = _FAKE_TRITON.replace(
    "http.server.HTTPServer(", "import os, time\nif os.path.exists(sys.argv[2]): time.sleep(600)\n"
    "open(sys.argv[2], 'w').close()\nhttp.server.HTTPServer(")


def test_a_signal_during_a_restart_ends_the_serve_loop_at_once(tmp_path):
    """SIGTERM while a restarted server is still loading (here: never gets ready) ends
    run_until_signalled within a second or two with exit 0 and the group stopped, instead of after
    the restart's readiness timeout."""
    port = free_port()
    marker = tmp_path / "started-once"
    srv = TritonServer(repo=tmp_path, endpoints=Endpoints("127.0.0.1", port, 2, 3), install=None,
                       command=[sys.executable, "-c", _FAKE_TRITON_HANGS_ON_RESTART, str(port), str(marker)],
                       env=dict(os.environ), log_path=tmp_path / "log.txt", workspace=tmp_path, keep_workspace=True,
                       watch_period_s=0.05)
    events: list = []

    def ready(s):
        os.kill(next(iter(s.stubs)), signal.SIGKILL)

    def restarting(s, reason, n):
        events.append("restart")
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()

    srv.start().wait_ready(60)
    t0 = time.monotonic()
    rc = run_until_signalled(srv, ready, restarts=1, timeout_s=120, on_restart=restarting,
                             on_restarted=lambda s, n: events.append("restarted"))
    assert rc == 0 and events == ["restart"] and marker.exists()
    assert time.monotonic() - t0 < 30  # not the 120 s readiness timeout
    assert srv.process.poll() is not None and backend_stubs(srv.process.pid) == {}


@pytest.mark.slow
def test_serve_command_restarts_once_then_exits_nonzero(built, tmp_path):
    """`trtmoe serve --restart 1`: the first SIGKILLed engine stub brings the server back on the same
    ports (one line says so), serving the same greedy text, with the dead server's group and shared
    memory gone; the second death exhausts the budget: exit 1 naming the dead stub, nothing left."""
    proc, ready = start_serve_command(built["repo"].path, tmp_path / "server.log", extra_args=("--restart", "1", "--restart-backoff", "0"))
    url = ready.split("gRPC ")[1].split()[0]
    try:
        want = _generate_text(url, "ensemble", "def main(", 12)
        first, prefix = _server_of(proc)
        assert shm_regions(prefix)
        _kill_engine_stub(first)
        line = ""
        while not line.startswith("restarting") and proc.poll() is None:  # after the ready block's lines
            line = proc.stdout.readline()
        assert line.startswith("restarting tritonserver (1 of 1 within 3600 s): Python backend stub process died: "
                               "tensorrt_llm_0_0"), line
        line = proc.stdout.readline()  # printed once the new server is ready and its stubs are watched
        assert line.startswith(f"ready again after restart 1: gRPC {url}"), line
        assert grpcclient.InferenceServerClient(url).is_server_ready()
        second, prefix2 = _server_of(proc)
        assert second != first and backend_stubs(first) == {}
        assert _generate_text(url, "ensemble", "def main(", 12) == want
        _kill_engine_stub(second)
        rc = proc.wait(60)
        rest = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 1 and "stub process died" in rest and "tensorrt_llm_0_0" in rest
    assert "restarted 1 time(s) in the last 3600 s (limit 1)" in rest, rest
    assert backend_stubs(second) == {} and shm_regions(prefix) == [] and shm_regions(prefix2) == []
