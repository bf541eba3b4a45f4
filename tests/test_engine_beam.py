"""Beam search in the embedded engine (TensorRT-LLM's rules, trtmoe/runtime/beam.py): against
transformers' own beam search on both trained fixtures (Mixtral, and the fine-grained Qwen3-MoE)
where the two define the same thing,
the stop rule where they differ, batching, cache release, and the tensorrt_llm model's parsing."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TRAINED_MIXTRAL, float_engine, request_getter, require_fixture

from trtmoe.errors import InputError
from trtmoe.runtime.beam import BeamState, Hypothesis, top_candidates
from trtmoe.checkpoint.writer import convert
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams
from trtmoe.triton.llm_request import EngineLimits, RequestError, parse_requests

FIXTURE = require_fixture(TRAINED_MIXTRAL)
FIXTURES = FIXTURE.parent

PROMPTS = ["def main():\n", "class A:\n    ", "return", "for i in range(10):"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, one_torch_thread):
    return float_engine(FIXTURE, tmp_path_factory, "beam")


@pytest.fixture(scope="module")
def hf():
    return _hf(FIXTURE)


def _hf(fixture: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(fixture), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(fixture))


@pytest.fixture(scope="module")
def pair(tmp_path_factory, engine, hf):
    """Per trained fixture: (embedded engine, (transformers model, tokenizer)); the fine-grained
    Qwen3-MoE one (64 experts, top 8) is built when first asked for."""
    made = {"trained_mixtral": (engine, hf)}

    def get(name: str):
        if name not in made:
            require_fixture(FIXTURES / name)
            made[name] = (float_engine(FIXTURES / name, tmp_path_factory, "beam-" + name), _hf(FIXTURES / name))
        return made[name]
    return get


def _run(engine, seqs):
    while not all(s.finished for s in seqs):
        engine.step([s for s in seqs if not s.finished])
    return seqs


# The end ids: the fixture's own (seldom chosen) and a newline, which ends many beams early.
@pytest.mark.parametrize("end", ["eos", "\n"])
@pytest.mark.parametrize("len_penalty, early_stopping, hf_early", [(0.0, 1, True), (1.0, 1, True), (0.5, 2, "never")])
@pytest.mark.parametrize("fixture", ["trained_mixtral", "trained_qwen3_moe"])
def test_beams_equal_transformers_beam_search(pair, fixture, end, len_penalty, early_stopping, hf_early):
    """Where TensorRT-LLM's rules and transformers' agree (early_stopping 1 = True, and > 1 =
    "never"), the returned beams, in order, are transformers' num_return_sequences = num_beams
    outputs (end id stripped); with no length penalty the raw cumulative log-probs are its
    sequence scores."""
    engine, (model, tok) = pair(fixture)
    end_id = tok.eos_token_id if end == "eos" else tok.encode(end)[-1]
    ended = 0
    for K in (2, 3):
        for text in PROMPTS:
            prompt = tok.encode(text)
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), num_beams=K, num_return_sequences=K, do_sample=False,
                                     early_stopping=hf_early, length_penalty=len_penalty, max_new_tokens=24,
                                     eos_token_id=end_id, pad_token_id=end_id, output_scores=True,
                                     return_dict_in_generate=True)
            want = []
            for row in out.sequences.tolist():
                gen = row[len(prompt):]
                if end_id in gen:
                    gen, ended = gen[:gen.index(end_id)], ended + 1
                want.append(gen)
            (s,) = _run(engine, [engine.start(prompt, SamplingParams(
                max_new_tokens=24, beam_width=K, end_id=end_id, len_penalty=len_penalty,
                early_stopping=early_stopping, return_log_probs=True))])
            res = s.results()
            assert [h.tokens for h in res] == want, (K, text)
            assert s.tokens == res[0].tokens
            for h in res:
                assert len(h.log_probs) == len(h.tokens)
            if len_penalty == 0.0:
                got = [h.cum_log_prob for h in res]
                assert np.allclose(got, out.sequences_scores.tolist(), atol=1e-4), (got, out.sequences_scores)
    if end != "eos":
        assert ended > 0  # the end-id paths ran


def test_non_early_stopping_rule_is_tensorrt_llms():
    """early_stopping 0: once K hypotheses are kept, the search ends when the worst kept score is at
    least the step's best candidate value penalised at the length it would have, one more than the
    live beams held (TensorRT-LLM's rule; transformers divides by the shorter length, so it would
    stop in the first case below)."""
    def state(best_lp):
        st = BeamState(width=2, end_id=2, len_penalty=1.0, early_stopping=0)
        st.tokens, st.cum, st.log_probs = [[5, 5], [5, 6]], [-2.0, -2.5], [[-1.0, -1.0], [-1.0, -1.5]]
        st.finished = [Hypothesis([4], -1.0, [-1.0], -1.0), Hypothesis([7], -1.2, [-1.2], -1.2)]
        st.advance(torch.tensor([[best_lp, best_lp - 0.1, -9.0], [-2.0, -2.0, -9.0]]))
        return st
    assert not state(-1.5).done  # best -3.5 at length 3: -1.167 > worst kept -1.2
    assert state(-1.7).done  # best -3.7 at length 3: -1.233 <= -1.2
    # The result then keeps the finished hypotheses only, best first.
    assert [h.tokens for h in state(-1.7).result()] == [[4], [7]]


def test_end_id_hypotheses_and_their_outputs():
    """An end-id candidate ranked within the first K is kept, with the end id's log-prob in its
    cumulative value (not in its tokens or per-token log-probs), scored at its length counting the
    end id; one ranked K or later is ignored. At the first step only beam 0 proposes."""
    ls = lambda *v: torch.log_softmax(torch.tensor([v]), -1)  # noqa: E731
    # The end id ranked 2 of 2K = 4: ignored; the two best others become the beams.
    st = BeamState(width=2, end_id=0, len_penalty=1.0)
    assert st.advance(ls(1.0, 3.0, 2.0, 0.0).expand(2, -1)) == [0, 0]
    assert st.tokens == [[1], [2]] and st.finished == []
    # The end id ranked first: kept (one generated token, so no division), the next two continue.
    st = BeamState(width=2, end_id=0, len_penalty=1.0)
    lp1 = ls(3.0, 2.0, 1.0, 0.0)
    st.advance(lp1.expand(2, -1))
    assert st.tokens == [[1], [2]]
    assert [(h.tokens, h.log_probs) for h in st.finished] == [([], [])]
    assert st.finished[0].cum_log_prob == pytest.approx(float(lp1[0, 0])) == pytest.approx(st.finished[0].score)
    # Step 2: beam 0 ([1]) ends first; beam 1's two best continue; K hypotheses with early_stopping 1: done.
    lp2 = torch.cat([ls(5.0, 0.0, 0.0, 0.0), ls(0.0, 4.0, 0.0, 5.0)])
    cum0 = st.cum[0]
    assert st.advance(lp2) == [1, 1] and st.tokens == [[2, 3], [2, 1]]
    h = st.finished[1]
    assert h.tokens == [1] and h.log_probs == pytest.approx([cum0])
    assert h.cum_log_prob == pytest.approx(cum0 + float(lp2[0, 0]))
    assert h.score == pytest.approx(h.cum_log_prob / 2)
    assert st.done and [r.tokens for r in st.result()] == [[], [1]]  # by score; the live beams are not returned


def test_beam_requests_batch_with_others_and_release_their_rows(engine, hf):
    """Beam searches decoded in one batch with greedy and sampled requests give what each gives
    alone; every cache row is returned when they finish."""
    _, tok = hf
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    colon = tok.encode(":")[-1]
    params = [SamplingParams(max_new_tokens=16, beam_width=3, end_id=colon, return_log_probs=True),
              SamplingParams(max_new_tokens=12),
              SamplingParams(max_new_tokens=16, beam_width=2, end_id=colon, len_penalty=1.0, early_stopping=0,
                             repetition_penalty=1.3)]
    alone = [_run(engine, [engine.start(p, sp)])[0] for p, sp in zip(prompts, params)]
    together = _run(engine, engine.start_many(prompts, params))
    for a, b in zip(alone, together):
        if hasattr(a, "results"):
            assert [h.tokens for h in a.results()] == [h.tokens for h in b.results()]
            # (a batched matmul rounds differently from a one-row one: equal to float32 precision)
            assert [h.cum_log_prob for h in a.results()] == pytest.approx([h.cum_log_prob for h in b.results()],
                                                                          abs=1e-5)
        else:
            assert a.tokens == b.tokens
    assert engine.kv_cache_stats()["live"] == 0
    # num_return_beams: the best n of the K
    (s,) = _run(engine, [engine.start(prompts[0], SamplingParams(max_new_tokens=8, beam_width=3, num_return_beams=2))])
    assert len(s.results()) == 2


def test_beam_params_are_validated(engine):
    for kw, words in ((dict(beam_width=2, num_return_beams=3), "num_return_sequences 3"),
                      (dict(beam_width=2, len_penalty=-1.0), "len_penalty")):
        with pytest.raises(InputError, match=words):
            engine.start([1, 5, 9], SamplingParams(max_new_tokens=4, **kw))


def _limits(beams=4):
    return EngineLimits(max_input_len=64, max_seq_len=256, vocab_size=32000, max_beam_width=beams)


def test_beam_inputs_parse():
    """beam_width, len_penalty, early_stopping, beam_search_diversity_rate and num_return_sequences
    reach one beam-search request (not N sequences); top_k / top_p / seed do not apply and a
    temperature scales the log-probs."""
    get = request_getter(beam_width=np.array([[3]], np.int32), len_penalty=np.array([[0.7]], np.float32),
                         early_stopping=np.array([[0]], np.int32), num_return_sequences=np.array([[2]], np.int32),
                         runtime_top_k=np.array([[5]], np.int32), temperature=np.array([[2.0]], np.float32),
                         seed=np.array([[3]], np.uint64))
    (g,) = parse_requests(get, _limits(), SamplingParams)
    p = g.params
    assert (g.beam_width, p.beam_width, p.num_return_beams, p.early_stopping) == (3, 3, 2, 0)
    assert g.num_sequences == 2 and g.sequence_index == 0  # one result; responses carry sequence_index 0
    assert p.len_penalty == pytest.approx(0.7) and p.greedy_temperature == 2.0
    assert (p.temperature, p.top_k, p.seed) == (0.0, 0, None)
    (g,) = parse_requests(request_getter(beam_width=np.array([[2]], np.int32)), _limits(), SamplingParams)
    assert (g.params.len_penalty, g.params.early_stopping, g.params.num_return_beams) == (0.0, 1, None)
    # With beam width 1 the beam settings have no effect and are accepted (TensorRT-LLM ignores them).
    (g,) = parse_requests(request_getter(len_penalty=np.array([[0.0]], np.float32)), _limits(), SamplingParams)
    assert g.params.beam_width == 1


@pytest.mark.parametrize("inputs, message", [
    (dict(beam_width=np.array([[5]], np.int32)), "Requested beam width 5 is larger than configured max beam width 4"),
    (dict(beam_width=np.array([[0]], np.int32)), "beam_width must be >= 1"),
    (dict(beam_width=np.array([[2]], np.int32), num_return_sequences=np.array([[3]], np.int32)),
     "num_return_sequences 3 exceeds beam_width 2"),
    (dict(beam_width=np.array([[2]], np.int32), return_generation_logits=np.array([[True]]),
          streaming=np.array([[True]])), "not available for streamed beam search"),
    (dict(len_penalty=np.array([[-0.5]], np.float32)), "'len_penalty' must be >= 0"),
])
def test_beam_refusals(inputs, message):
    with pytest.raises(RequestError, match=message) as e:
        parse_requests(request_getter(**inputs), _limits(), SamplingParams)
    assert "\n" not in str(e.value)


def test_beam_requests_in_the_batcher_finish_or_cancel_and_free_their_rows(engine):
    """Through the in-flight batcher: a beam search decoded beside a greedy request finishes with
    the engine's own result; one cancelled after a few steps ends as cancelled; no cache row stays."""
    import threading

    from trtmoe.triton.batcher import FINISH_CANCELLED, InflightBatcher

    want = _run(engine, [engine.start([1, 482, 1732, 11], SamplingParams(max_new_tokens=30, beam_width=3))])[0].results()
    done = {k: threading.Event() for k in ("beam", "plain", "cancelled")}
    events: dict[str, list] = {k: [] for k in done}

    def collect(name):
        def cb(ev):
            events[name].append(ev)
            if ev.finished:
                done[name].set()
        return cb

    b = InflightBatcher(engine, max_batch_size=4)
    try:
        beam = b.submit([1, 482, 1732, 11], SamplingParams(max_new_tokens=30, beam_width=3), collect("beam"))
        b.submit([1, 29, 11], SamplingParams(max_new_tokens=30), collect("plain"))
        gone = b.submit([1, 763], SamplingParams(max_new_tokens=150, beam_width=2), collect("cancelled"))
        while len(events["cancelled"]) < 3:
            time.sleep(0.001)
        gone.cancel()
        assert all(e.wait(60) for e in done.values())
        assert [h.tokens for h in beam.seq.results()] == [h.tokens for h in want]
        assert events["cancelled"][-1].finish_reason == FINISH_CANCELLED
    finally:
        b.shutdown()
    # A cancelled sequence's rows go back when the last reference to it is dropped (here: the
    # events and handles this test keeps), as for any cancelled request.
    gone = beam = None
    events.clear()
    assert engine.kv_cache_stats()["live"] == 0


@pytest.mark.parametrize("arch, kw", [("mixtral", dict(num_key_value_heads=1)), ("qwen2_moe", {}), ("qwen3_moe", {}),
                                      ("deepseek_v1", {}), ("phimoe", {})])
def test_every_architectures_beams_carry_their_own_history(tiny_model, tmp_path, one_torch_thread, arch, kw):
    """On a seeded tiny model of each architecture (GQA, shared experts, dense layers, sparse-mixer
    routing): every returned beam's cumulative log-prob is what a cache-free forward over its own
    tokens gives them, so each beam decoded against its own (forked and reordered) cache rows."""
    ckpt = tmp_path / "ckpt"
    convert(tiny_model(arch, **kw), ckpt)
    engine = EmbeddedEngine.from_checkpoint(ckpt, device="cpu")
    prompt = [3, 17, 5, 41, 8]
    for K in (2, 4):
        (s,) = _run(engine, [engine.start(prompt, SamplingParams(max_new_tokens=10, beam_width=K, end_id=7))])
        res = s.results()
        assert len(res) == K and len({tuple(h.tokens) for h in res}) == K
        for h in res:
            ids = prompt + h.tokens + ([7] if len(h.tokens) < 10 else [])  # an early end is the end id
            lp = torch.log_softmax(engine.logits(torch.tensor([ids]))[0, len(prompt) - 1:-1], -1)
            want = float(lp.gather(1, torch.tensor(ids[len(prompt):])[:, None]).sum())
            assert h.cum_log_prob == pytest.approx(want, abs=1e-3), (arch, K, h.tokens)
    assert engine.kv_cache_stats()["live"] == 0


def test_beam_generation_logits_are_each_slots_raw_rows(engine, hf):
    """return_generation_logits with beams (unstreamed): [K, steps, vocab], slot b's row at step t
    being the raw logits its beam was decoded with then (the prompt's last position at step 0), in
    slot order as TensorRT-LLM keeps them."""
    _, tok = hf
    prompt = tok.encode(PROMPTS[0])
    s = engine.start(prompt, SamplingParams(max_new_tokens=8, beam_width=3, return_generation_logits=True))
    inputs = [[list(r.tokens) for r in s.beams]]  # each slot's tokens before each step
    while not s.finished:
        engine.step([s])
        if not s.finished:
            inputs.append([list(r.tokens) for r in s.beams])
    g = s.beam_generation_logits
    assert g.shape == (3, len(inputs) + 1, engine.vocab_size)
    first = engine.logits(torch.tensor([prompt]))[0, -1]
    assert all(torch.allclose(g[b, 0], first, atol=1e-4) for b in range(3))
    for t, slots in enumerate(inputs, start=1):
        for b, toks in enumerate(slots):
            want = engine.logits(torch.tensor([prompt + toks]))[0, -1]
            assert torch.allclose(g[b, t], want, atol=1e-4), (t, b)


def test_a_beam_that_meets_a_stop_word_ends_there():
    """A live beam whose tokens end with a stop word proposes only the end id next, at its own
    cumulative value: kept as a hypothesis (tokens up to the stop word) when that ranks within the
    first K; when every live beam met one, nothing is left to decode."""
    ls = lambda *v: torch.log_softmax(torch.tensor([v], dtype=torch.float64), -1)  # noqa: E731
    st = BeamState(width=2, end_id=0, len_penalty=1.0, stop_words=[[3]])
    st.advance(ls(0.0, 0.0, 0.0, 3.0, 2.5, 0.0).expand(2, -1))
    assert st.tokens == [[3], [4]] and st.stopped == [True, False] and not st.all_stopped
    cum0, cum1 = st.cum
    lp2 = torch.cat([ls(0.0, 9.0, 9.0, 0.0, 0.0, 0.0), ls(0.0, 2.0, 1.5, 0.0, 0.0, 0.0)])
    assert st.advance(lp2) == [1, 1]  # beam 0's 9.0s are not offered: it may only end
    (h,) = st.finished
    assert h.tokens == [3] and h.cum_log_prob == pytest.approx(cum0) and h.score == pytest.approx(cum0 / 2)
    assert st.tokens == [[4, 1], [4, 2]] and st.stopped == [False, False]
    both = BeamState(width=2, end_id=0, stop_words=[[3], [4]])
    both.advance(ls(0.0, 0.0, 0.0, 3.0, 2.5, 0.0).expand(2, -1))
    assert both.all_stopped and [h.tokens for h in both.result()] == [[3], [4]]


def test_stop_words_in_beam_search_on_the_trained_fixture(engine, hf):
    """With a newline as stop word, no returned beam goes past one, some end on it, and the
    tensorrt_llm model hands the stop words to the search instead of the batcher."""
    _, tok = hf
    nl = tok.encode("\n")[-1]
    for text in PROMPTS:
        (s,) = _run(engine, [engine.start(tok.encode(text), SamplingParams(max_new_tokens=24, beam_width=3,
                                                                          end_id=tok.eos_token_id,
                                                                          stop_words=[[nl]]))])
        res = s.results()
        assert all(nl not in h.tokens[:-1] for h in res)
        assert any(h.tokens and h.tokens[-1] == nl for h in res)
    (g,) = parse_requests(request_getter(beam_width=np.array([[2]], np.int32),
                                         stop_words_list=np.array([[[7, 8], [1, 2]]], np.int32)), _limits(), SamplingParams)
    assert g.params.stop_words == [[7], [8]] and g.stop_sequences == []


def test_top_candidates_is_a_stable_full_sort():
    """The partial ranking gives what a stable descending sort of every candidate gives, ties
    (many here: values rounded to a few levels, -inf rows) to the lower index."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        v = torch.randint(0, 4, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).double()
        v[torch.rand(v.shape, generator=g) < 0.3] = -float("inf")
        n = int(torch.randint(1, v.numel() + 2, (1,), generator=g))
        assert top_candidates(v, n) == torch.sort(v, descending=True, stable=True).indices[:n].tolist()


def test_fewer_candidates_than_beams_leave_placeholders_that_are_never_returned():
    """A vocabulary of two with the end id among them: after the first step one real beam is left;
    the second slot is a placeholder at -1e20 that proposes nothing and is never returned."""
    st = BeamState(width=2, end_id=0)
    lp = torch.log_softmax(torch.tensor([[2.0, 1.0]]), -1).expand(2, -1)
    assert st.advance(lp) == [0, 0]
    assert st.tokens == [[1], [1]] and st.cum[1] == -1e20 and [h.tokens for h in st.finished] == [[]]
    st.advance(lp)
    assert [h.tokens for h in st.result()] == [[], [1]]  # the end id after [1] ranks within K: kept
    assert all(h.cum_log_prob > -1e19 for h in st.result())
