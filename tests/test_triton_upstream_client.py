"""The request and response handling of tensorrtllm_backend's ``end_to_end_grpc_client.py``
(inflight_batcher_llm/client/ in triton-inference-server/tensorrtllm_backend), restated here with
tritonclient and run against a real server on both kinds of repository trtmoe writes: the default
one (not decoupled) and ``--streaming`` (decoupled).

What that client does, restated (not copied):
* every request goes over the gRPC stream: ``start_stream``, one ``async_stream_infer`` to
  ``ensemble`` or ``tensorrt_llm_bls`` with a request id, then ``stop_stream()``, which returns once
  the server has closed the stream; the responses are read from the callback's queue afterwards.
* each prompt's inputs are [1, 1] arrays: text_input (BYTES), max_tokens (INT32), stream (BOOL),
  beam_width (INT32, 1), temperature (FP32, default 1.0: greedy, as no top_k / top_p is sent) and
  exclude_input_in_output (BOOL, false unless asked); ``--batch-inputs`` stacks the prompts' arrays
  along the first axis into one request and also asks for ``batch_index``.
* it asks for ``text_output`` only (plus the ten perf-metric outputs with ``--return-perf-metrics``),
  reads ``as_numpy("text_output")[0]`` of every response, ``batch_index[0][0]`` and
  ``sequence_index[0][0]`` when present, and each perf metric as ``[0][0]``; every response must
  therefore carry ``text_output``. Streamed pieces are appended; otherwise a response is the text.
* ``--check-outputs``: a streamed text is the completion; a non-streamed one (unless excluded) is
  the prompt followed by the completion.

Where trtmoe refuses one of the client's modes (``--streaming`` on the default repository, which is
not decoupled; ``--batch-inputs`` outside the streaming repository's ensemble), the test checks the
refusal's message, so a change either way shows here.
"""

from __future__ import annotations

import json
import queue

from conftest import require, require_fixture
import numpy as np
import pytest

require("tritonclient.grpc")
require("pytriton")

import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from trtmoe.checkpoint.writer import convert  # noqa: E402
from trtmoe.triton.repository import generate_repository  # noqa: E402
from trtmoe.triton.serve import serve_repository  # noqa: E402

from test_triton_contract import PERF_OUTPUTS  # noqa: E402
from test_triton_server import BUILD, FIXTURE, Reference  # noqa: E402

require_fixture(FIXTURE)

PROMPTS = ["def main(", "import os\n", "class Parser:\n    def __init__(self"]
N = 10


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("upstream-client")
    convert(FIXTURE, root / "ckpt", dtype="float32")
    (root / "engine").mkdir()
    (root / "engine" / "config.json").write_text(
        json.dumps({"backend": "embedded", "checkpoint": "../ckpt", "build_config": BUILD}))
    return root


@pytest.fixture(scope="module", params=["default", "streaming"])
def server(request, engine_dir):
    repo = generate_repository(engine_dir / "engine", engine_dir / f"repo-{request.param}",
                               streaming=request.param == "streaming", torch_num_threads=1)
    srv = serve_repository(repo.path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=240)
    try:
        yield {"kind": request.param, "url": srv.endpoints.grpc,
               "ref": Reference(engine_dir / "ckpt", repo.tokenizer_dir)}
    finally:
        srv.stop()


def _prompt_arrays(prompt: str, streaming: bool, perf: bool) -> dict[str, np.ndarray]:
    arrays = {"text_input": np.array([[prompt]]).astype(object), "max_tokens": np.array([[N]], np.int32),
              "stream": np.array([[streaming]], bool), "beam_width": np.array([[1]], np.int32),
              "temperature": np.array([[1.0]], np.float32), "exclude_input_in_output": np.array([[False]], bool)}
    if perf:
        arrays["return_perf_metrics"] = np.array([[True]], bool)
    return arrays


def _tensor(name: str, arr: np.ndarray) -> grpcclient.InferInput:
    dtype = "BYTES" if arr.dtype == object else {"int32": "INT32", "bool": "BOOL", "float32": "FP32"}[arr.dtype.name]
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def run_client(url: str, model: str, prompts: list[str], streaming: bool = False, batch_inputs: bool = False,
               perf: bool = False) -> tuple[list[str], list[dict]]:
    """The client's flow: one stream per request, the texts per prompt and each response's perf metrics."""
    per_prompt = [_prompt_arrays(p, streaming, perf) for p in prompts]
    if batch_inputs:
        requests = [[_tensor(k, np.concatenate([a[k] for a in per_prompt], axis=0)) for k in per_prompt[0]]]
    else:
        requests = [[_tensor(k, v) for k, v in a.items()] for a in per_prompt]
    outputs = [grpcclient.InferRequestedOutput("text_output")]
    if batch_inputs:
        outputs.append(grpcclient.InferRequestedOutput("batch_index"))
    if perf:
        outputs += [grpcclient.InferRequestedOutput(n) for n in PERF_OUTPUTS]
    texts, metrics = [], []
    client = grpcclient.InferenceServerClient(url)
    try:
        for i, inputs in enumerate(requests):
            q: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: q.put(error if error else result))
            client.async_stream_infer(model, inputs, outputs=outputs, request_id=f"client-{i}")
            client.stop_stream()  # returns when the server has closed the stream
            batch = [""] * inputs[0].shape()[0]
            while not q.empty():
                result = q.get()
                assert not isinstance(result, InferenceServerException), f"server error: {result.message()}"
                out = result.as_numpy("text_output")
                assert out is not None, "a response without text_output (the client reads it from every one)"
                b = result.as_numpy("batch_index")
                b = 0 if b is None else int(b[0][0])
                piece = out[0].decode("utf-8")
                batch[b] = batch[b] + piece if streaming else piece
                if perf:
                    metrics.append({n: result.as_numpy(n)[0][0] for n in PERF_OUTPUTS})
            texts += batch
    finally:
        client.close()
    return texts, metrics


def _expected(ref, prompt: str, streaming: bool) -> str:
    return ref.text(prompt, N) if streaming else ref.full_text(prompt, N)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_plain(server, model):
    texts, _ = run_client(server["url"], model, PROMPTS[:1])
    assert texts == [_expected(server["ref"], PROMPTS[0], False)]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_batch_inputs(server, model):
    """``--batch-inputs`` (one request of [3, 1] inputs) runs through the streaming repository's
    ensemble. The default repository's ensemble and tensorrt_llm_bls (either kind) refuse it with
    a one-line reason the client prints."""
    if model == "tensorrt_llm_bls":
        with pytest.raises(AssertionError, match="takes one prompt per request; send a batch to the ensemble"):
            run_client(server["url"], model, PROMPTS, batch_inputs=True)
        return
    if server["kind"] == "default":
        with pytest.raises(AssertionError, match="batch size > 1 needs the decoupled tensorrt_llm model"):
            run_client(server["url"], model, PROMPTS, batch_inputs=True)
        return
    texts, _ = run_client(server["url"], model, PROMPTS, batch_inputs=True)
    assert texts == [_expected(server["ref"], p, False) for p in PROMPTS]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_return_perf_metrics(server, model):
    texts, metrics = run_client(server["url"], model, PROMPTS[1:2], perf=True)
    assert texts == [_expected(server["ref"], PROMPTS[1], False)]
    assert metrics and all(m["first_token_time_ns"] >= m["arrival_time_ns"] > 0 for m in metrics), metrics


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_streaming(server, model):
    """``--streaming``: the decoupled repository streams pieces that add up to the completion; the
    default one is not decoupled, so a streamed request is refused there (the client prints the
    server's error), as upstream's non-decoupled repository refuses it."""
    if server["kind"] == "default":
        refusal = {"ensemble": "streaming is only supported when tensorrt_llm is decoupled",
                   "tensorrt_llm_bls": "streaming needs the decoupled tensorrt_llm_bls model"}[model]
        with pytest.raises(AssertionError, match=refusal):
            run_client(server["url"], model, PROMPTS[2:], streaming=True)
        return
    texts, _ = run_client(server["url"], model, PROMPTS[2:], streaming=True)
    assert texts == [_expected(server["ref"], PROMPTS[2], True)]
    if model == "ensemble":
        texts, _ = run_client(server["url"], model, PROMPTS, streaming=True, batch_inputs=True)
        assert texts == [_expected(server["ref"], p, True) for p in PROMPTS]
