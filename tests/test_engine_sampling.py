"""The embedded engine's logit processing (TensorRT-LLM's runtime sampling options): embedding_bias,
repetition / presence / frequency penalties, bad words, and per-token log-probabilities, on the
trained Mixtral fixture; and their parsing from the tensorrt_llm model's inputs."""

from __future__ import annotations


import numpy as np
from conftest import TRAINED_MIXTRAL, float_engine, request_getter, require_fixture
import pytest
import torch

from trtmoe.errors import InputError
from trtmoe.runtime.engine import SamplingParams
from trtmoe.triton.llm_request import EngineLimits, parse_requests

FIXTURE = require_fixture(TRAINED_MIXTRAL)

# The trained fixture repeats itself under greedy decoding ("of the string of the string ..."),
# so penalties against repeats visibly change its output.
PROMPT_TEXT = "def add(a, b):\n    return a + b\n\n\ndef"
N = 32


@pytest.fixture(scope="module")
def engine(tmp_path_factory, one_torch_thread):
    return float_engine(FIXTURE, tmp_path_factory, "sampling")


@pytest.fixture(scope="module")
def prompt():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(FIXTURE)).encode(PROMPT_TEXT)


def _repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def _reference(engine, prompt, tokens, p: SamplingParams) -> list[torch.Tensor]:
    """The processed logits before each generated token, from whole-sequence forwards (no KV cache)
    and the rules written out again: bias, temperature, then penalties over prompt + generated ids,
    then the min_tokens end-id mask and bad words."""
    out = []
    V = engine.vocab_size
    for i in range(len(tokens) + 1):
        hist = prompt + tokens[:i]
        x = engine.logits(torch.tensor([hist]))[0, -1].float().clone()
        if p.embedding_bias is not None:
            x = x + p.embedding_bias
        t = p.temperature if p.temperature > 0 else p.greedy_temperature
        x = x / t
        counts = torch.zeros(V)
        for tok in hist:
            counts[tok] += 1
        for v in range(V):
            if counts[v] > 0:
                x[v] = x[v] * p.repetition_penalty if x[v] < 0 else x[v] / p.repetition_penalty
                x[v] = x[v] - p.presence_penalty - p.frequency_penalty * counts[v]
        if p.end_id is not None and i < p.min_tokens:
            x[p.end_id] = -float("inf")
        for w in p.bad_words:
            if len(w) == 1 or hist[-(len(w) - 1):] == w[:-1]:
                x[w[-1]] = -float("inf")
        out.append(x)
    return out


@pytest.mark.parametrize("opts", [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.7, frequency_penalty=0.3),
    dict(presence_penalty=1.5, greedy_temperature=0.5),
    dict(frequency_penalty=0.8, min_tokens=6, end_id=2),
    dict(temperature=0.9, top_k=8, seed=5, presence_penalty=0.5, repetition_penalty=1.2),
    dict(temperature=1.3, top_p=0.8, seed=11, frequency_penalty=0.4),
])
def test_each_token_follows_the_processed_logits(engine, prompt, opts):
    """Greedy rows pick the argmax of the processed logits; every row's log-probabilities are
    log_softmax of the processed logits (the full vocabulary, not renormalised over top-k/top-p) at the
    chosen token, and cum_log_prob is their sum."""
    n = 12
    p = SamplingParams(max_new_tokens=n, return_log_probs=True, **opts)
    s = engine.start(prompt, p)
    while not s.finished:
        engine.step([s])
    ref = _reference(engine, prompt, s.tokens[:-1], p)
    assert len(s.tokens) == n and len(s.log_probs) == n
    for i, tok in enumerate(s.tokens):
        x = ref[i]
        if p.temperature == 0:
            assert x[tok] >= x.max() - 1e-3, (i, tok, int(x.argmax()))
        assert s.log_probs[i] == pytest.approx(float(torch.log_softmax(x, -1)[tok]), abs=2e-3)
    assert s.cum_log_prob == pytest.approx(sum(s.log_probs), abs=1e-6)


def test_penalties_stop_the_greedy_repeats(engine, prompt):
    greedy = engine.generate(prompt, SamplingParams(max_new_tokens=N))
    assert _repeats(greedy) >= 8  # the fixture loops
    for opts in (dict(repetition_penalty=1e3), dict(presence_penalty=100.0), dict(frequency_penalty=100.0)):
        out = engine.generate(prompt, SamplingParams(max_new_tokens=N, **opts))
        assert len(out) == N and out != greedy
        # Every id of the prompt and of the tokens so far is pushed below every unseen one.
        seen = set(prompt)
        for t in out:
            assert t not in seen, opts
            seen.add(t)
    # A penalty that leaves the argmax alone: the same tokens as plain greedy.
    assert engine.generate(prompt, SamplingParams(max_new_tokens=N, frequency_penalty=1e-6)) == greedy


def test_bad_words_never_appear(engine, prompt):
    greedy = engine.generate(prompt, SamplingParams(max_new_tokens=N))
    single = greedy[2]
    pair = [greedy[5], greedy[6]]  # the model writes this pair; it must not write it now
    out = engine.generate(prompt, SamplingParams(max_new_tokens=N, bad_words=[[single], pair]))
    assert len(out) == N and single not in out
    full = prompt + out
    assert not any(full[i:i + 2] == pair for i in range(len(prompt) - 1, len(full) - 1))
    # A word whose prefix ends the prompt bans its last token as the first generated one.
    first = engine.generate(prompt, SamplingParams(max_new_tokens=1, bad_words=[[prompt[-1], greedy[0]]]))
    assert first != [greedy[0]]


def test_embedding_bias_forces_a_token(engine, prompt):
    bias = torch.zeros(engine.vocab_size)
    bias[77] = 1e4
    out = engine.generate(prompt, SamplingParams(max_new_tokens=6, embedding_bias=bias))
    assert out == [77] * 6
    # A negative bias on each greedy token moves the model off it.
    greedy = engine.generate(prompt, SamplingParams(max_new_tokens=4))
    bias = torch.zeros(engine.vocab_size)
    bias[greedy[0]] = -1e4
    assert engine.generate(prompt, SamplingParams(max_new_tokens=1, embedding_bias=bias.numpy()))[0] != greedy[0]


def test_end_id_log_prob_counts_in_cum_only(engine, prompt):
    """Stopping on the end id: the end id is no output token, so output log-probs stop before it,
    while the cumulative log-probability includes it (as TensorRT-LLM's sampler adds it)."""
    greedy = engine.generate(prompt, SamplingParams(max_new_tokens=N))
    end = greedy[3]
    s = engine.start(prompt, SamplingParams(max_new_tokens=N, end_id=end, return_log_probs=True))
    while not s.finished:
        engine.step([s])
    assert s.finish_reason == "stop" and s.tokens == greedy[:3] and len(s.log_probs) == 3
    x = _reference(engine, prompt, s.tokens, SamplingParams(max_new_tokens=N))[3]
    assert s.cum_log_prob == pytest.approx(sum(s.log_probs) + float(torch.log_softmax(x, -1)[end]), abs=2e-3)


def test_plain_greedy_rows_in_a_batch_with_processed_ones_are_unchanged(engine, prompt):
    """Only the rows that use an option leave the batched argmax; the others' tokens are those of
    plain greedy decoding alone."""
    prompts = [prompt, prompt[:-3], prompt[2:]]
    alone = [engine.generate(q, SamplingParams(max_new_tokens=10)) for q in prompts]
    ps = [SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=10, presence_penalty=50.0),
          SamplingParams(max_new_tokens=10)]
    seqs = engine.start_many(prompts, ps)
    while not all(s.finished for s in seqs):
        engine.step(seqs)
    assert seqs[0].tokens == alone[0] and seqs[2].tokens == alone[2]
    assert seqs[1].tokens != alone[1] and _repeats(seqs[1].tokens) == 0
    assert not ps[0].processed and ps[1].processed
    assert seqs[0].log_probs == [] and seqs[0]._counts is None  # nothing per row was computed


@pytest.mark.parametrize("opts, message", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=-2.0), "repetition_penalty must be > 0"),
    (dict(bad_words=[[5, 10**6]]), "bad word"),
    (dict(embedding_bias=torch.zeros(3)), "embedding_bias has shape"),
])
def test_invalid_values_are_refused(engine, prompt, opts, message):
    with pytest.raises(InputError, match=message):
        engine.start(prompt, SamplingParams(max_new_tokens=2, **opts))


LIMITS = EngineLimits(max_input_len=8, max_seq_len=16, vocab_size=250, default_end_id=2)
_getter = request_getter


def test_parse_request_passes_the_options_through():
    bias = np.zeros((1, 250), np.float32)
    bias[0, 7] = -5.0
    (g,) = parse_requests(_getter(
        repetition_penalty=np.array([[1.3]], np.float32), presence_penalty=np.array([[0.25]], np.float32),
        frequency_penalty=np.array([[-0.5]], np.float32), return_log_probs=np.array([[True]]),
        bad_words_list=np.array([[[7, 8, 9], [2, 3, -1]]], np.int32), embedding_bias=bias,
        temperature=np.array([[0.5]], np.float32)), LIMITS, SamplingParams)
    p = g.params
    assert p.repetition_penalty == pytest.approx(1.3) and p.presence_penalty == 0.25 and p.frequency_penalty == -0.5
    assert p.return_log_probs and p.bad_words == [[7, 8], [9]] and p.processed
    assert p.embedding_bias.shape == (250,) and float(p.embedding_bias[7]) == -5.0
    # Greedy (no top-k/top-p): the temperature is kept for the penalties' order only.
    assert p.temperature == 0.0 and p.greedy_temperature == 0.5
    # Neutral values, an empty or all-zero bias and an empty word list leave the fast greedy path.
    (g,) = parse_requests(_getter(
        repetition_penalty=np.array([[1.0]], np.float32), presence_penalty=np.array([[0.0]], np.float32),
        frequency_penalty=np.array([[0.0]], np.float32), return_log_probs=np.array([[False]]),
        embedding_bias=np.zeros((1, 0), np.float32), bad_words_list=np.array([[[0], [-1]]], np.int32),
        temperature=np.array([[0.5]], np.float32)), LIMITS, SamplingParams)
    assert not g.params.processed and g.params.greedy_temperature == 1.0
    (g,) = parse_requests(_getter(embedding_bias=np.zeros((1, 250), np.float32)), LIMITS, SamplingParams)
    assert not g.params.processed
