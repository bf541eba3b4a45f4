"""The embedded engine's extra outputs (TensorRT-LLM's return_context_logits / return_generation_logits)
and num_return_sequences, on the trained Mixtral fixture; and their parsing from the tensorrt_llm
model's inputs (seeds of the extra sequences, refusals)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from conftest import TRAINED_MIXTRAL, float_engine, request_getter, require_fixture

from trtmoe.runtime.engine import SamplingParams
from trtmoe.triton.llm_request import EngineLimits, RequestError, parse_requests

FIXTURE = require_fixture(TRAINED_MIXTRAL)

PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef", "import os\n", "class Parser:\n    def __init__(self"]
N = 12


@pytest.fixture(scope="module")
def engine(tmp_path_factory, one_torch_thread):
    return float_engine(FIXTURE, tmp_path_factory, "outputs")


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(FIXTURE))
    return [tok.encode(p) for p in PROMPTS]


def _run(engine, seqs):
    while not all(s.finished for s in seqs):
        engine.step([s for s in seqs if not s.finished])
    return seqs


def test_context_logits_are_the_whole_sequence_forward(engine, prompts):
    """Batched prefill (different prompt lengths, padded): the rows that asked get their prompt's
    logits at every position, equal to a cache-free whole-sequence forward; the others get none,
    and nobody's tokens change."""
    want = [SamplingParams(max_new_tokens=N, return_context_logits=True), SamplingParams(max_new_tokens=N),
            SamplingParams(max_new_tokens=N, return_context_logits=True, temperature=0.8, top_k=5, seed=3)]
    seqs = _run(engine, engine.start_many(prompts, want))
    plain = _run(engine, engine.start_many(prompts, [SamplingParams(max_new_tokens=N),
                                                       SamplingParams(max_new_tokens=N),
                                                       SamplingParams(max_new_tokens=N, temperature=0.8, top_k=5,
                                                                      seed=3)]))
    assert [s.tokens for s in seqs] == [s.tokens for s in plain]
    assert seqs[1].context_logits is None
    for b in (0, 2):
        ref = engine.logits(torch.tensor([prompts[b]]))[0]
        got = seqs[b].context_logits
        assert got.shape == (len(prompts[b]), engine.vocab_size) and got.dtype == torch.float32
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()
    # One request alone (start) gives the same.
    one = engine.start(prompts[0], SamplingParams(max_new_tokens=1, return_context_logits=True))
    assert torch.allclose(one.context_logits, seqs[0].context_logits, atol=1e-5)


def test_generation_logits_are_what_the_sampler_saw(engine, prompts):
    """Each step's recorded row is the raw model logits (a whole-sequence forward's last position),
    before the embedding bias and penalties the sampler then applied: the greedy token of the
    processed row is the one chosen."""
    V = engine.vocab_size
    bias = torch.zeros(V)
    bias[torch.arange(0, V, 7)] = 2.5
    params = [SamplingParams(max_new_tokens=N, return_generation_logits=True),
              SamplingParams(max_new_tokens=N, return_generation_logits=True, repetition_penalty=1.6,
                             embedding_bias=bias)]
    seqs = _run(engine, engine.start_many(prompts[:2], params))
    for s, p, prompt in zip(seqs, params, prompts):
        assert len(s.generation_logits) == len(s.tokens) == N
        for i, row in enumerate(s.generation_logits):
            ref = engine.logits(torch.tensor([prompt + s.tokens[:i]]))[0, -1]
            assert torch.allclose(row, ref, atol=1e-4, rtol=1e-4), (i, (row - ref).abs().max())
            x = row.clone()
            if p.embedding_bias is not None:
                x = x + p.embedding_bias
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(V, dtype=torch.bool)
                seen[torch.tensor(prompt + s.tokens[:i])] = True
                x = torch.where(seen, torch.where(x < 0, x * p.repetition_penalty, x / p.repetition_penalty), x)
            assert int(x.argmax()) == s.tokens[i]
    assert seqs[0].tokens != seqs[1].tokens  # the processing did change the choice
    assert all(not s.generation_logits for s in _run(engine, [engine.start(prompts[0], SamplingParams(max_new_tokens=3))]))


def _limits(**kw):
    return EngineLimits(max_input_len=64, max_seq_len=256, vocab_size=32000, **kw)


def test_num_return_sequences_parse_into_seeded_sequences():
    """N sequences per prompt, sequence_index 0..N-1, seeds s + i (0 + i without a seed), as
    TensorRT-LLM's child requests."""
    get = request_getter(num_return_sequences=np.array([[3]], np.int32), runtime_top_k=np.array([[5]], np.int32),
                         seed=np.array([[41]], np.uint64))
    gens = parse_requests(get, _limits(), SamplingParams)
    assert [g.sequence_index for g in gens] == [0, 1, 2] and all(g.num_sequences == 3 for g in gens)
    assert [g.params.seed for g in gens] == [41, 42, 43] and all(g.params.top_k == 5 for g in gens)
    gens = parse_requests(request_getter(num_return_sequences=np.array([[2]], np.int32),
                                         runtime_top_k=np.array([[5]], np.int32)), _limits(), SamplingParams)
    assert [g.params.seed for g in gens] == [0, 1]
    # uint64 seeds wrap as TensorRT-LLM's unsigned addition does
    gens = parse_requests(request_getter(num_return_sequences=np.array([[2]], np.int32),
                                         seed=np.array([[2**64 - 1]], np.uint64)), _limits(), SamplingParams)
    assert [g.params.seed for g in gens] == [2**64 - 1, 0]
    # batched: each prompt gets its own N sequences
    get = request_getter(input_ids=np.array([[1, 5, 9], [2, 3, 4]], np.int32),
                         input_lengths=np.array([[3], [3]], np.int32), num_return_sequences=np.array([[2]], np.int32))
    gens = parse_requests(get, _limits(), SamplingParams)
    assert [(g.batch_index, g.sequence_index) for g in gens] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    one = parse_requests(request_getter(), _limits(), SamplingParams)
    assert len(one) == 1 and one[0].num_sequences == 1 and one[0].params.seed is None


@pytest.mark.parametrize("inputs, message", [
    (dict(num_return_sequences=np.array([[0]], np.int32)), "num_return_sequences must be >= 1"),
    (dict(num_return_sequences=np.array([[2]], np.int32), beam_width=np.array([[2]], np.int32)),
     "Requested beam width 2 is larger than configured max beam width 1"),
    (dict(return_context_logits=np.array([[True]])), "gather_context_logits"),
    (dict(return_generation_logits=np.array([[True]])), "gather_generation_logits"),
])
def test_refusals(inputs, message):
    with pytest.raises(RequestError, match=message) as e:
        parse_requests(request_getter(**inputs), _limits(), SamplingParams)
    assert "\n" not in str(e.value)


def test_num_return_sequences_needs_decoupled_model():
    get = request_getter(num_return_sequences=np.array([[2]], np.int32))
    with pytest.raises(RequestError, match="decoupled"):
        parse_requests(get, _limits(), SamplingParams, decoupled=False)
    assert len(parse_requests(get, _limits(), SamplingParams, decoupled=True)) == 2


def test_logits_flags_reach_the_params_when_the_engine_gathers_them():
    lim = _limits(gather_context_logits=True, gather_generation_logits=True)
    g = parse_requests(request_getter(return_context_logits=np.array([[True]]),
                                      return_generation_logits=np.array([[True]])), lim, SamplingParams)[0]
    assert g.params.return_context_logits and g.params.return_generation_logits
    g = parse_requests(request_getter(return_context_logits=np.array([[False]])), _limits(), SamplingParams)[0]
    assert not g.params.return_context_logits and not g.params.return_generation_logits


def test_sampled_sequences_equal_separate_requests_with_their_seeds(engine, prompts):
    """The parsed sequences of one request (seeds s + i) generate what N separate requests with
    those seeds generate, and differ from each other; greedy ones are all the same."""
    lim = EngineLimits(max_input_len=64, max_seq_len=256, vocab_size=engine.vocab_size)
    ids = np.array([prompts[1]], np.int32)
    base = dict(input_ids=ids, input_lengths=np.array([[ids.shape[1]]], np.int32),
                request_output_len=np.array([[N]], np.int32), num_return_sequences=np.array([[4]], np.int32))
    gens = parse_requests(lambda n: {**base, "runtime_top_k": np.array([[8]], np.int32),
                                     "temperature": np.array([[1.2]], np.float32),
                                     "seed": np.array([[100]], np.uint64)}.get(n), lim, SamplingParams)
    together = _run(engine, engine.start_many([g.prompt_ids for g in gens], [g.params for g in gens]))
    alone = [_run(engine, [engine.start(prompts[1], SamplingParams(max_new_tokens=N, temperature=1.2, top_k=8,
                                                                   seed=100 + i))])[0] for i in range(4)]
    assert [s.tokens for s in together] == [s.tokens for s in alone]
    assert len({tuple(s.tokens) for s in together}) > 1
    gens = parse_requests(lambda n: base.get(n), lim, SamplingParams)
    greedy = _run(engine, engine.start_many([g.prompt_ids for g in gens], [g.params for g in gens]))
    assert len({tuple(s.tokens) for s in greedy}) == 1
    assert greedy[0].tokens == engine.generate(prompts[1], SamplingParams(max_new_tokens=N))


def test_a_repeated_prompt_is_prefilled_once(engine, prompts):
    """start_many with one prompt four times (num_return_sequences' siblings) and another once:
    the repeated prompt is run through the model once (the routed-token count says so) and its
    other sequences start from a copy of that cache row: each sequence generates what it generates
    alone, context logits included."""
    params = [SamplingParams(max_new_tokens=N, temperature=1.1, top_k=8, seed=7 + i, return_context_logits=i == 2)
              for i in range(4)] + [SamplingParams(max_new_tokens=N)]
    batch = [prompts[1]] * 4 + [prompts[0]]
    engine.reset_routing_stats()
    together = engine.start_many(batch, params)
    assert engine.routing_stats()["tokens"] == len(prompts[1]) + len(prompts[0])
    _run(engine, together)
    alone = [_run(engine, [engine.start(p, sp)])[0] for p, sp in zip(batch, params)]
    assert [s.tokens for s in together] == [s.tokens for s in alone]
    assert len({tuple(s.tokens) for s in together[:4]}) > 1  # the copies decoded apart
    assert together[2].context_logits is not None and together[0].context_logits is None
    assert torch.allclose(together[2].context_logits, alone[2].context_logits, atol=1e-5)
    assert engine.kv_cache_stats()["live"] == 0


def test_a_sequence_collected_on_another_thread_leaves_the_pool_to_the_engine(engine):
    """A dropped sequence's finalizer runs wherever the collector runs (a server's sender or metrics
    thread): it must not touch the pooled KV cache there, since clearing an idle pool under a running
    forward once failed generations with "list index out of range". The engine applies the release
    on its own thread, before its next slot or step."""
    import gc
    import threading

    gc.collect()
    a = engine.start([1, 5, 9], SamplingParams(max_new_tokens=8))
    slot, pool = a.slot, engine._kv
    a.cycle = a  # only the cyclic collector frees it
    del a
    collected = threading.Thread(target=gc.collect)
    collected.start()
    collected.join()
    assert pool.live == 1 and pool.k, "the other thread changed the pool"
    assert engine.kv_cache_stats()["live"] == 0  # but it is no longer counted as live
    b = engine.start([1, 5, 10], SamplingParams(max_new_tokens=8))
    assert b.slot == slot and pool.live == 1  # released on the engine's thread, and reused
    while not b.finished:
        engine.step([b])
    assert pool.live == 0 and pool.k == []
