"""The client contract of upstream's tensorrtllm_backend (v0.19.0 clients, TensorRT-LLM 1.2 templates),
checked against a real tritonserver serving the DEFAULT repository of the trained Mixtral fixture
(not decoupled, prompt included), after the repository and its engine were moved elsewhere.

What upstream's clients rely on, restated (not copied) from their source:
* ``text_output`` is 1-D per response; clients read ``result.as_numpy("text_output")[0].decode()``.
* the first documented commands are unary (ModelInfer / HTTP infer), so the default repository is
  not decoupled, and ``exclude_input_in_output`` defaults to false (the prompt leads the text).
* ``return_perf_metrics`` yields ten outputs, each read as ``[0][0]``: five INT32 counts, four INT64
  timestamps and an FP32 acceptance rate.
* ``min_length`` / ``random_seed`` (v0.19.0) and ``min_tokens`` / ``seed`` (1.2) both work.
* the ``nv_trt_llm_*`` gauge families with labels model, version and their category label.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import require, wait_until
import numpy as np
import pytest

require("tritonclient.grpc")
require("pytriton")

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from trtmoe.checkpoint.writer import convert  # noqa: E402
from trtmoe.triton.client import generate  # noqa: E402
from trtmoe.triton.metrics import parse_prometheus  # noqa: E402
from trtmoe.triton.repository import TOKENIZER_SUBDIR, default_torch_threads, generate_repository  # noqa: E402
from trtmoe.triton.serve import serve_repository  # noqa: E402

from test_triton_server import BUILD, FIXTURE, REPO_ROOT, Reference, _tensor  # noqa: E402

PERF_OUTPUTS = {  # name -> numpy dtype, as upstream's ensemble declares them
    "kv_cache_alloc_new_blocks": np.int32, "kv_cache_reused_blocks": np.int32, "kv_cache_alloc_total_blocks": np.int32,
    "total_accepted_draft_tokens": np.int32, "total_draft_tokens": np.int32,
    "arrival_time_ns": np.int64, "first_scheduled_time_ns": np.int64, "first_token_time_ns": np.int64,
    "last_token_time_ns": np.int64, "acceptance_rate": np.float32,
}


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """Repository + engine + checkpoint made in one place, copied to another, the original renamed
    away; the server runs on the copy."""
    root = tmp_path_factory.mktemp("contract")
    first = root / "first"
    ckpt = first / "ckpt"
    convert(FIXTURE, ckpt, dtype="float32")
    engine = first / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"backend": "embedded", "checkpoint": "../ckpt", "build_config": BUILD}))
    repo = generate_repository(engine, first / "repo")  # every default
    texts = {p: p.read_text(errors="replace") for p in (first / "repo").rglob("*")
             if p.is_file() and TOKENIZER_SUBDIR not in p.as_posix()}
    shutil.copytree(first, root / "second", symlinks=False)
    first.rename(root / "gone")
    server = serve_repository(root / "second" / "repo", http_port=0, grpc_port=0, metrics_port=0, timeout_s=240)
    try:
        yield {"server": server, "url": server.endpoints.grpc, "root": root, "texts": texts, "settings": repo.settings,
               "ref": Reference(root / "second" / "ckpt", root / "second" / "repo" / TOKENIZER_SUBDIR),
               "repo": root / "second" / "repo"}
    finally:
        server.stop()


def _infer(url, model, prompt, max_tokens, outputs=None, **extra):
    """A unary ModelInfer call shaped like upstream's clients' requests ([1, 1] per input)."""
    arrays = {"text_input": (np.array([[prompt.encode()]], dtype=object), "BYTES"),
              "max_tokens": (np.array([[max_tokens]], np.int32), "INT32")}
    arrays.update(extra)
    client = grpcclient.InferenceServerClient(url)
    try:
        req_out = [grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None
        return client.infer(model, [_tensor(k, a, d) for k, (a, d) in arrays.items() if a is not None], outputs=req_out)
    finally:
        client.close()


def test_repository_stores_no_absolute_path(moved):
    first = str(moved["root"] / "first")
    leaked = [p.name for p, t in moved["texts"].items() if first in t or str(moved["root"]) in t]
    assert not leaked, leaked
    # ... and it served from its new place (the fixture's server), with the old place gone.
    assert not (moved["root"] / "first").exists() and moved["server"].is_ready()


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_unary_text_output_is_1d_and_includes_prompt(moved, model):
    ref, url = moved["ref"], moved["url"]
    prompt = "def main("
    want = ref.text(prompt, 12)
    res = _infer(url, model, prompt, 12)
    out = res.as_numpy("text_output")
    assert out.shape == (1,), out.shape
    assert out[0].decode("utf-8") == ref.full_text(prompt, 12)  # upstream default: the prompt leads
    res = _infer(url, model, prompt, 12, exclude_input_in_output=(np.array([[True]]), "BOOL"))
    assert res.as_numpy("text_output")[0].decode("utf-8") == want


def test_http_infer_and_generate_on_the_default_repository(moved):
    ref, http = moved["ref"], moved["server"].endpoints.http
    client = httpclient.InferenceServerClient(http.split("//", 1)[1])
    try:
        inputs = []
        for name, arr, dt in (("text_input", np.array([["import os\n".encode()]], dtype=object), "BYTES"),
                              ("max_tokens", np.array([[10]], np.int32), "INT32")):
            t = httpclient.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        text = client.infer("ensemble", inputs).as_numpy("text_output")
    finally:
        client.close()
    assert text.shape == (1,) and text[0].decode() == ref.full_text("import os\n", 10)
    body = json.dumps({"text_input": "import os\n", "max_tokens": 10}).encode()
    with urllib.request.urlopen(urllib.request.Request(http + "/v2/models/ensemble/generate", data=body), timeout=60) as r:
        assert json.loads(r.read())["text_output"] == ref.full_text("import os\n", 10)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_perf_metrics_all_ten_outputs(moved, model):
    prompt, n = "class Parser:\n    def __init__(self", 9
    t0 = time.time_ns()
    res = _infer(moved["url"], model, prompt, n, outputs=["text_output", *PERF_OUTPUTS],
                 return_perf_metrics=(np.array([[True]]), "BOOL"))
    t1 = time.time_ns()
    v = {}
    for name, dtype in PERF_OUTPUTS.items():
        arr = res.as_numpy(name)
        assert arr is not None, name
        assert arr.dtype == dtype and arr.size == 1, (name, arr.dtype, arr.shape)
        v[name] = arr[0][0] if arr.ndim == 2 else arr[0]  # upstream's clients read [0][0]
    need = len(moved["ref"].ids(prompt)) + n
    tpb = BUILD["tokens_per_block"]
    # Blocks of the KV row the engine reserved for this sequence: it holds prompt + max_tokens.
    assert v["kv_cache_alloc_new_blocks"] >= -(-need // tpb)
    assert v["kv_cache_reused_blocks"] == 0
    assert v["kv_cache_alloc_total_blocks"] == v["kv_cache_alloc_new_blocks"] + v["kv_cache_reused_blocks"]
    assert v["total_draft_tokens"] == 0 and v["total_accepted_draft_tokens"] == 0 and v["acceptance_rate"] == 0.0
    assert t0 <= v["arrival_time_ns"] <= v["first_scheduled_time_ns"] <= v["first_token_time_ns"] \
        <= v["last_token_time_ns"] <= t1


def test_min_length_and_random_seed_aliases(moved):
    ref, url = moved["ref"], moved["url"]
    prompt = "for i in range("
    gen = ref.tokens(prompt, 24)
    stop_id = gen[3]  # ends greedy decoding early when used as end_id
    k = gen.index(stop_id)
    end = {"end_id": (np.array([[stop_id]], np.int32), "INT32")}
    count = {"return_num_output_tokens": (np.array([[True]]), "BOOL"),
             "exclude_input_in_output": (np.array([[True]]), "BOOL")}
    short = _infer(url, "ensemble", prompt, 24, **end, **count)
    assert short.as_numpy("num_output_tokens")[0][0] == k
    for model in ("ensemble", "tensorrt_llm_bls"):
        for name in ("min_length", "min_tokens"):
            res = _infer(url, model, prompt, 24, **end, **count, **{name: (np.array([[12]], np.int32), "INT32")})
            assert res.as_numpy("num_output_tokens")[0][0] >= 12, (model, name)
    with pytest.raises(InferenceServerException, match="disagree"):
        _infer(url, "ensemble", prompt, 24, min_tokens=(np.array([[3]], np.int32), "INT32"),
               min_length=(np.array([[5]], np.int32), "INT32"))
    sample = {"top_k": (np.array([[50]], np.int32), "INT32"), "temperature": (np.array([[1.5]], np.float32), "FP32")}
    texts = {}
    for name, seed in (("seed", 7), ("random_seed", 7), ("seed", 8)):
        res = _infer(url, "ensemble", prompt, 16, **sample, **{name: (np.array([[seed]], np.uint64), "UINT64")})
        texts[(name, seed)] = res.as_numpy("text_output")[0]
    assert texts[("seed", 7)] == texts[("random_seed", 7)] != texts[("seed", 8)]


def test_logits_and_sequences_refused_on_this_engine_and_model(moved):
    """The default repository's engine was built without the gather flags and its tensorrt_llm model is
    not decoupled: asking for logits names the build flag, several sequences name the decoupled model
    (through the ensemble and BLS too), each in one line."""
    for model in ("ensemble", "tensorrt_llm_bls"):
        for name, flag in (("return_context_logits", "gather_context_logits"),
                           ("return_generation_logits", "gather_generation_logits")):
            with pytest.raises(InferenceServerException, match=f"{name}.*{flag}") as e:
                _infer(moved["url"], model, "def main(", 4, **{name: (np.array([[True]]), "BOOL")})
            assert "\n" not in e.value.message()
        with pytest.raises(InferenceServerException, match="decoupled"):
            _infer(moved["url"], model, "def main(", 4, num_return_sequences=(np.array([[2]], np.int32), "INT32"))
    # one sequence stays an ordinary request
    res = _infer(moved["url"], "ensemble", "def main(", 4, num_return_sequences=(np.array([[1]], np.int32), "INT32"))
    assert res.as_numpy("sequence_index") is None or res.as_numpy("sequence_index").reshape(-1).tolist() == [0]


@pytest.mark.parametrize("missing", ["text_input", "max_tokens"])
def test_missing_required_input_is_an_error(moved, missing):
    client = grpcclient.InferenceServerClient(moved["url"])
    arrays = {"text_input": (np.array([[b"def main("]], dtype=object), "BYTES"),
              "max_tokens": (np.array([[8]], np.int32), "INT32")}
    arrays.pop(missing)
    try:
        for model in ("ensemble", "tensorrt_llm_bls"):
            with pytest.raises(InferenceServerException, match=missing):
                client.infer(model, [_tensor(k, a, d) for k, (a, d) in arrays.items()])
    finally:
        client.close()
    body = json.dumps({k: ("def main(" if k == "text_input" else 8) for k in arrays}).encode()
    url = moved["server"].endpoints.http + "/v2/models/ensemble/generate"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=30)
    assert missing in e.value.read().decode()


def test_nv_trt_llm_metric_families(moved):
    generate(moved["url"], "x = [", max_tokens=6)
    families = {
        "nv_trt_llm_request_metrics": ("request_type", {"active", "max", "scheduled", "context", "waiting"}),
        "nv_trt_llm_runtime_memory_metrics": ("memory_type", {"cpu", "gpu", "pinned"}),
        "nv_trt_llm_kv_cache_block_metrics": ("kv_cache_block_type",
                                              {"max", "free", "used", "tokens_per", "reused", "fraction"}),
        "nv_trt_llm_inflight_batcher_metrics": ("inflight_batcher_specific_metric",
                                                {"total_context_tokens", "generation_requests", "micro_batch_id",
                                                 "paused_requests"}),
        "nv_trt_llm_general_metrics": ("general_type", {"timestamp", "iteration_counter"}),
    }

    def published():  # every family with all its labels, and the request's decode steps counted (every 0.5 s)
        m = parse_prometheus(urllib.request.urlopen(moved["server"].endpoints.metrics, timeout=10).read().decode())
        labels_ok = all({lab.get(key) for lab, _ in m.get(fam, [])} == values for fam, (key, values) in families.items())
        steps = [v for lab, v in m.get("nv_trt_llm_general_metrics", []) if lab.get("general_type") == "iteration_counter"]
        used = [v for lab, v in m.get("nv_trt_llm_kv_cache_block_metrics", [])
                if lab.get("kv_cache_block_type") == "used"]
        # ... and published after the request ended (a snapshot taken while it ran holds its blocks)
        return m if labels_ok and steps and steps[0] >= 5 and used == [0.0] else None

    m = wait_until(published, 10, "the nv_trt_llm_* metric families, idle, after a 6-token request")
    got = {}
    for fam, (key, values) in families.items():
        samples = m.get(fam, [])
        assert {lab.get(key) for lab, _ in samples} == values, fam
        for lab, v in samples:
            assert lab["model"] == "tensorrt_llm" and lab["version"] == "1", lab
            got[(fam, lab[key])] = v
    assert got[("nv_trt_llm_request_metrics", "max")] == BUILD["max_batch_size"]
    assert got[("nv_trt_llm_kv_cache_block_metrics", "tokens_per")] == BUILD["tokens_per_block"]
    assert got[("nv_trt_llm_general_metrics", "iteration_counter")] >= 5  # the 6-token request's decode steps
    assert abs(got[("nv_trt_llm_general_metrics", "timestamp")] / 1e6 - time.time()) < 120
    # The latest iteration decoded the one request: one generation request, no prefill in it.
    assert got[("nv_trt_llm_inflight_batcher_metrics", "generation_requests")] == 1
    assert got[("nv_trt_llm_request_metrics", "scheduled")] >= 1
    kv = {k: got[("nv_trt_llm_kv_cache_block_metrics", k)] for k in ("max", "free", "used", "fraction")}
    assert kv["max"] == kv["free"] + kv["used"] and 0.0 <= kv["fraction"] <= 1.0
    # Idle after the request: the cache reads free up to what max_batch_size sequences may hold, not 0.
    assert kv["used"] == 0 and kv["max"] == kv["free"] >= BUILD["max_batch_size"]
    assert got[("nv_trt_llm_runtime_memory_metrics", "gpu")] == 0
    # Upstream's token-length histograms: the request's prompt and 6 generated tokens were observed.
    for fam, label in (("nv_llm_input_token_len", "total_input_tokens"),
                       ("nv_llm_output_token_len", "total_output_tokens")):
        buckets = {float(lab["le"]): v for lab, v in m.get(fam + "_bucket", [])
                   if lab.get("response_metric_type") == label}
        assert set(buckets) == {10.0, 50.0, 100.0, 500.0, 1000.0, math.inf}, (fam, m.get(fam + "_bucket"))
        assert buckets[math.inf] >= 1 and m[fam + "_count"][0][1] >= 1, fam
    assert [v for _, v in m["nv_llm_output_token_len_sum"]][0] >= 6


def _stack_processes(server) -> list[tuple[int, int, str]]:
    """(pid, rss kB, command) of tritonserver and every backend stub of this server."""
    ps = subprocess.run(["ps", "-ww", "-o", "pid=,rss=,args=", "-g", str(server.process.pid)], capture_output=True, text=True)
    out = []
    for line in ps.stdout.splitlines():
        pid, rss, cmd = line.split(None, 2)
        out.append((int(pid), int(rss), cmd))
    return out


def test_threads_and_processes(moved):
    cfg = (moved["repo"] / "tensorrt_llm" / "config.pbtxt").read_text()
    want = default_torch_threads(3)  # pre + post + BLS instances
    assert f'key: "torch_num_threads" value: {{ string_value: "{want}" }}' in cfg
    assert moved["settings"].torch_num_threads == want
    assert f"torch_threads={min(want, os.cpu_count())}" in moved["server"].log_path.read_text(errors="replace")
    # Pre/postprocessing run on the tokenizers library alone: no torch loaded in those processes.
    procs = _stack_processes(moved["server"])
    stubs = [(pid, cmd) for pid, _, cmd in procs if "triton_python_backend_stub" in cmd]
    assert len(stubs) >= 4, procs
    for pid, cmd in stubs:
        if "preprocessing" in cmd or "postprocessing" in cmd:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "libtorch" not in maps and "tokenizers" in maps, cmd


def test_generate_command_and_example_client_unary(moved):
    from click.testing import CliRunner

    from trtmoe.cli import TrtmoeGroup
    from trtmoe.triton import commands

    ref, url = moved["ref"], moved["url"]
    group = TrtmoeGroup(commands={c.name: c for c in commands.COMMANDS})
    out = CliRunner().invoke(group, ["generate", "def main(", "-n", "12", "--url", url, "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["text"] == ref.text("def main(", 12) and not data["streamed"] and data["responses"] == 1
    bad = CliRunner().invoke(group, ["generate", "def main(", "--url", url, "--stream"])
    assert bad.exit_code == 2 and "--streaming" in bad.output
    run = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "example_client.py"), "def main(",
                          "--max-tokens", "12", "--url", url], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ref.text("def main(", 12) + "\n"
