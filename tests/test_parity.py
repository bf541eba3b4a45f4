"""The embedded engine on the converted checkpoint must reproduce the source model.

Reference: transformers' own model classes (Mixtral, Qwen2-MoE, Qwen3-MoE, Phi-3.5-MoE); for DeepSeek-MoE v1,
which transformers does not ship, the independent reference in tests/reference/deepseek_v1.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_logits as reference_logits
from trtmoe.checkpoint.writer import convert
from trtmoe.errors import InputError
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams, Sequence

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v1", "phimoe")
LAYOUTS = {
    "tp1": dict(),
    "tp2-ep2": dict(tp=2, moe_ep=2),
    "tp4-mtp2-ep2": dict(tp=4, moe_tp=2, moe_ep=2),
    "pp2": dict(pp=2),
}


def _ids(vocab: int, b: int = 2, t: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def references(tiny_model):
    """fp32 reference logits per architecture, computed once."""
    out = {}
    for arch in ARCHS:
        d = tiny_model(arch)
        import json
        vocab = json.loads((d / "config.json").read_text())["vocab_size"]
        ids = _ids(vocab)
        out[arch] = (d, ids, reference_logits(d, ids))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logit_parity(arch, layout, references, tmp_path):
    src, ids, ref = references[arch]
    ck = tmp_path / "ckpt"
    convert(src, ck, **LAYOUTS[layout])
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    got = eng.logits(ids)
    assert got.shape == ref.shape
    assert _rel_err(got, ref) < 1e-4, f"{arch}/{layout}: max relative error {_rel_err(got, ref):.2e}"
    # The comparison must be able to fail: a different model's logits are far off.
    assert _rel_err(torch.roll(got, 1, dims=-1), ref) > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_greedy_generation_identical(arch, references, tmp_path):
    src, ids, _ = references[arch]
    ck = tmp_path / "ckpt"
    convert(src, ck, tp=2, moe_ep=2)
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    prompt = ids[0, :6].tolist()
    n = 12
    got = eng.generate(prompt, SamplingParams(max_new_tokens=n))
    if arch == "deepseek_v1":
        # Greedy decoding with the reference forward, one full pass per token.
        from tests.reference.deepseek_v1 import deepseek_v1_logits
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(deepseek_v1_logits(src, torch.tensor([seq]))[0, -1].argmax()))
        want = seq[len(prompt):]
    else:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        want = out[0, len(prompt):].tolist()
    assert got == want


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_bf16_parity(arch, tiny_model, hf_logits, tmp_path):
    src = tiny_model(arch, dtype="bfloat16")
    import json
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    ids = _ids(vocab, seed=1)
    ref = hf_logits(src, ids, dtype=torch.bfloat16)
    ref32 = hf_logits(src, ids, dtype=torch.float32)
    ck = tmp_path / "ckpt"
    convert(src, ck, tp=2, moe_ep=2)
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    assert eng.dtype == torch.bfloat16
    got = eng.logits(ids)
    # "Normal bf16 rounding": our bf16 run is as close to transformers' bf16 run as transformers'
    # own bf16 run is to its fp32 run (with a small margin), and close in absolute terms.
    own_noise = _rel_err(ref, ref32)
    assert _rel_err(got, ref) <= max(2.0 * own_noise, 2e-2), (_rel_err(got, ref), own_noise)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_decode_with_cache_matches_full_forward(references, tmp_path):
    """KV-cached prefill+decode gives the same logits as a full forward over the whole sequence."""
    src, ids, _ = references["qwen3_moe"]
    ck = tmp_path / "ckpt"
    convert(src, ck)
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    prompts = [ids[0, :5].tolist(), ids[1, :8].tolist()]
    seqs = [eng.start(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    while not all(s.finished for s in seqs):
        eng.step(seqs)  # batched decode across different lengths
    for p, s in zip(prompts, seqs):
        full = p + s.tokens
        logits = eng.logits(torch.tensor([full[:-1]]))[0]
        greedy = logits[len(p) - 1:].argmax(-1).tolist()
        assert greedy == s.tokens


def test_sampling_is_seeded(references, tmp_path):
    src, ids, _ = references["mixtral"]
    ck = tmp_path / "ckpt"
    convert(src, ck)
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    p = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    a = eng.generate(ids[0, :4].tolist(), p)
    b = eng.generate(ids[0, :4].tolist(), p)
    c = eng.generate(ids[0, :4].tolist(), SamplingParams(max_new_tokens=10, temperature=1.0, seed=8))
    assert a == b
    assert a != c or len(set(a)) == 1


def test_pooled_cache_under_joins_drops_and_growth(references, tmp_path):
    """In-flight pattern on the pooled KV cache: sequences join mid-decode (growing the pool's slots
    and capacity while others hold cached keys), one is dropped unfinished and its slot reused, so
    steps run over non-contiguous slots; every finished sequence still equals greedy decoding by
    full forwards, and every slot is back in the pool at the end."""
    import gc

    src, ids, _ = references["mixtral"]
    ck = tmp_path / "ckpt"
    convert(src, ck)
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    stream = ids.reshape(-1).tolist()
    live = [eng.start(stream[:3], SamplingParams(max_new_tokens=4)),
            eng.start(stream[3:9], SamplingParams(max_new_tokens=12))]
    done, dropped, peak = [], None, (0, 0)
    joins = [(1, stream[2:7], 40), (2, stream[5:6], 7), (3, stream[1:10], 25), (5, stream[4:8], 9),
             (6, stream[7:9], 5)]
    for it in range(60):
        for when, prompt, n in joins:
            if when == it:
                live.append(eng.start(prompt, SamplingParams(max_new_tokens=n)))
        if it == 3:  # a cancelled request: dropped from the batch before it finishes
            dropped = live.pop(2)
            assert not dropped.finished
            dropped = None
            gc.collect()
        if not live:
            break
        assert len({s.slot for s in live}) == len(live)
        peak = (max(peak[0], eng._kv.capacity), max(peak[1], eng._kv.slots))
        # Rows past a sequence's length are read (masked) by every step: they must be finite.
        assert all(bool(torch.isfinite(t).all()) for t in eng._kv.k + eng._kv.v)
        eng.step(live)
        done += [s for s in live if s.finished]
        live = [s for s in live if not s.finished]
    assert not live and len(done) == 6
    assert peak[0] >= 48 and peak[1] >= 8  # grew in both dimensions while sequences held slots
    for s in done:
        full = s.prompt + s.tokens
        logits = eng.logits(torch.tensor([full[:-1]]))[0]
        assert logits[len(s.prompt) - 1:].argmax(-1).tolist() == s.tokens
        assert s.slot == -1
    assert eng._kv.live == 0 and eng._kv.k == []  # idle: the pool's memory is given back
    with pytest.raises(Exception, match="released"):
        eng.step([Sequence(prompt=[1], params=SamplingParams())])  # never prefilled: no slot


def test_a_decode_step_gives_each_row_the_same_logits_whatever_its_slots(references, tmp_path):
    """A serving batch lists its sequences in arrival order while slots are reused lowest first, and
    finished sequences leave gaps: a step over a block of slots in another order (run in slot
    order) and over slots with gaps (gathered; with and without a mask) gives every row the logits
    it gets alone, and the reordered block exactly the logits of the ordered one."""
    src, ids, _ = references["mixtral"]
    ck = tmp_path / "ckpt"
    convert(src, ck)
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    stream = ids.reshape(-1).tolist()
    seqs = [eng.start(stream[i:i + 3 + i % 2], SamplingParams(max_new_tokens=8)) for i in range(10)]
    assert [s.slot for s in seqs] == list(range(10))
    # Without advancing, a step only rewrites each row's newest key and value with the same numbers.
    with torch.inference_mode():
        alone = torch.cat([eng._decode_logits([s]) for s in seqs])
        ordered = eng._decode_logits(seqs)
        assert torch.allclose(ordered, alone, rtol=1e-5, atol=1e-5)
        assert torch.equal(eng._decode_logits(seqs[::-1]), ordered.flip(0))
        for pick in ((5, 0, 3, 1), (0, 4, 2), (9, 0), (7, 2, 8)):  # a mask; equal lengths; far apart
            got = eng._decode_logits([seqs[i] for i in pick])
            assert torch.allclose(got, alone[list(pick)], rtol=1e-5, atol=1e-5), pick
            assert torch.equal(got.argmax(-1), alone[list(pick)].argmax(-1))
    # The comparison can fail: another row's logits are far off.
    assert not torch.allclose(alone[0], alone[1], rtol=1e-3, atol=1e-3)


def test_batched_prefill_equals_one_at_a_time(references, tmp_path):
    """start_many prefills prompts of different lengths in one padded forward: the same first tokens,
    the same continuations and the same routing counts (padding is never routed) as one at a time."""
    src, ids, _ = references["qwen2_moe"]
    ck = tmp_path / "ckpt"
    convert(src, ck)
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    stream = ids.reshape(-1).tolist()
    prompts = [stream[:3], stream[4:13], stream[2:3], stream[6:12]]
    params = [SamplingParams(max_new_tokens=5), SamplingParams(max_new_tokens=1),
              SamplingParams(max_new_tokens=6, temperature=0.8, seed=3), SamplingParams(max_new_tokens=4)]
    eng.reset_routing_stats()
    one = [eng.start(p, sp) for p, sp in zip(prompts, params)]
    counts_one = eng.routing_stats()["counts"].clone()
    eng.reset_routing_stats()
    many = eng.start_many(prompts, params)
    assert torch.equal(eng.routing_stats()["counts"], counts_one)
    assert eng.routing_stats()["tokens"] == sum(map(len, prompts))
    assert [s.tokens for s in many] == [s.tokens for s in one]
    assert many[1].finished and many[1].slot == -1  # max_new_tokens=1: done at prefill, slot freed
    for group in (one, many):
        live = [s for s in group if not s.finished]
        while live:
            eng.step(live)
            live = [s for s in live if not s.finished]
    assert [s.tokens for s in many] == [s.tokens for s in one]
    with pytest.raises(InputError, match="vocabulary"):
        eng.start_many([stream[:3], [10 ** 6]], params[:2])
    assert eng._kv.live == 0  # nothing kept from the refused batch
