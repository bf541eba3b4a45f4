"""End to end through a real tritonserver (nvidia-pytriton's Triton 2.51, CPU, Python backend) serving
the trained Mixtral fixture with the embedded engine: one server for the module."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import (assert_decode_thread_alone, grpc_stream, require, require_fixture, routed_tokens_per_layer,
                      start_serve_command, wait_settled)

require("tritonclient.grpc")
require("pytriton")

import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from trtmoe.checkpoint.verify import verify_artifact  # noqa: E402
from trtmoe.checkpoint.writer import convert  # noqa: E402
from trtmoe.errors import InputError  # noqa: E402
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams  # noqa: E402
from trtmoe.triton import commands  # noqa: E402
from trtmoe.triton.client import generate  # noqa: E402
from trtmoe.triton.metrics import routed_token_table, scrape  # noqa: E402
from trtmoe.triton.repository import generate_repository  # noqa: E402
from trtmoe.triton.serve import serve_repository  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "trained_mixtral"
BUILD = {"max_batch_size": 16, "max_input_len": 64, "max_seq_len": 160, "max_beam_width": 1, "tokens_per_block": 32}
SERVED_MAX_SEQ_LEN = 512
PROMPTS = ["def main(", "import os\n", "class Parser:\n    def __init__(self", "    return self.", "for i in range(",
           "x = [", "if __name__ ==", "try:\n    import"]

require_fixture(FIXTURE)


class Reference:
    """What the embedded engine itself answers, decoded the way an HF pipeline returns a completion."""

    def __init__(self, ckpt: Path, tokenizer_dir: Path):
        import torch
        from transformers import AutoTokenizer

        # One thread: the server shares these cores, and spinning OpenMP workers would fight it.
        torch.set_num_threads(1)
        self.engine = EmbeddedEngine.from_checkpoint(ckpt, device="cpu", max_seq_len=BUILD["max_seq_len"])
        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.lock = threading.Lock()

    def ids(self, prompt: str) -> list[int]:
        return self.tok.encode(prompt)

    def tokens(self, prompt: str, n: int) -> list[int]:
        with self.lock:
            return self.engine.generate(self.ids(prompt), SamplingParams(max_new_tokens=n, end_id=self.tok.eos_token_id))

    def full_text(self, prompt: str, n: int) -> str:
        """Prompt and completion decoded together, as a non-streamed response with the prompt reads."""
        return self.tok.decode(self.ids(prompt) + self.tokens(prompt, n), skip_special_tokens=True)

    def text(self, prompt: str, n: int) -> str:
        ids = self.ids(prompt)
        full = self.tok.decode(ids + self.tokens(prompt, n), skip_special_tokens=True)
        head = self.tok.decode(ids, skip_special_tokens=True)
        assert full.startswith(head)
        return full[len(head):]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    ckpt = root / "ckpt"
    # float32 (lossless from the bf16 fixture): on CPU it is faster than bf16, and batched decode
    # then picks the same greedy tokens as one-at-a-time decode (bf16 rounding differs per batch shape
    # and flips near-ties).
    convert(FIXTURE, ckpt, dtype="float32")
    engine = root / "engine"
    engine.mkdir()
    # Built with both gather flags and beam search up to width 2 (tests/test_triton_contract.py's
    # engine has neither), and with the fixture's whole context (512), so that a request can run long
    # enough for a cancel to overtake it.
    build = {**BUILD, "gather_context_logits": True, "gather_generation_logits": True, "max_beam_width": 2,
             "max_seq_len": SERVED_MAX_SEQ_LEN}
    (engine / "config.json").write_text(json.dumps({"backend": "embedded", "checkpoint": "../ckpt", "build_config": build}))
    # The streaming (decoupled) repository, its decode thread on a core of its own (where the machine
    # has two: else it is served unbound); tests/test_triton_contract.py serves the default one.
    repo = generate_repository(engine, root / "repo", torch_num_threads=1, streaming=True, decode_cores="auto")
    server = serve_repository(repo.path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=240)
    try:
        yield {"server": server, "url": server.endpoints.grpc, "ref": Reference(ckpt, repo.tokenizer_dir),
               "repo": repo}
    finally:
        server.stop()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="binding the decode thread needs Linux and at least 2 usable cores")
def test_decode_cores_auto_keeps_the_ensembles_decode_thread_alone(served):
    cores = sorted(os.sched_getaffinity(0))
    assert served["server"].binding.startswith(f"decode thread on cores {cores[-1]},")
    assert_decode_thread_alone(served["server"], cores[-1:], cores[:-1])
    assert generate(served["url"], "def main(", max_tokens=24).text == served["ref"].text("def main(", 24)


def stream_call(url: str, model: str, inputs: list, timeout: float = 60.0) -> tuple[list, Exception | None]:
    """Raw ModelStreamInfer call: all responses until the final flag, or the first error."""
    return grpc_stream(url, model, inputs, timeout, enable_empty_final_response=True)


def _tensor(name, arr, dtype):
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def _llm_inputs(ids, n, end_id, **inputs):
    """A tensorrt_llm request: prompt ``ids``, ``n`` output tokens, ``end_id``, and ``inputs`` given
    as name=(array, Triton dtype)."""
    return [_tensor("input_ids", np.array([ids], np.int32), "INT32"),
            _tensor("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
            _tensor("request_output_len", np.array([[n]], np.int32), "INT32"),
            _tensor("end_id", np.array([[end_id]], np.int32), "INT32"),
            *(_tensor(k, a, d) for k, (a, d) in inputs.items())]


_TRUE, _FALSE = (np.array([[True]]), "BOOL"), (np.array([[False]]), "BOOL")


def _assert_still_serving(served):
    assert served["server"].is_ready()
    r = generate(served["url"], "def main(", max_tokens=4)
    assert r.text == served["ref"].text("def main(", 4)


def test_greedy_text_matches_engine(served):
    url, ref = served["url"], served["ref"]
    for prompt in PROMPTS[:4]:
        want = ref.text(prompt, 24)
        assert want.strip() and want.isascii(), "the fixture should produce (ASCII) code"
        # The ensemble decodes each streamed response on its own, so this equality needs every token
        # to be whole characters (true for ASCII; tensorrt_llm_bls below re-decodes and has no such limit).
        streamed = generate(url, prompt, max_tokens=24)
        assert streamed.streamed and len(streamed.pieces) > 1
        assert streamed.text == want
        assert generate(url, prompt, max_tokens=24, stream=False).text == want
        bls = generate(url, prompt, max_tokens=24, model="tensorrt_llm_bls")
        assert bls.text == want and len(bls.pieces) > 1
        assert generate(url, prompt, max_tokens=24, model="tensorrt_llm_bls", stream=False).text == want
        body = json.dumps({"text_input": prompt, "max_tokens": 24}).encode()
        http = served["server"].endpoints.http + "/v2/models/ensemble/generate"
        with urllib.request.urlopen(urllib.request.Request(http, data=body), timeout=60) as r:
            # exclude_input_in_output defaults to false, as upstream's: the prompt leads the text.
            assert json.loads(r.read())["text_output"] == ref.full_text(prompt, 24)


PERF = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "total_accepted_draft_tokens",
        "total_draft_tokens", "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
        "acceptance_rate")


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_streamed_responses_follow_upstream_contract(served, model):
    """Streamed: text_output is 1-D (clients do output[0].decode()) and, with return_perf_metrics,
    every response carries all ten perf outputs (upstream's client reads them from each one)."""
    ref = served["ref"]
    inputs = _ens_inputs(PROMPTS[0], 12, stream=(np.array([[True]]), "BOOL"),
                         return_perf_metrics=(np.array([[True]]), "BOOL"))
    responses, err = stream_call(served["url"], model, inputs)
    assert err is None
    texts = [r.as_numpy("text_output") for r in responses if r.as_numpy("text_output") is not None]
    assert len(texts) > 1 and all(t.shape == (1,) for t in texts)
    assert "".join(t[0].decode() for t in texts) == ref.text(PROMPTS[0], 12)
    last_token = 0
    for r in responses:
        if r.as_numpy("text_output") is None:
            continue
        v = {n: r.as_numpy(n) for n in PERF}
        assert all(a is not None and a.size == 1 for a in v.values()), [n for n, a in v.items() if a is None]
        assert v["kv_cache_alloc_total_blocks"].item() >= 1 and v["total_draft_tokens"].item() == 0
        assert v["last_token_time_ns"].item() >= max(last_token, v["first_token_time_ns"].item())
        last_token = v["last_token_time_ns"].item()


def test_token_ids_match_engine(served):
    """The tensorrt_llm model alone: exactly the engine's tokens, streamed as they are generated."""
    ref = served["ref"]
    ids = ref.ids(PROMPTS[2])
    want = ref.tokens(PROMPTS[2], 20)
    inputs = _llm_inputs(ids, 20, ref.tok.eos_token_id, streaming=_TRUE)
    responses, err = stream_call(served["url"], "tensorrt_llm", inputs)
    assert err is None
    got = [r.as_numpy("output_ids").reshape(-1).tolist() for r in responses if r.as_numpy("output_ids") is not None]
    # Streamed: usually one token per response, but tokens that pile up while the sender is behind
    # (a loaded machine) go out together, so only "more than one response" is certain.
    assert [t for g in got for t in g] == want and len(got) > 1
    # Non-streaming with the prompt included: one response, prompt + completion.
    inputs[-1] = _tensor("streaming", np.array([[False]]), "BOOL")
    inputs.append(_tensor("exclude_input_in_output", np.array([[False]]), "BOOL"))
    responses, err = stream_call(served["url"], "tensorrt_llm", inputs)
    assert err is None and len(responses) == 1
    assert responses[0].as_numpy("output_ids").reshape(-1).tolist() == ids + want


def test_32_concurrent_streams(served):
    url, ref = served["url"], served["ref"]
    jobs = [(PROMPTS[i % len(PROMPTS)], 12 + (i % 5) * 4) for i in range(32)]
    want = {job: ref.text(*job) for job in set(jobs)}
    results, errors = [None] * len(jobs), []
    barrier = threading.Barrier(len(jobs))

    def run(i):
        try:
            barrier.wait()
            results[i] = generate(url, jobs[i][0], max_tokens=jobs[i][1], check=False)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    for job, r in zip(jobs, results):
        assert r.text == want[job], job
        assert len(r.pieces) > 1
    # The batcher really ran them together (its gauges/counters live on the metrics endpoint).
    m = scrape(served["server"].endpoints.metrics)
    assert sum(v for _, v in m["trtmoe_batcher_iterations_total"]) > 0


def test_metrics_count_every_routed_token(served):
    ref, metrics_url = served["ref"], served["server"].endpoints.metrics
    # the previous requests' counters settle (published every 0.5 s)
    before = wait_settled(lambda: routed_token_table(scrape(metrics_url)), what="routed-token counters")
    prompt, n = PROMPTS[5], 16
    generated = ref.tokens(prompt, n)
    generate(served["url"], prompt, max_tokens=n)
    expected = (len(ref.ids(prompt)) + len(generated) - 1) * 2  # tokens through each MoE layer x top-k
    per_layer = routed_tokens_per_layer(metrics_url, before, expected)
    assert len(per_layer) == ref.engine.num_layers and all(v == expected for v in per_layer.values()), per_layer
    m = scrape(metrics_url)
    ent = [v for _, v in m["trtmoe_router_entropy_nats"]]
    imb = [v for _, v in m["trtmoe_expert_load_imbalance"]]
    assert len(ent) == ref.engine.num_layers and all(0 < v <= np.log(8) + 1e-6 for v in ent)
    assert all(v >= 1.0 for v in imb)
    assert m["trtmoe_active_params_per_token"][0][1] == ref.engine.active_params_per_token
    assert "nv_inference_request_success" in m  # Triton's own metrics are on the same endpoint


def _ens_inputs(prompt="def main(", max_tokens=8, **override):
    arrays = {"text_input": (np.array([[prompt.encode()]], dtype=object), "BYTES")}
    if max_tokens is not None:
        arrays["max_tokens"] = (np.array([[max_tokens]], np.int32), "INT32")
    arrays.update(override)
    return [_tensor(k, a, d) for k, (a, d) in arrays.items() if a is not None]


@pytest.mark.parametrize("case, inputs, message", [
    ("no text_input", lambda: _ens_inputs(text_input=(None, None)), "text_input"),
    ("no max_tokens", lambda: _ens_inputs(max_tokens=None), "max_tokens"),
    ("no max_tokens, streamed", lambda: _ens_inputs(max_tokens=None, stream=(np.array([[True]]), "BOOL")),
     "max_tokens"),
    ("no text_input, streamed", lambda: _ens_inputs(text_input=(None, None), stream=(np.array([[True]]), "BOOL")),
     "text_input"),
    ("max_tokens 0", lambda: _ens_inputs(max_tokens=0), "max_tokens"),
    ("max_tokens -3", lambda: _ens_inputs(max_tokens=-3), "max_tokens"),
    ("max_tokens beyond the engine", lambda: _ens_inputs(max_tokens=100_000), "max_seq_len"),
    ("prompt beyond max_input_len", lambda: _ens_inputs(prompt="x = 1\n" * 200), "max_input_len"),
    ("wrong dtype", lambda: _ens_inputs(max_tokens=None) + [_tensor("max_tokens", np.array([[8.0]], np.float32), "FP32")],
     "max_tokens"),
])
def test_bad_requests_get_clear_errors(served, case, inputs, message):
    for model in ("ensemble", "tensorrt_llm_bls"):
        responses, err = stream_call(served["url"], model, inputs())
        assert err is not None, (model, case)
        assert message in str(err), (model, case, str(err))
    _assert_still_serving(served)


def test_wrong_call_kinds(served):
    url = served["url"]
    client = grpcclient.InferenceServerClient(url)
    try:
        with pytest.raises(InferenceServerException, match="decoupled"):
            client.infer("ensemble", _ens_inputs())
    finally:
        client.close()
    with pytest.raises(InputError, match="decoupled.*stream"):
        generate(url, "def main(", max_tokens=4, unary=True)
    # HTTP generate needs exactly one response: a streamed request is answered with an error body, or,
    # when the model merged every token into one response (tokens that pile up while the sender is
    # behind are sent together), with that one response, which then holds the whole completion.
    body = json.dumps({"text_input": "def main(", "max_tokens": 4, "stream": True}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(served["server"].endpoints.http
                                                           + "/v2/models/ensemble/generate", data=body), timeout=30) as r:
            answer = json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        answer = json.loads(e.read().decode())
    if "error" in answer:
        assert "exactly 1 response" in answer["error"], answer
    else:
        assert answer["text_output"] == served["ref"].text("def main(", 4), answer
    _assert_still_serving(served)


def test_stop_words_through_ensemble(served):
    ref = served["ref"]
    ids, gen = ref.ids(PROMPTS[0]), ref.tokens(PROMPTS[0], 24)
    # A generated token whose text encodes back to exactly that token, so the stop word matches it.
    k = next(i for i in range(2, len(gen)) if ref.tok.encode(ref.tok.decode([gen[i]]), add_special_tokens=False) == [gen[i]])
    word = ref.tok.decode([gen[k]])
    first = gen.index(gen[k])
    head = ref.tok.decode(ids, skip_special_tokens=True)
    want = ref.tok.decode(ids + gen[: first + 1], skip_special_tokens=True)[len(head):]
    r = generate(served["url"], PROMPTS[0], max_tokens=24, stop_words=[word])
    assert r.text == want and want.endswith(word)


def test_log_probs_and_penalties_through_tensorrt_llm(served):
    """return_log_probs with a repetition and a presence penalty, through the tensorrt_llm model: the
    engine's own tokens and log-probabilities for the same SamplingParams; streamed, each response
    carries its tokens' log-probs and the running cum_log_probs."""
    ref = served["ref"]
    ids = ref.ids(PROMPTS[1])
    n = 16
    with ref.lock:
        s = ref.engine.start(ids, SamplingParams(max_new_tokens=n, end_id=ref.tok.eos_token_id, repetition_penalty=1.7,
                                                 presence_penalty=0.5, return_log_probs=True))
        while not s.finished:
            ref.engine.step([s])
    plain = ref.tokens(PROMPTS[1], n)
    assert s.tokens != plain and len(s.log_probs) == len(s.tokens)
    inputs = _llm_inputs(ids, n, ref.tok.eos_token_id, repetition_penalty=(np.array([[1.7]], np.float32), "FP32"),
                         presence_penalty=(np.array([[0.5]], np.float32), "FP32"), return_log_probs=_TRUE,
                         streaming=_FALSE)
    responses, err = stream_call(served["url"], "tensorrt_llm", inputs)
    assert err is None and len(responses) == 1
    r = responses[0]
    assert r.as_numpy("output_ids").reshape(-1).tolist() == ids + s.tokens
    lp = r.as_numpy("output_log_probs")
    assert lp.shape == (1, 1, len(s.tokens)) and np.allclose(lp.reshape(-1), s.log_probs, atol=1e-5)
    assert r.as_numpy("cum_log_probs").shape == (1, 1)
    assert float(r.as_numpy("cum_log_probs")[0, 0]) == pytest.approx(s.cum_log_prob, abs=1e-4)
    inputs[-1] = _tensor("streaming", np.array([[True]]), "BOOL")
    responses, err = stream_call(served["url"], "tensorrt_llm", inputs)
    assert err is None
    parts = [(r.as_numpy("output_ids").reshape(-1).tolist(), r.as_numpy("output_log_probs").reshape(-1).tolist(),
              float(r.as_numpy("cum_log_probs")[0, 0])) for r in responses if r.as_numpy("output_ids") is not None]
    assert [t for p in parts for t in p[0]] == s.tokens
    assert all(len(p[0]) == len(p[1]) for p in parts)
    assert np.allclose([x for p in parts for x in p[1]], s.log_probs, atol=1e-5)
    assert parts[-1][2] == pytest.approx(s.cum_log_prob, abs=1e-4)
    assert parts[0][2] == pytest.approx(sum(parts[0][1]), abs=1e-4)
    # Without return_log_probs the response carries no log-probs (and the tokens are plain greedy).
    responses, err = stream_call(served["url"], "tensorrt_llm", inputs[:4] + [_tensor("streaming", np.array([[False]]), "BOOL")])
    assert err is None and responses[0].as_numpy("output_log_probs") is None
    assert responses[0].as_numpy("output_ids").reshape(-1).tolist()[len(ids):] == plain


def _engine_run(ref, ids, **params):
    with ref.lock:
        s = ref.engine.start(ids, SamplingParams(end_id=ref.tok.eos_token_id, **params))
        while not s.finished:
            ref.engine.step([s])
    return s


def _final_flag(res) -> bool:
    return res.get_response().parameters["triton_final_response"].bool_param


def test_num_return_sequences_stream_through_tensorrt_llm(served):
    """num_return_sequences 3, sampled, streamed: each sequence streams its own tokens under its
    sequence_index, sequence i being what the engine generates with seed + i; FINAL comes once, on
    the last response, after every sequence's last token."""
    ref = served["ref"]
    ids, n, seed = ref.ids(PROMPTS[4]), 10, 11
    want = [_engine_run(ref, ids, max_new_tokens=n, temperature=1.3, top_k=20, seed=seed + i).tokens for i in range(3)]
    assert len({tuple(w) for w in want}) > 1
    inputs = _llm_inputs(ids, n, ref.tok.eos_token_id, runtime_top_k=(np.array([[20]], np.int32), "INT32"),
                         temperature=(np.array([[1.3]], np.float32), "FP32"),
                         seed=(np.array([[seed]], np.uint64), "UINT64"),
                         num_return_sequences=(np.array([[3]], np.int32), "INT32"), streaming=_TRUE)
    responses, err = stream_call(served["url"], "tensorrt_llm", inputs)
    assert err is None
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for r in responses:
        if r.as_numpy("output_ids") is None:
            continue
        idx = r.as_numpy("sequence_index")
        assert idx is not None and idx.shape == (1, 1)
        got[int(idx[0, 0])] += r.as_numpy("output_ids").reshape(-1).tolist()
    assert [got[i] for i in range(3)] == want
    assert [_final_flag(r) for r in responses] == [False] * (len(responses) - 1) + [True]
    assert len(responses) >= 3 * 2  # streamed: more than one response per sequence


def test_num_return_sequences_through_bls_and_ensemble(served):
    """Greedy num_return_sequences 2 through the ensemble and BLS, streamed: both sequences are the
    greedy completion, each text assembled from its own sequence_index's responses."""
    ref = served["ref"]
    prompt, n = PROMPTS[0], 8
    for model in ("ensemble", "tensorrt_llm_bls"):
        inputs = [_tensor("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
                  _tensor("max_tokens", np.array([[n]], np.int32), "INT32"),
                  _tensor("num_return_sequences", np.array([[2]], np.int32), "INT32"),
                  _tensor("stream", np.array([[True]]), "BOOL")]
        responses, err = stream_call(served["url"], model, inputs)
        assert err is None, (model, err)
        texts = {0: "", 1: ""}
        for r in responses:
            if r.as_numpy("text_output") is None:
                continue
            texts[int(r.as_numpy("sequence_index").reshape(-1)[0])] += r.as_numpy("text_output").reshape(-1)[0].decode()
        assert texts == {0: ref.text(prompt, n), 1: ref.text(prompt, n)}, model


def _beam_inputs(ids, n, end_id, *, streaming=False):
    return _llm_inputs(ids, n, end_id, beam_width=(np.array([[2]], np.int32), "INT32"), return_log_probs=_TRUE,
                       streaming=_TRUE if streaming else _FALSE)


def test_beam_search_through_tensorrt_llm(served):
    """beam_width 2: one response per request carrying both ranked beams, as TensorRT-LLM's backend
    returns them (output_ids [1, 2, len] with the prompt and -1 padding, sequence_length [1, 2],
    cum_log_probs [1, 2], output_log_probs [1, 2, len]), equal to the engine's own beam search;
    streamed, every response carries each beam's tokens so far and the last one the result."""
    ref = served["ref"]
    ids, n, eos = ref.ids(PROMPTS[1]), 12, ref.tok.eos_token_id
    want = _engine_run(ref, ids, max_new_tokens=n, beam_width=2, return_log_probs=True).results()
    responses, err = stream_call(served["url"], "tensorrt_llm", _beam_inputs(ids, n, eos))
    assert err is None, err
    (r,) = [r for r in responses if r.as_numpy("output_ids") is not None]
    out, lens = r.as_numpy("output_ids"), r.as_numpy("sequence_length")
    assert out.shape[:2] == (1, 2) and lens.shape == (1, 2)
    for i, h in enumerate(want):
        assert out[0, i, :lens[0, i]].tolist() == ids + h.tokens
        assert (out[0, i, lens[0, i]:] == -1).all()
    assert r.as_numpy("cum_log_probs") == pytest.approx(np.array([[h.cum_log_prob for h in want]]), abs=1e-4)
    lps = r.as_numpy("output_log_probs")
    assert lps.shape[:2] == (1, 2) and lps[0, 0, :len(want[0].tokens)] == pytest.approx(want[0].log_probs, abs=1e-4)
    responses, err = stream_call(served["url"], "tensorrt_llm", _beam_inputs(ids, n, eos, streaming=True))
    assert err is None, err
    data = [r for r in responses if r.as_numpy("output_ids") is not None]
    assert len(data) > 1 and all(r.as_numpy("output_ids").shape[:2] == (1, 2) for r in data)
    # generated tokens only; the first response came before the end (one sent while the sender was
    # behind may carry several steps)
    assert data[0].as_numpy("output_ids").shape[2] < n
    last, lens = data[-1].as_numpy("output_ids"), data[-1].as_numpy("sequence_length")
    assert [last[0, i, :lens[0, i]].tolist() for i in range(2)] == [h.tokens for h in want]
    assert [_final_flag(r) for r in responses] == [False] * (len(responses) - 1) + [True]
    # num_return_sequences n <= K: the best n beams in the one response; sequence_index 0 when n > 1.
    for n_ret in (1, 2):
        inputs = _beam_inputs(ids, n, eos) + [_tensor("num_return_sequences", np.array([[n_ret]], np.int32), "INT32"),
                                              _tensor("exclude_input_in_output", np.array([[True]]), "BOOL")]
        responses, err = stream_call(served["url"], "tensorrt_llm", inputs)
        assert err is None, err
        (r,) = [r for r in responses if r.as_numpy("output_ids") is not None]
        lens = r.as_numpy("sequence_length")
        assert [r.as_numpy("output_ids")[0, i, :lens[0, i]].tolist() for i in range(n_ret)] == \
            [h.tokens for h in want[:n_ret]]
        idx = r.as_numpy("sequence_index")
        assert (idx is None) if n_ret == 1 else (idx.tolist() == [[0]])
    # Generation logits (unstreamed): [1, K, max_tokens, vocab], each cache slot's raw rows, the
    # prompt's last position first for every slot; what the engine itself records.
    seq = _engine_run(ref, ids, max_new_tokens=n, beam_width=2, return_generation_logits=True)
    inputs = _beam_inputs(ids, n, eos) + [_tensor("return_generation_logits", np.array([[True]]), "BOOL")]
    responses, err = stream_call(served["url"], "tensorrt_llm", inputs)
    assert err is None, err
    (r,) = [r for r in responses if r.as_numpy("output_ids") is not None]
    g = r.as_numpy("generation_logits")
    steps = seq.beam_generation_logits.shape[1]
    assert g.shape == (1, 2, n, ref.engine.vocab_size)
    assert np.allclose(g[0, :, :steps], seq.beam_generation_logits.numpy(), atol=1e-4) and not g[0, :, steps:].any()


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_beam_search_text_through_ensemble_and_bls(served, model):
    """Through the ensemble and BLS, text_output holds one string per beam, best first (the prompt
    leading it, as upstream's default exclude_input_in_output false has it)."""
    ref = served["ref"]
    prompt, n = PROMPTS[1], 10
    want = _engine_run(ref, ref.ids(prompt), max_new_tokens=n, beam_width=2).results()
    texts = [ref.tok.decode(ref.ids(prompt) + h.tokens, skip_special_tokens=True) for h in want]
    inputs = [_tensor("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
              _tensor("max_tokens", np.array([[n]], np.int32), "INT32"),
              _tensor("beam_width", np.array([[2]], np.int32), "INT32")]
    responses, err = stream_call(served["url"], model, inputs)
    assert err is None, (model, err)
    (r,) = [r for r in responses if r.as_numpy("text_output") is not None]
    assert [t.decode() for t in r.as_numpy("text_output").reshape(-1)] == texts
    # Stop words reach the search: each beam ends at its own first newline.
    nl = ref.tok.encode("\n", add_special_tokens=False)
    want = _engine_run(ref, ref.ids(prompt), max_new_tokens=n, beam_width=2, stop_words=[nl]).results()
    assert all(h.tokens[-len(nl):] == nl for h in want)
    texts = [ref.tok.decode(ref.ids(prompt) + h.tokens, skip_special_tokens=True) for h in want]
    responses, err = stream_call(served["url"], model, inputs + [
        _tensor("stop_words", np.array([[b"\n"]], dtype=object), "BYTES")])
    assert err is None, (model, err)
    (r,) = [r for r in responses if r.as_numpy("text_output") is not None]
    assert [t.decode() for t in r.as_numpy("text_output").reshape(-1)] == texts
    # A width the engine was not built for is refused with TensorRT-LLM's wording.
    inputs[-1] = _tensor("beam_width", np.array([[3]], np.int32), "INT32")
    _, err = stream_call(served["url"], model, inputs)
    assert err is not None and "Requested beam width 3 is larger than configured max beam width 2" in str(err)


def test_context_and_generation_logits_through_tensorrt_llm(served):
    """return_context_logits / return_generation_logits on an engine built with both gather flags:
    context_logits [1, prompt, vocab] = the prompt's whole-sequence logits; generation_logits the raw
    logits of each step (before the repetition penalty this request also sets), unstreamed
    [1, 1, max_tokens, vocab] with zero rows past the steps run, streamed [1, n, 1, vocab] per response."""
    ref = served["ref"]
    ids, n = ref.ids(PROMPTS[2]), 6
    s = _engine_run(ref, ids, max_new_tokens=n, repetition_penalty=1.5, return_generation_logits=True,
                    return_context_logits=True)
    V = ref.engine.vocab_size
    with ref.lock:
        whole = ref.engine.logits(__import__("torch").tensor([ids + s.tokens]))[0].numpy()
    want_gen = np.stack([g.numpy() for g in s.generation_logits])
    assert np.allclose(want_gen, whole[len(ids) - 1:len(ids) - 1 + len(s.generation_logits)], atol=1e-4)
    base = _llm_inputs(ids, n + 4, ref.tok.eos_token_id, repetition_penalty=(np.array([[1.5]], np.float32), "FP32"),
                       return_context_logits=_TRUE, return_generation_logits=_TRUE)
    # max tokens n + 4: the engine run above stopped at n; this one goes on, its first n agree
    responses, err = stream_call(served["url"], "tensorrt_llm", base + [_tensor("streaming", np.array([[False]]), "BOOL")])
    assert err is None and len(responses) == 1
    r = responses[0]
    toks = r.as_numpy("output_ids").reshape(-1).tolist()[len(ids):]
    assert toks[:n] == s.tokens
    ctx = r.as_numpy("context_logits")
    assert ctx.dtype == np.float32 and ctx.shape == (1, len(ids), V)
    assert np.allclose(ctx[0], whole[:len(ids)], atol=1e-4)
    gen = r.as_numpy("generation_logits")
    assert gen.shape == (1, 1, n + 4, V)
    assert np.allclose(gen[0, 0, :n], want_gen[:n], atol=1e-4)
    assert not np.any(gen[0, 0, len(toks) + 1:])  # past the steps run (at most one more: an end id)
    responses, err = stream_call(served["url"], "tensorrt_llm", base + [_tensor("streaming", np.array([[True]]), "BOOL")])
    assert err is None
    parts = [(r.as_numpy("output_ids").reshape(-1).tolist(), r.as_numpy("generation_logits"), r.as_numpy("context_logits"))
             for r in responses if r.as_numpy("output_ids") is not None]
    assert [t for p in parts for t in p[0]] == toks
    for tk, g, c in parts:
        assert g.shape == (1, len(tk), 1, V) and c.shape == (1, len(ids), V)
    streamed = np.concatenate([g[0, :, 0] for _, g, _ in parts])
    assert np.allclose(streamed, gen[0, 0, :len(toks)], atol=1e-5)


def test_batched_request_mixing_logits_and_plain_rows_ends_with_one_final(served):
    """A batched, streamed request whose first prompt returns generation logits and whose second
    does not: each prompt streams its own greedy tokens, and FINAL comes once, on the very last
    response (nothing arrives after it), whichever prompt finishes last."""
    ref = served["ref"]
    ids = ref.ids(PROMPTS[0])
    for n0, n1 in ((3, 4), (4, 3), (4, 4)):
        want = [_engine_run(ref, ids, max_new_tokens=n).tokens for n in (n0, n1)]
        inputs = [_tensor("input_ids", np.array([ids, ids], np.int32), "INT32"),
                  _tensor("input_lengths", np.array([[len(ids)]] * 2, np.int32), "INT32"),
                  _tensor("request_output_len", np.array([[n0], [n1]], np.int32), "INT32"),
                  _tensor("end_id", np.array([[ref.tok.eos_token_id]] * 2, np.int32), "INT32"),
                  _tensor("return_generation_logits", np.array([[True], [False]]), "BOOL"),
                  _tensor("streaming", np.array([[True], [True]]), "BOOL")]
        client = grpcclient.InferenceServerClient(served["url"])
        q: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        try:
            client.async_stream_infer("tensorrt_llm", inputs, enable_empty_final_response=True)
            responses = []
            while not responses or not _final_flag(responses[-1]):
                res, err = q.get(timeout=60)
                assert err is None, err.message()
                responses.append(res)
            with pytest.raises(queue.Empty):  # nothing after the final response
                q.get(timeout=1.0)
        finally:
            client.stop_stream()
            client.close()
        got: dict[int, list[int]] = {0: [], 1: []}
        for r in responses:
            if r.as_numpy("output_ids") is None:
                continue
            row = int(r.as_numpy("batch_index")[0, 0])
            toks = r.as_numpy("output_ids").reshape(-1).tolist()
            assert (r.as_numpy("generation_logits") is not None) == (row == 0)
            got[row] += toks
        assert [got[0], got[1]] == want
        assert [_final_flag(r) for r in responses] == [False] * (len(responses) - 1) + [True]


def test_bad_words_and_embedding_bias_through_ensemble(served):
    """The ensemble's bad_words and embedding_bias_words/weights reach the engine via preprocessing."""
    ref = served["ref"]
    gen = ref.tokens(PROMPTS[0], 12)
    # A generated token whose text encodes back to exactly that token.
    k = next(i for i in range(len(gen)) if ref.tok.encode(ref.tok.decode([gen[i]]), add_special_tokens=False) == [gen[i]])
    word = ref.tok.decode([gen[k]])
    responses, err = stream_call(served["url"], "ensemble", _ens_inputs(
        PROMPTS[0], 12, bad_words=(np.array([[word.encode()]], dtype=object), "BYTES"),
        return_log_probs=(np.array([[True]]), "BOOL")))
    assert err is None
    out = responses[0].as_numpy("output_log_probs")
    assert out is not None and out.size >= 1 and np.all(out <= 0)
    with ref.lock:
        want = ref.engine.generate(ref.ids(PROMPTS[0]), SamplingParams(max_new_tokens=12, end_id=ref.tok.eos_token_id,
                                                                      bad_words=[[gen[k]]]))
    assert gen[k] not in want
    text = responses[0].as_numpy("text_output").reshape(-1)[0].decode()  # the prompt is included
    assert text == ref.tok.decode(ref.ids(PROMPTS[0]) + want, skip_special_tokens=True)
    # A large bias on one word forces it.
    responses, err = stream_call(served["url"], "ensemble", _ens_inputs(
        PROMPTS[0], 4, embedding_bias_words=(np.array([[word.encode()]], dtype=object), "BYTES"),
        embedding_bias_weights=(np.array([[1e4]], np.float32), "FP32")))
    assert err is None
    assert responses[0].as_numpy("text_output").reshape(-1)[0].decode().endswith(word * 4)


def test_cancelled_stream_stops_generation(served):
    """A client that cancels its stream frees the batch slot: the engine stops generating for it.

    The request asks for the whole context (~0.5-1 s of decode on a CPU) so that it is still running
    when the cancel, polled about every 0.1 s, reaches the batcher."""
    metrics_url = served["server"].endpoints.metrics
    total = lambda: sum(v for _, v in scrape(metrics_url)["trtmoe_generated_tokens_total"])  # noqa: E731
    before = wait_settled(total, what="generated-token counter before the request")
    want = SERVED_MAX_SEQ_LEN - 4
    client = grpcclient.InferenceServerClient(served["url"])
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    inputs = [_tensor("input_ids", np.array([[1, 5, 9, 12]], np.int32), "INT32"),
              _tensor("input_lengths", np.array([[4]], np.int32), "INT32"),
              _tensor("request_output_len", np.array([[want]], np.int32), "INT32"),
              _tensor("min_tokens", np.array([[want]], np.int32), "INT32"),
              _tensor("streaming", np.array([[True]]), "BOOL")]
    client.async_stream_infer("tensorrt_llm", inputs)
    for _ in range(2):
        assert q.get(timeout=60)[1] is None
    client.stop_stream(cancel_requests=True)
    client.close()
    generated = wait_settled(total, what="generated-token counter after the cancel") - before
    assert 2 <= generated < want, generated
    _assert_still_serving(served)


def test_generate_command(served):
    from click.testing import CliRunner

    from trtmoe.cli import TrtmoeGroup

    group = TrtmoeGroup(commands={c.name: c for c in commands.COMMANDS})
    out = CliRunner().invoke(group, ["generate", "def main(", "-n", "12", "--url", served["url"], "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["text"] == served["ref"].text("def main(", 12) and data["streamed"]
    bad = CliRunner().invoke(group, ["generate", "def main(", "--url", served["url"], "--unary"])
    assert bad.exit_code == 2 and "decoupled" in bad.output
    # Beam search: every beam's completion, best first (streamed responses each re-send every beam).
    ref = served["ref"]
    want = [ref.tok.decode(h.tokens, skip_special_tokens=True)
            for h in _engine_run(ref, ref.ids(PROMPTS[1]), max_new_tokens=10, beam_width=2).results()]
    for extra in ([], ["--model", "tensorrt_llm_bls"]):
        out = CliRunner().invoke(group, ["generate", PROMPTS[1], "-n", "10", "--url", served["url"], "--beam-width", "2",
                                         "--json", *extra])
        assert out.exit_code == 0, out.output
        data = json.loads(out.output)
        assert data["beams"] == want and data["text"] == want[0], extra
    out = CliRunner().invoke(group, ["generate", PROMPTS[1], "-n", "10", "--url", served["url"], "--beam-width", "2"])
    assert out.exit_code == 0 and f"--- beam 0\n{want[0]}\n--- beam 1\n{want[1]}\n" in out.output, out.output


def test_example_client_script(served):
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "example_client.py"), "def main(",
                          "--max-tokens", "12", "--url", served["url"]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == served["ref"].text("def main(", 12) + "\n"


def test_streamed_multibyte_characters_arrive_whole(served):
    """A seeded sample whose text ends in a 3-byte character ('“', three byte tokens for this
    vocabulary): streamed through the ensemble (each response decoded alone) it arrives whole."""
    ref = served["ref"]
    prompt, n = "# 日本語 ", 24
    ids = ref.ids(prompt)
    with ref.lock:
        toks = ref.engine.generate(ids, SamplingParams(max_new_tokens=n, temperature=1.5, seed=32,
                                                       end_id=ref.tok.eos_token_id))
    want = ref.tok.decode(ids + toks, skip_special_tokens=True)[len(ref.tok.decode(ids, skip_special_tokens=True)):]
    assert "\u201c" in want and any("\ufffd" in ref.tok.decode([t]) for t in toks), "fixture behaviour changed"
    # top_p turns sampling on (as in TensorRT-LLM, a bare temperature stays greedy).
    r = generate(served["url"], prompt, max_tokens=n, temperature=1.5, top_p=1.0, seed=32)
    assert r.streamed and r.text == want
    assert not any("\ufffd" in p for p in r.pieces)


def test_stream_interval_server(served, tmp_path):
    """A repository generated with stream_interval 4 serves the same text in fewer responses: the first
    token alone, then four tokens per response."""
    repo = generate_repository(served["repo"].engine.path, tmp_path / "repo", stream_interval=4,
                               torch_num_threads=1, streaming=True)
    server = serve_repository(repo.path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=240)
    try:
        assert len(served["ref"].tokens("def main(", 17)) == 17  # no end token on the way
        extra = {"return_num_output_tokens": np.array([[True]], dtype=bool)}
        r = generate(server.endpoints.grpc, "def main(", max_tokens=17, extra=extra)
        assert r.text == served["ref"].text("def main(", 17)
        # The first token alone, then bursts of four; bursts the sender was behind on go out merged
        # (CI once saw [1, 9, 13, 17]), so only whole bursts may join.
        counts = r.output_token_counts
        assert counts[0] == 1 and counts[-1] == 17 and 2 <= len(counts) <= 5, counts
        assert all((b - a) % 4 == 0 for a, b in zip(counts, counts[1:])), counts
        assert r.text == "".join(r.pieces) and len(r.pieces) == len(counts)
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_prompt_of_megabytes_is_refused_before_tokenizing(served, model):
    """preprocessing refuses a 2 MB text_input on its byte length, at once (tokenizing it first held
    the one preprocessing instance for seconds); the server answers on, and the repository it serves
    still verifies (the bytecode caches the Python backend writes into it are not artifact files)."""
    ep = served["server"].endpoints
    body = json.dumps({"text_input": "def main(" + "x = 1\n" * (2 * 2**20 // 6), "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://{ep.host}:{ep.http_port}/v2/models/{model}/generate", data=body,
                                 method="POST")
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and "refused before tokenizing" in e.value.read().decode()
    assert time.monotonic() - t0 < 2.0
    assert served["server"].failure is None and served["server"].is_alive()
    verify_artifact(served["repo"].path)  # with the __pycache__ the Python backend wrote into it


def test_an_oversized_http_body_is_answered_413_before_tritonserver_reads_it(served):
    """Bodies over the front's limit (3 MiB; tritonserver 2.51 can crash on 4 MB) get 413 at once,
    with Content-Length or chunked; the server lives on and answers the next request."""
    srv = served["server"]
    ep = srv.endpoints
    url = f"http://{ep.host}:{ep.http_port}/v2/models/ensemble/generate"
    refused = srv.front.refused
    body = json.dumps({"text_input": "def main(", "max_tokens": 4, "pad": "x" * (4 * 2**20)}).encode()
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=60)
    assert e.value.code == 413 and "limit of 3145728 bytes" in e.value.read().decode()
    chunks = (body[i:i + 2**20] for i in range(0, len(body), 2**20))
    req = urllib.request.Request(url, data=chunks, method="POST", headers={"Transfer-Encoding": "chunked"})
    with pytest.raises((urllib.error.HTTPError, ConnectionError)) as e:
        urllib.request.urlopen(req, timeout=60)
    assert time.monotonic() - t0 < 10 and srv.front.refused == refused + 2
    assert srv.failure is None and srv.is_alive()
    ok = json.dumps({"text_input": "def main(", "max_tokens": 4}).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=ok, method="POST"), timeout=60) as r:
        assert json.loads(r.read())["text_output"]


def test_stop_leaves_no_process(served):
    """Runs last in this module: stopping the server ends tritonserver and every Python stub."""
    srv = served["server"]
    pgid = srv.process.pid
    rc = srv.stop()
    assert rc == 0, srv.log_tail()  # a clean shutdown: every model finalized within the exit timeout
    deadline = time.time() + 10
    while True:
        ps = subprocess.run(["ps", "-o", "pid=,stat=,cmd=", "-g", str(pgid)], capture_output=True, text=True).stdout
        alive = [line for line in ps.splitlines() if line.split()[1][0] != "Z"]  # zombies are already dead
        if not alive or time.time() > deadline:
            break
        time.sleep(0.2)
    assert not alive, "processes left in the server's group:\n" + "\n".join(alive)


@pytest.mark.slow
def test_serve_command_sigterm(served, tmp_path):
    """`serve` in the foreground: prints endpoints when ready, exits 0 on SIGTERM, leaves nothing behind."""
    proc, ready = start_serve_command(served["repo"].path, tmp_path / "server.log")
    try:
        url = ready.split("gRPC ")[1].split()[0]
        assert generate(url, "def main(", max_tokens=4).text == served["ref"].text("def main(", 4)
        # The server this command started (the module's own server serves the same repository).
        server_pid = int(subprocess.run(["pgrep", "-P", str(proc.pid), "tritonserver"], capture_output=True,
                                        text=True).stdout.split()[0])
        group = os.getpgid(server_pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True)
    assert out.stdout.strip() == "", "processes left in the server's group: " + out.stdout


def test_failed_model_load_is_reported_with_log(tmp_path):
    """A model that fails to load: serve_repository says which and why, shows the log, stops the server."""
    from trtmoe.errors import BackendUnavailable

    model = tmp_path / "repo" / "broken"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('name: "broken"\nbackend: "python"\nmax_batch_size: 1\n'
                                        'input [ { name: "x" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
                                        'output [ { name: "y" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')
    (model / "1" / "model.py").write_text("class TritonPythonModel:\n    def initialize(self, args):\n"
                                          "        raise ValueError('engine directory is gone')\n")
    with pytest.raises(BackendUnavailable) as e:
        serve_repository(tmp_path / "repo", http_port=0, grpc_port=0, metrics_port=0, timeout_s=120)
    msg = str(e.value)
    assert "broken" in msg and "engine directory is gone" in msg and "log tail" in msg


def test_busy_port_is_refused(tmp_path):
    import socket

    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(InputError, match=f"grpc port {port}"):
            serve_repository(tmp_path / "repo", http_port=0, grpc_port=port, metrics_port=0)


def test_one_port_for_two_endpoints_is_refused(tmp_path):
    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"\n')
    with pytest.raises(InputError, match="port 18123 is given for more than one endpoint"):
        serve_repository(tmp_path / "repo", http_port=18123, grpc_port=0, metrics_port=18123)


def test_free_ports_are_distinct_and_avoid_the_given_ones():
    """Ports chosen for one server never repeat, nor take a port given for another endpoint (the
    kernel hands the same ephemeral port out twice when each probe closes before the next)."""
    from trtmoe.triton.serve import free_ports

    for _ in range(200):
        ports = free_ports(3)
        assert len(set(ports)) == 3
    avoid = free_ports(2)
    for _ in range(50):
        assert not set(free_ports(2, avoid=avoid)) & set(avoid)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_workspaces_of_dead_launchers_are_removed(tmp_path):
    """Workspaces of launchers that are gone are removed, except a failed start's log-only workspace
    younger than the kept-log period; live launchers' and foreign directories are left alone."""
    from trtmoe.triton.serve import WORKSPACE_PREFIX, remove_stale_workspaces

    dead = _dead_pid()
    made = {}
    for key, pid, files in [("dead_backends", dead, ["backends/python/libtriton_python.so", "tritonserver.log"]),
                            ("dead_fresh_log", dead, ["tritonserver.log"]),
                            ("dead_old_log", dead, ["tritonserver.log"]),
                            ("live", os.getpid(), ["backends/x"])]:
        d = tmp_path / f"{WORKSPACE_PREFIX}{pid}-{key}"
        for f in files:
            (d / f).parent.mkdir(parents=True, exist_ok=True)
            (d / f).write_text("x")
        made[key] = d
    old = time.time() - 8 * 86400
    os.utime(made["dead_old_log"], (old, old))
    foreign = tmp_path / f"{WORKSPACE_PREFIX}abcdef12"  # no launcher pid in the name: not ours to judge
    foreign.mkdir()
    removed = remove_stale_workspaces(tmp_path)
    assert sorted(removed) == sorted([made["dead_backends"], made["dead_old_log"]])
    assert made["dead_fresh_log"].is_dir() and made["live"].is_dir() and foreign.is_dir()
    assert not made["dead_backends"].exists() and not made["dead_old_log"].exists()


@pytest.mark.slow
def test_sigkilled_serve_leaves_a_workspace_the_next_start_removes(served, tmp_path, monkeypatch):
    """SIGKILL the `serve` launcher: the server goes with it (parent-death signal), its copied
    backends stay in the temp directory until the next start, which removes them."""
    from trtmoe.triton.serve import WORKSPACE_PREFIX, remove_stale_workspaces

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    proc, _ = start_serve_command(served["repo"].path, tmp_path / "server.log")
    server_pid = int(subprocess.run(["pgrep", "-P", str(proc.pid), "tritonserver"], capture_output=True,
                                    text=True).stdout.split()[0])
    group = os.getpgid(server_pid)
    workspace = next(tmpdir.glob(f"{WORKSPACE_PREFIX}{proc.pid}-*"))
    proc.kill()
    proc.wait(30)
    deadline = time.monotonic() + 60
    while subprocess.run(["pgrep", "-g", str(group)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the server outlived its killed launcher"
        time.sleep(0.2)
    assert (workspace / "backends").is_dir()  # what a killed launcher leaves
    assert remove_stale_workspaces(tmpdir) == [workspace] and not workspace.exists()
