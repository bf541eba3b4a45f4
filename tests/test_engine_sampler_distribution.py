"""The embedded engine's sampler draws from the right distribution.

Each test draws many tokens with fixed seeds and compares their counts with a reference written
out here, independently of trtmoe: the logits divided by the temperature, then TensorRT-LLM's
penalties, then top-k (every token whose logit is at least the k-th largest is kept, ties included,
as transformers' ``TopKLogitsWarper`` does), then top-p over the renormalised top-k distribution (a
token is kept while the probability of the tokens ranked above it is below ``top_p``, as
transformers' ``TopPLogitsWarper`` does), renormalised. A token outside the kept set must never be
drawn (an exact check); the counts of the kept tokens must pass a chi-square goodness-of-fit test at
``ALPHA``.

False-failure probability: each chi-square check rejects a correct sampler with probability
``ALPHA`` = 1e-4 for a random seed; the seeds are fixed, so a run is deterministic, and with the
~25 checks here fewer than 1 seed set in 400 would fail a correct sampler.

Part one feeds constructed logits (ties, top_k=1, top_p near 0 and 1, the order of the steps) to
the engine's per-row sampler; part two samples first tokens through ``start_many`` on the trained
fixture and takes the reference from transformers' own warpers applied to transformers' logits, also
with the parameters a served request's runtime_top_k / runtime_top_p / temperature inputs become.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from conftest import TRAINED_MIXTRAL, float_engine, hf_logits, request_getter, require, require_fixture
import pytest
import torch

from trtmoe.runtime.engine import SamplingParams
from trtmoe.triton.llm_request import EngineLimits, parse_requests

FIXTURE = require_fixture(TRAINED_MIXTRAL)
stats = require("scipy.stats", "the chi-square test (test extra)")
logits_process = require("transformers.generation.logits_process", "the reference warpers (test extra)")

ALPHA = 1e-4
N = 12000


@pytest.fixture(scope="module")
def engine(tmp_path_factory, one_torch_thread):
    return float_engine(FIXTURE, tmp_path_factory, "sampler-distribution")


# ---- the reference ---------------------------------------------------------------------------------
def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, history=(), repetition_penalty=1.0,
                    presence_penalty=0.0, frequency_penalty=0.0) -> np.ndarray:
    """The distribution a sampled token is drawn from, in float64."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    counts = np.bincount(np.asarray(history, dtype=np.int64), minlength=x.size)[: x.size]
    seen = counts > 0
    x = np.where(seen, np.where(x < 0, x * repetition_penalty, x / repetition_penalty), x)
    x = x - presence_penalty * seen - frequency_penalty * counts
    keep = np.ones(x.size, bool)
    if top_k:
        kth = np.sort(x)[::-1][min(top_k, x.size) - 1]
        keep = x >= kth
    p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        above = np.cumsum(p[order]) - p[order]
        nucleus = np.zeros(x.size, bool)
        nucleus[order[above < top_p]] = True
        p = np.where(nucleus, p, 0.0)
        p /= p.sum()
    return p


def assert_follows(tokens, probs: np.ndarray, what: str = "") -> None:
    """``tokens`` (drawn ids) never leave the support of ``probs`` and fit it by a chi-square test."""
    counts = np.bincount(np.asarray(tokens), minlength=probs.size)
    n = counts.sum()
    outside = np.flatnonzero((probs == 0) & (counts > 0))
    assert outside.size == 0, (f"{what}: drew tokens the filters remove: "
                               f"{ {int(t): int(counts[t]) for t in outside[:10]} } (kept: {np.flatnonzero(probs).tolist()[:20]})")
    expected = probs * n
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    rest = (probs > 0) & ~big
    if rest.any():  # the rare kept tokens as one bin
        obs.append(counts[rest].sum())
        exp.append(expected[rest].sum())
    if len(obs) == 1:
        assert obs[0] == n, what
        return
    obs, exp = np.array(obs, float), np.array(exp, float)
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    pvalue = float(stats.chi2.sf(chi2, len(obs) - 1))
    assert pvalue > ALPHA, (f"{what}: counts do not fit the reference (chi2 {chi2:.1f}, {len(obs) - 1} dof, "
                            f"p={pvalue:.2g}); observed {obs.astype(int).tolist()[:12]}, "
                            f"expected {np.round(exp).astype(int).tolist()[:12]}")


def test_the_reference_itself():
    """The written-out rules on small cases worked by hand."""
    lg = np.log([0.3, 0.25, 0.2, 0.15, 0.1])
    np.testing.assert_allclose(reference_probs(lg), [0.3, 0.25, 0.2, 0.15, 0.1])
    np.testing.assert_allclose(reference_probs(lg, top_k=2), [0.3 / 0.55, 0.25 / 0.55, 0, 0, 0])
    np.testing.assert_allclose(reference_probs(lg, top_p=0.5), [0.3 / 0.55, 0.25 / 0.55, 0, 0, 0])
    np.testing.assert_allclose(reference_probs(lg, top_p=0.56), [0.4, 0.25 / 0.75, 0.2 / 0.75, 0, 0])
    # top-p over the renormalised top-3: 0.4, 0.333, 0.267 -> the third is above 0.7 already
    np.testing.assert_allclose(reference_probs(lg, top_k=3, top_p=0.7), [0.3 / 0.55, 0.25 / 0.55, 0, 0, 0])
    np.testing.assert_allclose(reference_probs([1.0, 0.0, 0.0, 0.0, -1.0], top_k=2)[4], 0.0)
    assert (reference_probs([1.0, 0.0, 0.0, 0.0, -1.0], top_k=2)[:4] > 0).all()  # ties at the k-th kept
    # transformers' warpers agree on these cases
    x = torch.tensor(lg, dtype=torch.float32)[None]
    for k, p in [(2, 1.0), (0, 0.5), (0, 0.56), (3, 0.7)]:
        y = x
        if k:
            y = logits_process.TopKLogitsWarper(k)(None, y)
        if p < 1:
            y = logits_process.TopPLogitsWarper(p)(None, y)
        np.testing.assert_allclose(y.softmax(-1)[0].numpy(), reference_probs(lg, top_k=k, top_p=p), atol=1e-6)


# ---- part one: constructed logits through the per-row sampler -------------------------------------
PROMPT = [3, 5, 5, 9]
RNG = np.random.default_rng(20240607)
SPREAD = np.round(RNG.normal(0, 1.5, 16), 3)  # distinct values, no ties
# logits of probability 0.3, 0.25, 0.2, 0.15, 0.1 and eleven rare tokens
GRADED = np.log(np.r_[[0.3, 0.25, 0.2, 0.15, 0.1], np.full(11, 1e-12)])
TIED = np.array([2.0, 1.0, 1.0, 1.0, 0.5, 0.0, -1.0, -1.0, -2.0, -3.0, -3.0, -3.0, -4.0, -5.0, -5.0, -6.0])
# four equal leading tokens, then a tail of total mass 9e-4 that top_p = 0.999 removes and 1.0 keeps
TAIL = np.r_[np.zeros(4), np.full(12, np.log(4 * 9e-4 / 12 / (1 - 9e-4)))]
# prompt tokens 5 and 9 lead; a repetition penalty of 4 takes token 9 out of the top 3
PEN = np.linspace(1.0, -2.0, 16)
PEN[5], PEN[9] = 3.0, 2.8

CASES = {
    "temperature only": (SPREAD, dict(temperature=0.7)),
    "hot temperature": (SPREAD, dict(temperature=2.5)),
    "top_k=4": (SPREAD, dict(temperature=1.0, top_k=4)),
    "top_k=4 after temperature 0.5": (SPREAD, dict(temperature=0.5, top_k=4)),
    "top_k=1": (SPREAD, dict(temperature=3.0, top_k=1)),
    "top_k above the vocabulary": (SPREAD, dict(temperature=1.0, top_k=100)),
    "top_k=2 with three tokens tied at the 2nd": (TIED, dict(temperature=1.0, top_k=2)),
    "top_k=5 with a tie inside": (TIED, dict(temperature=0.8, top_k=5)),
    "top_p=0.5": (GRADED, dict(temperature=1.0, top_p=0.5)),
    "top_p=0.62": (GRADED, dict(temperature=1.0, top_p=0.62)),
    "top_p near 0": (SPREAD, dict(temperature=1.0, top_p=1e-6)),
    "top_p=0.999 drops a small tail": (TAIL, dict(temperature=1.0, top_p=0.999)),
    "top_p=1.0 keeps the tail": (TAIL, dict(temperature=1.0, top_p=1.0)),
    "top_p over tied leading tokens": (TIED, dict(temperature=1.0, top_p=0.55)),
    "top_p after temperature 3": (GRADED, dict(temperature=3.0, top_p=0.5)),
    "top_p over the renormalised top-k": (GRADED, dict(temperature=1.0, top_k=3, top_p=0.7)),
    "top_k and top_p, hot": (SPREAD, dict(temperature=1.7, top_k=6, top_p=0.8)),
    # penalties come after the temperature and before top-k/top-p
    "repetition penalty before top_k": (PEN, dict(temperature=1.0, top_k=3, repetition_penalty=4.0)),
    "presence penalty after temperature, before top_p": (
        GRADED, dict(temperature=0.5, top_p=0.7, presence_penalty=1.5)),
    "frequency penalty before top_k": (SPREAD, dict(temperature=1.2, top_k=5, frequency_penalty=0.8)),
}


def _penalised(opts) -> bool:
    return any(k.endswith("penalty") for k in opts)


@pytest.mark.parametrize("name", list(CASES))
def test_constructed_logits(engine, name):
    logits, opts = CASES[name]
    params = SamplingParams(max_new_tokens=1, seed=1234, **opts)
    seq = engine._new_sequence(PROMPT, params)
    row = torch.tensor(logits, dtype=torch.float32)
    tokens = [engine._sample(seq, row.clone()) for _ in range(N)]
    ref = reference_probs(logits, history=PROMPT if _penalised(opts) else (), **opts)
    assert_follows(tokens, ref, name)


def test_the_constructed_cases_are_not_trivial():
    """Each filter removes tokens in its cases, and the order of the steps matters where a case
    says so (the cases would not catch a misplaced step otherwise)."""
    for name, (logits, opts) in CASES.items():
        hist = PROMPT if _penalised(opts) else ()
        ref = reference_probs(logits, history=hist, **opts)
        unfiltered = reference_probs(logits, history=hist, temperature=opts["temperature"],
                                     **{k: v for k, v in opts.items() if k.endswith("penalty")})
        if opts.get("top_k", 0) and opts["top_k"] < len(logits) or opts.get("top_p", 1.0) < 1.0:
            assert (ref == 0).sum() > (unfiltered == 0).sum(), name
    # temperature before top-p: at T=1 the 0.5-nucleus has 2 tokens, at T=3 it has 3
    assert (reference_probs(GRADED, top_p=0.5) > 0).sum() == 2
    assert (reference_probs(GRADED, temperature=3.0, top_p=0.5) > 0).sum() == 3
    # top-p after top-k: the other order keeps 3 tokens
    assert (reference_probs(GRADED, top_k=3, top_p=0.7) > 0).sum() == 2
    assert (reference_probs(GRADED, top_p=0.7) > 0).sum() == 3
    # penalty before top-k: without it the top 3 of PEN hold token 9, with it they do not
    assert reference_probs(PEN, top_k=3)[9] > 0
    assert reference_probs(PEN, top_k=3, history=PROMPT, repetition_penalty=4.0)[9] == 0
    # the top_p=0.999 tail is large enough to be seen when it is not removed (~10 of N draws)
    assert reference_probs(TAIL)[4:].sum() * N > 9


def test_top_k_1_and_tiny_top_p_are_the_argmax_whatever_the_temperature(engine):
    row = torch.tensor(SPREAD, dtype=torch.float32)
    for opts in (dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=1e-6)):
        for t in (0.3, 1.0, 50.0):
            seq = engine._new_sequence(PROMPT, SamplingParams(max_new_tokens=1, temperature=t, seed=7, **opts))
            assert {engine._sample(seq, row.clone()) for _ in range(300)} == {int(np.argmax(SPREAD))}, (opts, t)


# ---- part two: first tokens of real requests on the trained fixture --------------------------------
PROMPT_IDS = [1, 415, 888, 868, 285, 1142]


@pytest.fixture(scope="module")
def fixture_logits(engine):
    """transformers' float32 last-position logits for the prompt (the reference), and the engine's."""
    ids = PROMPT_IDS
    hf = hf_logits(FIXTURE, torch.tensor([ids]))[0, -1]
    ours = engine.logits(torch.tensor([ids]))[0, -1].float()
    assert torch.allclose(hf, ours, atol=2e-3), float((hf - ours).abs().max())
    return ids, hf


def _transformers_probs(ids, logits, temperature, top_k=0, top_p=1.0, repetition_penalty=1.0) -> np.ndarray:
    """transformers' processors, in TensorRT-LLM's order: temperature, repetition penalty, top-k, top-p."""
    lp = logits_process
    x = logits[None].clone()
    x = lp.TemperatureLogitsWarper(temperature)(None, x)
    if repetition_penalty != 1.0:
        x = lp.RepetitionPenaltyLogitsProcessor(repetition_penalty)(torch.tensor([ids]), x)
    if top_k:
        x = lp.TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = lp.TopPLogitsWarper(top_p)(None, x)
    return x.double().softmax(-1)[0].numpy()


E2E = [
    dict(temperature=0.8, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, top_k=12, top_p=0.6),
    dict(temperature=0.9, top_k=8, top_p=0.9, repetition_penalty=1.6),
]


@pytest.mark.parametrize("opts", E2E, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_first_tokens_of_requests_follow_transformers_warpers(engine, fixture_logits, opts):
    ids, hf = fixture_logits
    ref = _transformers_probs(ids, hf, **opts)
    # the boundaries of the kept set are clear of the two logits' float differences
    x = (hf / opts["temperature"]).double().numpy()
    if opts.get("top_k"):
        s = np.sort(x)[::-1]
        assert s[opts["top_k"] - 1] - s[opts["top_k"]] > 1e-3 or opts.get("repetition_penalty")
    np.testing.assert_allclose(ref, reference_probs(hf.double().numpy(), history=ids, **opts), atol=1e-6)
    n, tokens = 6000, []
    for start in range(0, n, 2000):
        seqs = engine.start_many([ids] * 2000, [SamplingParams(max_new_tokens=1, seed=start + i, **opts)
                                                for i in range(2000)])
        tokens += [s.tokens[0] for s in seqs]
    assert 1 < (ref > 0).sum() < engine.vocab_size or opts.get("top_k") == 1
    assert_follows(tokens, ref, str(opts))


def test_beam_search_ignores_top_k_and_top_p(engine, fixture_logits):
    """Beam search (beam_width > 1) takes no part of top-k, top-p or the seed, as in TensorRT-LLM."""
    ids, _ = fixture_logits

    def beams(**kw):
        seq = engine.start(ids, SamplingParams(max_new_tokens=6, beam_width=3, end_id=2, **kw))
        while not seq.finished:
            engine.step([seq])
        return [(h.tokens, round(h.score, 5)) for h in seq.results()]

    plain = beams()
    assert beams(top_k=1, top_p=0.05, seed=3) == plain
    assert beams(top_k=2, seed=99) == plain


# ---- the serving inputs reach the sampler ----------------------------------------------------------
def _served_params(ids, **tensors) -> SamplingParams:
    """The SamplingParams a tensorrt_llm request with ``tensors`` becomes."""
    limits = EngineLimits(max_input_len=64, max_seq_len=512, vocab_size=2048, default_end_id=2)
    get = request_getter(input_ids=np.array([ids], np.int32), input_lengths=np.array([[len(ids)]], np.int32),
                         request_output_len=np.array([[1]], np.int32), **tensors)
    (g,) = parse_requests(get, limits, SamplingParams)
    return g.params


def test_runtime_top_k_and_top_p_inputs_reach_the_sampler(engine, fixture_logits):
    """runtime_top_k / runtime_top_p / temperature of a request: the first tokens of requests parsed
    from them follow transformers' warpers with those values."""
    ids, hf = fixture_logits
    f32 = lambda v: np.array([[v]], np.float32)  # noqa: E731
    p = _served_params(ids, runtime_top_k=np.array([[12]], np.int32), runtime_top_p=f32(0.6), temperature=f32(1.2))
    assert (p.top_k, p.temperature) == (12, pytest.approx(1.2)) and p.top_p == pytest.approx(0.6)
    top_p_only = _served_params(ids, runtime_top_p=f32(0.8), temperature=f32(1.3))
    assert (top_p_only.top_k, top_p_only.temperature, top_p_only.top_p) == (0, pytest.approx(1.3), pytest.approx(0.8))
    # TensorRT-LLM: top_p 0 is off, and top_k 1 (or none) with it decodes greedily whatever the temperature
    greedy = _served_params(ids, runtime_top_k=np.array([[1]], np.int32), runtime_top_p=f32(0.0), temperature=f32(1.3))
    assert (greedy.temperature, greedy.top_p) == (0.0, 1.0)
    ref = _transformers_probs(ids, hf, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
    assert (ref > 0).sum() > 1
    seqs = engine.start_many([ids] * 4000, [dataclasses.replace(p, seed=i) for i in range(4000)])
    assert_follows([s.tokens[0] for s in seqs], ref, "parsed runtime_top_k=12, runtime_top_p=0.6, temperature=1.2")
