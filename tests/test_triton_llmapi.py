"""The llmapi layout (`trtmoe repo --layout llmapi`): one text-in, text-out `tensorrt_llm` model with the
inputs and outputs of TensorRT-LLM 1.2's triton_backend llmapi model, served by a real tritonserver
(nvidia-pytriton's Triton 2.51, CPU) on the trained Mixtral fixture.

Requests are shaped as that project's `tools/llmapi_client.py` sends them: `text_input` a 1-D string
tensor of one prompt, `sampling_param_max_tokens` [1], `stop` [1] with the request id to stop."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import (assert_decode_thread_alone, grpc_stream, require, require_fixture, routed_tokens_per_layer,
                      thread_affinities, wait_settled)

require("tritonclient.grpc")
require("pytriton")

import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from trtmoe.checkpoint.verify import verify_artifact  # noqa: E402
from trtmoe.checkpoint.writer import convert  # noqa: E402
from trtmoe.errors import InputError  # noqa: E402
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams  # noqa: E402
from trtmoe.triton.cpu_binding import format_cores  # noqa: E402
from trtmoe.triton.repository import LLMAPI_CONTRACT, generate_repository, validate_repository  # noqa: E402
from trtmoe.triton.serve import serve_repository  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "trained_mixtral"
BUILD = {"max_batch_size": 8, "max_input_len": 64, "max_seq_len": 512, "max_beam_width": 1, "tokens_per_block": 32}

require_fixture(FIXTURE)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("llmapi")
    convert(FIXTURE, root / "ckpt", dtype="float32")
    engine = root / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"backend": "embedded", "checkpoint": "../ckpt",
                                                    "build_config": BUILD}))
    return engine


class Reference:
    """The embedded engine's own greedy answer, decoded as the LLM API's CompletionOutput.text (the
    generated tokens only)."""

    def __init__(self, ckpt: Path, tokenizer_dir: Path):
        import torch
        from tokenizers import Tokenizer

        torch.set_num_threads(1)
        self.engine = EmbeddedEngine.from_checkpoint(ckpt, device="cpu", max_seq_len=BUILD["max_seq_len"])
        self.tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.eos = json.loads((tokenizer_dir / "trtmoe_tokenizer.json").read_text())["eos_token_id"]
        self.lock = threading.Lock()

    def tokens(self, prompt: str, n: int, **params) -> list[int]:
        with self.lock:
            return self.engine.generate(self.tok.encode(prompt).ids,
                                        SamplingParams(max_new_tokens=n, end_id=self.eos, **params))

    def text(self, prompt: str, n: int) -> str:
        return self.tok.decode(self.tokens(prompt, n), skip_special_tokens=True)


def _serve(engine_dir, root: Path, streaming: bool):
    repo = generate_repository(engine_dir, root / "repo", layout="llmapi", streaming=streaming, torch_num_threads=1)
    return repo, serve_repository(repo.path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=240)


@pytest.fixture(scope="module")
def unary(engine_dir, tmp_path_factory):
    """The default llmapi repository: not decoupled, as upstream's model.yaml."""
    repo, server = _serve(engine_dir, tmp_path_factory.mktemp("unary"), streaming=False)
    try:
        yield {"server": server, "url": server.endpoints.grpc, "repo": repo,
               "ref": Reference(engine_dir.parent / "ckpt", repo.tokenizer_dir)}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def streaming(engine_dir, tmp_path_factory, unary):
    repo, server = _serve(engine_dir, tmp_path_factory.mktemp("stream"), streaming=True)
    try:
        yield {"server": server, "url": server.endpoints.grpc, "repo": repo, "ref": unary["ref"]}
    finally:
        server.stop()


def _t(name: str, arr: np.ndarray, dtype: str):
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def _inputs(prompt: str, max_tokens: int | None = None, **extra) -> list:
    """As llmapi_client.py builds them: text_input [1] BYTES, sampling_param_max_tokens [1] INT32; ``extra``
    as name=(value, Triton dtype), each a [1] tensor (a list value: a [n] tensor)."""
    out = [_t("text_input", np.array([prompt.encode()], dtype=object), "BYTES")]
    if max_tokens is not None:
        out.append(_t("sampling_param_max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"))
    np_of = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": bool, "BYTES": object}
    for name, (value, dtype) in extra.items():
        values = value if isinstance(value, list) else [value]
        if dtype == "BYTES":
            values = [v.encode() for v in values]
        out.append(_t(name, np.array(values, dtype=np_of[dtype]), dtype))
    return out


def _infer(url: str, inputs: list, request_id: str = ""):
    with grpcclient.InferenceServerClient(url) as client:
        return client.infer("tensorrt_llm", inputs, request_id=request_id)


def _stream(url: str, inputs: list, request_id: str = "", timeout: float = 60.0,
            on_first=None) -> tuple[list, Exception | None]:
    return grpc_stream(url, "tensorrt_llm", inputs, timeout, on_first, request_id=request_id)


def _text(res) -> str:
    return res.as_numpy("text_output")[0].decode()


# -- the repository ---------------------------------------------------------------------------------
def test_llmapi_repository_holds_one_model(engine_dir, tmp_path):
    r = generate_repository(engine_dir, tmp_path / "repo", layout="llmapi")
    assert r.models == ["tensorrt_llm"] and r.layout == "llmapi"
    assert sorted(p.name for p in r.path.iterdir()) == ["tensorrt_llm", "trtmoe_repository.json"]
    assert (r.tokenizer_dir / "tokenizer.json").is_file() and r.tokenizer_dir.parent.name == "tensorrt_llm"
    cfg = validate_repository(r.path)["tensorrt_llm"]
    assert cfg.max_batch_size == 0 and not cfg.model_transaction_policy.decoupled
    names = {i.name for i in cfg.input}
    assert {"text_input", "streaming", "sampling_param_max_tokens", "sampling_param_stop", "stop",
            "return_finish_reason"} <= names
    assert [i.name for i in cfg.input if not i.optional] == ["text_input"]
    assert {"text_output", "finish_reason", "stop_reason", "cumulative_logprob"} <= {o.name for o in cfg.output}
    manifest = json.loads((r.path / "trtmoe_repository.json").read_text())
    assert manifest["contract"] == LLMAPI_CONTRACT and manifest["layout"] == "llmapi"
    stream = generate_repository(engine_dir, tmp_path / "stream", layout="llmapi", streaming=True)
    assert validate_repository(stream.path)["tensorrt_llm"].model_transaction_policy.decoupled


def test_llmapi_layout_refuses_tensorrt_llm_engines_and_unknown_layouts(engine_dir, tmp_path):
    trt = tmp_path / "trt"
    trt.mkdir()
    pretrained = json.loads((engine_dir.parent / "ckpt" / "config.json").read_text())  # a trtllm-build engine dir
    (trt / "config.json").write_text(json.dumps({"version": "1.2.0", "pretrained_config": pretrained,
                                                 "build_config": {**BUILD, "max_num_tokens": 8192}}))
    (trt / "rank0.engine").write_bytes(b"\0" * 16)
    with pytest.raises(InputError, match="llmapi layout serves the embedded engine"):
        generate_repository(trt, tmp_path / "repo", layout="llmapi", tokenizer_dir=FIXTURE)
    with pytest.raises(InputError, match="layout must be one of inflight, llmapi"):
        generate_repository(engine_dir, tmp_path / "repo2", layout="bls")
    with pytest.raises(InputError, match="bls_instance_count, exclude_input_in_output do.es. not apply"):
        generate_repository(engine_dir, tmp_path / "repo3", layout="llmapi", bls_instance_count=2,
                            exclude_input_in_output=True)
    assert not any((tmp_path / n).exists() for n in ("repo", "repo2", "repo3"))


# -- served, not decoupled (unary ModelInfer and HTTP /generate) -------------------------------------
def test_unary_text_is_the_engines_greedy_completion(unary):
    ref = unary["ref"]
    for prompt in ("def main(", "import os\n", "class Parser:\n    def __init__(self"):
        want = ref.text(prompt, 24)
        assert want.strip()
        assert _text(_infer(unary["url"], _inputs(prompt, 24))) == want
    # The LLM API's default length: 32 tokens.
    assert _text(_infer(unary["url"], _inputs("def main("))) == ref.text("def main(", 32)


def test_http_generate(unary):
    host, port = unary["server"].endpoints.host, unary["server"].endpoints.http_port
    body = json.dumps({"text_input": "def main(", "sampling_param_max_tokens": 12}).encode()
    req = urllib.request.Request(f"http://{host}:{port}/v2/models/tensorrt_llm/generate", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        got = json.loads(resp.read())
    assert got["text_output"] == unary["ref"].text("def main(", 12)


def test_output_fields_on_request(unary):
    ref = unary["ref"]
    res = _infer(unary["url"], _inputs("def main(", 10, return_finish_reason=(True, "BOOL"),
                                       return_stop_reason=(True, "BOOL"), return_cumulative_logprob=(True, "BOOL"),
                                       sampling_param_return_perf_metrics=(True, "BOOL")))
    assert res.as_numpy("finish_reason")[0] == b"length" and res.as_numpy("stop_reason")[0] == b"None"
    with ref.lock:
        seq = ref.engine.start(ref.tok.encode("def main(").ids,
                               SamplingParams(max_new_tokens=10, end_id=ref.eos, return_log_probs=True))
        while not seq.finished:
            ref.engine.step([seq])
    assert res.as_numpy("cumulative_logprob")[0] == pytest.approx(sum(seq.log_probs), abs=1e-3)
    times = [int(res.as_numpy(n)[0]) for n in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                                               "last_token_time_ns")]
    assert times == sorted(times) and abs(times[0] - time.time_ns()) < 60e9
    assert res.as_numpy("kv_cache_alloc_total_blocks")[0] >= 1
    plain = _infer(unary["url"], _inputs("def main(", 10))
    assert {o.name for o in plain.get_response().outputs} == {"text_output"}


def test_stop_strings_cut_the_text(unary):
    want = unary["ref"].text("def main(", 24)
    assert "\n" in want
    res = _infer(unary["url"], _inputs("def main(", 24, sampling_param_stop=(["\n", "never there"], "BYTES"),
                                       return_finish_reason=(True, "BOOL"), return_stop_reason=(True, "BOOL")))
    assert _text(res) == want[:want.index("\n")]
    assert res.as_numpy("finish_reason")[0] == b"stop" and res.as_numpy("stop_reason")[0] == b"\n"


def test_seeded_sampling_repeats(unary):
    kw = dict(sampling_param_temperature=(1.5, "FP32"), sampling_param_seed=(7, "UINT64"))
    a = _text(_infer(unary["url"], _inputs("def main(", 24, **kw)))
    b = _text(_infer(unary["url"], _inputs("def main(", 24, **kw)))
    c = _text(_infer(unary["url"], _inputs("def main(", 24, sampling_param_temperature=(1.5, "FP32"),
                                           sampling_param_seed=(8, "UINT64"))))
    assert a == b and a != c


@pytest.mark.parametrize("extra,message", [
    (dict(sampling_param_best_of=(2, "INT32")), "best_of 2"),
    (dict(image_url=(["http://example.invalid/a.png"], "BYTES")), "image_url"),
    (dict(lora_id=(1, "UINT64")), "LoRA"),
    (dict(sampling_param_max_tokens=(0, "INT32")), "max_tokens must be at least 1"),
    (dict(sampling_param_max_tokens=(100000, "INT32")), "exceeds the engine's max_seq_len 512"),
    (dict(sampling_param_top_p=(1.5, "FP32")), "top_p must be in (0, 1]"),
    (dict(sampling_param_min_tokens=(99, "INT32"), sampling_param_max_tokens=(8, "INT32")), "min_tokens"),
    (dict(streaming=(True, "BOOL")), "--layout llmapi --streaming"),
])
def test_bad_requests_are_refused_with_the_reason(unary, extra, message):
    with pytest.raises(InferenceServerException) as e:
        _infer(unary["url"], _inputs("def main(", **extra))
    assert message in e.value.message()
    assert "INVALID_ARG" in str(e.value.status()) or "INVALID_ARGUMENT" in str(e.value.status())


def test_empty_text_input_is_refused(unary):
    with pytest.raises(InferenceServerException, match="text_input"):
        _infer(unary["url"], [_t("text_input", np.array([], dtype=object), "BYTES")])


# -- served, decoupled (streaming) ------------------------------------------------------------------
def test_streamed_responses_carry_the_text_so_far(streaming):
    want = streaming["ref"].text("class Parser:\n    def __init__(self", 24)
    out, err = _stream(streaming["url"], _inputs("class Parser:\n    def __init__(self", 24,
                                                 streaming=(True, "BOOL"), return_num_output_tokens=(True, "BOOL")))
    assert err is None and len(out) > 4
    texts = [_text(r) for r in out]
    assert texts[-1] == want
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(texts, texts[1:]))
    counts = [int(r.as_numpy("num_output_tokens")[0]) for r in out]
    assert counts == sorted(set(counts)) and counts[-1] == len(streaming["ref"].tokens(
        "class Parser:\n    def __init__(self", 24))
    # Not streamed on the decoupled model: one final response with all of it.
    out, err = _stream(streaming["url"], _inputs("class Parser:\n    def __init__(self", 24))
    assert err is None and [_text(r) for r in out] == [want]


def test_stop_request_ends_a_running_generation(streaming):
    url, n = streaming["url"], 400
    stop_result: dict = {}

    def send_stop():  # as llmapi_client.py --stop-after-ms sends it: an empty text_input and stop, same id
        _, stop_result["error"] = _stream(url, [_t("text_input", np.array([b""], dtype=object), "BYTES"),
                                                _t("stop", np.array([True]), "BOOL")], request_id="gen-7")

    out, err = _stream(url, _inputs("def main(", n, streaming=(True, "BOOL"), sampling_param_min_tokens=(n, "INT32"),
                                    return_finish_reason=(True, "BOOL")),
                       request_id="gen-7", on_first=lambda: threading.Thread(target=send_stop).start())
    assert err is None
    assert out[-1].as_numpy("finish_reason")[0] == b"cancelled"
    full = streaming["ref"].tokens("def main(", n, min_tokens=n)
    got = _text(out[-1])
    assert got and streaming["ref"].tok.decode(full, skip_special_tokens=True).startswith(got)
    assert len(streaming["ref"].tok.encode(got, add_special_tokens=False).ids) < n - 50
    deadline = time.time() + 10
    while "error" not in stop_result and time.time() < deadline:
        time.sleep(0.05)
    assert "cancelled" in stop_result["error"].message().lower()
    out, err = _stream(url, _inputs("def main(", 8))
    assert err is None and _text(out[-1]) == streaming["ref"].text("def main(", 8)


def test_metrics_count_every_routed_token(unary):
    """The routing gauges are exported as by the default layout's model: every token of a request
    (prompt and generated, but the last, which is never fed back) passes each MoE layer top-k times."""
    from trtmoe.triton.metrics import routed_token_table, scrape

    ref, metrics_url = unary["ref"], unary["server"].endpoints.metrics
    # earlier requests' counters settle (published every 0.5 s)
    before = wait_settled(lambda: routed_token_table(scrape(metrics_url)), what="routed-token counters")
    prompt, n = "x = [", 12
    generated = ref.tokens(prompt, n)
    _infer(unary["url"], _inputs(prompt, n))
    expected = (len(ref.tok.encode(prompt).ids) + len(generated) - 1) * 2
    per_layer = routed_tokens_per_layer(metrics_url, before, expected)
    assert len(per_layer) == ref.engine.num_layers and all(v == expected for v in per_layer.values()), per_layer
    m = scrape(metrics_url)
    assert "nv_trt_llm_request_metrics" in m and "nv_trt_llm_kv_cache_block_metrics" in m


def test_generate_client_speaks_the_llmapi_contract(unary, streaming):
    """`trtmoe generate` / trtmoe.triton.client.generate: with no model named, a server without an
    ensemble is called through its llmapi tensorrt_llm; streamed pieces are what each response adds."""
    from click.testing import CliRunner

    from trtmoe.cli import main
    from trtmoe.triton.client import generate

    want = unary["ref"].text("import os\n", 16)
    r = generate(unary["url"], "import os\n", model=None, max_tokens=16)
    assert r.model == "tensorrt_llm" and not r.streamed and r.text == want
    pieces: list[str] = []
    r = generate(streaming["url"], "import os\n", model=None, max_tokens=16, on_text=pieces.append)
    assert r.streamed and len(r.pieces) > 2 and "".join(pieces) == r.text == want
    stopped = generate(unary["url"], "def main(", model=None, max_tokens=24, stop_words=["\n"])
    assert stopped.text == unary["ref"].text("def main(", 24).split("\n")[0]
    with pytest.raises(InputError, match="completion alone"):
        generate(unary["url"], "x", model=None, max_tokens=4, exclude_input_in_output=False)
    out = CliRunner().invoke(main, ["generate", "import os\n", "-n", "16", "--url", streaming["url"]])
    assert out.exit_code == 0, out.output
    assert out.output.startswith(want)


# -- decode cores -----------------------------------------------------------------------------------
def _bound_server(engine_dir, root: Path, decode_cores: str):
    repo = generate_repository(engine_dir, root / "repo", layout="llmapi", streaming=True, torch_num_threads=1,
                               decode_cores=decode_cores)
    return serve_repository(repo.path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=240)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="binding the decode thread needs Linux and at least 2 usable cores")
def test_decode_cores_keep_the_decode_thread_alone(engine_dir, tmp_path, unary):
    cores = sorted(os.sched_getaffinity(0))
    server = _bound_server(engine_dir, tmp_path, "auto")
    try:
        decode, rest = cores[-1:], cores[:-1]  # auto, one torch thread: the last core
        assert server.binding == (f"decode thread on cores {format_cores(decode)}, tritonserver and its other "
                                  f"threads on {format_cores(rest)}")
        want = unary["ref"].text("def main(", 24)
        out, err = _stream(server.endpoints.grpc, _inputs("def main(", 24, streaming=(True, "BOOL")))
        assert err is None and _text(out[-1]) == want
        assert len(server.stubs) == 1
        assert_decode_thread_alone(server, decode, rest)
    finally:
        server.stop()
    # Cores the machine does not have: the model says so in the log and serves unbound.
    server = _bound_server(engine_dir, tmp_path / "missing", "4000-4001")
    try:
        assert server.binding.startswith("decode_cores not applied: ") and "not available" in server.binding
        out, err = _stream(server.endpoints.grpc, _inputs("def main(", 24, streaming=(True, "BOOL")))
        assert err is None and _text(out[-1]) == unary["ref"].text("def main(", 24)
        threads = thread_affinities(list(server.stubs)[0])
        assert [c for n, c in threads.items() if n.startswith("trtmoe-decode")] == [cores]
        assert "decode_cores not applied" in server.log_path.read_text()
    finally:
        server.stop()


def test_a_prompt_of_megabytes_is_refused_before_tokenizing(unary):
    """A 2 MB text_input is refused on its byte length (tokenizing it first held the model for seconds),
    and the repository still verifies after serving (the bytecode caches the Python backend writes are not artifact files)."""
    host, port = unary["server"].endpoints.host, unary["server"].endpoints.http_port
    body = json.dumps({"text_input": "def main(" + "x = 1\n" * (2 * 2**20 // 6), "sampling_param_max_tokens": 4})
    req = urllib.request.Request(f"http://{host}:{port}/v2/models/tensorrt_llm/generate", data=body.encode(),
                                 method="POST")
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and "refused before tokenizing" in e.value.read().decode()
    assert time.monotonic() - t0 < 2.0  # tokenizing it took 4-16 s
    assert _text(_infer(unary["url"], _inputs("def main(", 8))) == unary["ref"].text("def main(", 8)
    verify_artifact(unary["repo"].path)  # with the __pycache__ the Python backend wrote into it
