"""The engine's CPU matrix products (trtmoe.matmul): large products go to oneDNN and small
ones stay with MKL, large expert matrices are held packed, the two libraries agree to float32
rounding, gradients still flow, and ``cpu_matmul="blas"`` keeps every product on MKL."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from trtmoe.checkpoint.writer import convert
from trtmoe.errors import InputError
from trtmoe.hf.reader import HFCheckpoint
from trtmoe.quant.plan import uniform_plan
from trtmoe import matmul
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams

pytestmark = pytest.mark.skipif(not matmul.onednn_available(),
                                reason="this PyTorch build has no oneDNN float32 linear: every product runs on MKL")

ONEDNN_OP = "mkldnn::_linear_pointwise"


@pytest.fixture(scope="module")
def ckpt(tiny_model, tmp_path_factory):
    # Hidden 256, vocabulary 4096: the lm_head product holds 8M multiply-adds from 8 rows on. The
    # experts' fc (256 -> 2 x 512, 2^18 elements) is held packed, their proj (512 -> 256) plain.
    model = tiny_model("mixtral", num_hidden_layers=2, hidden_size=256, intermediate_size=512, head_dim=64,
                       vocab_size=4096, seed=5)
    out = tmp_path_factory.mktemp("matmul") / "ckpt"
    convert(model, out, dtype="float32")
    return out


@pytest.fixture(scope="module")
def engines(ckpt):
    torch.manual_seed(0)
    return {m: EmbeddedEngine.from_checkpoint(ckpt, device="cpu", cpu_matmul=m) for m in ("auto", "blas")}


def _ops(fn) -> dict[str, list[list]]:
    """The input shapes of each oneDNN linear and MKL mm/addmm call that ``fn`` makes."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        fn()
    out: dict[str, list[list]] = {}
    for ev in p.events():
        if ev.name in (ONEDNN_OP, "aten::mm", "aten::addmm"):
            out.setdefault(ev.name, []).append(ev.input_shapes)
    return out


def test_products_go_to_onednn_by_size(engines):
    eng = engines["auto"]
    prompts = torch.randint(4, 4000, (8, 64), generator=torch.Generator().manual_seed(1)).tolist()
    seqs = []
    prefill = _ops(lambda: seqs.extend(eng.start_many(prompts, [SamplingParams(max_new_tokens=3)] * 8)))
    # A 512-token prefill: every dense product and the busy experts' blocks are large.
    assert len(prefill.get(ONEDNN_OP, [])) >= 2 * (2 + 2 * 2), prefill.keys()
    one = eng.start([5, 6, 7], SamplingParams(max_new_tokens=3))
    step = _ops(lambda: eng.step([one]))
    # One token: only its two experts' packed fc products run in oneDNN (one per layer and expert);
    # every other product is small and stays on MKL, the plain proj among them.
    assert [s[1] for s in step.get(ONEDNN_OP, [])] == [[1024, 256]] * 2 * 2, step.get(ONEDNN_OP)
    assert [s[1] for s in step["aten::mm"]].count([512, 256]) == 2 * 2
    # Eight tokens: the lm_head product (8 x 256 x 4096 = 8M multiply-adds) also reaches oneDNN.
    step = _ops(lambda: eng.step(seqs))
    shapes = [tuple(s[1]) for s in step.get(ONEDNN_OP, [])]
    assert shapes.count((4096, 256)) == 1 and set(shapes) == {(4096, 256), (1024, 256)}, shapes
    blas = _ops(lambda: engines["blas"].start_many(prompts, [SamplingParams(max_new_tokens=3)] * 8))
    assert ONEDNN_OP not in blas


def test_auto_and_blas_agree(engines):
    ids = torch.randint(4, 4000, (4, 96), generator=torch.Generator().manual_seed(2))
    a, b = engines["auto"].logits(ids), engines["blas"].logits(ids)
    assert not torch.equal(a, b)  # the products really ran in two libraries
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    tokens = []
    for m in ("auto", "blas"):
        seqs = engines[m].start_many(ids[:, :12].tolist(), [SamplingParams(max_new_tokens=12)] * 4)
        while not all(s.finished for s in seqs):
            engines[m].step(seqs)
        tokens.append([s.tokens for s in seqs])
    assert tokens[0] == tokens[1]


def test_gradients_flow_under_auto(engines):
    """Calibration's gradient passes record autograd through the engine: those products stay on MKL
    (oneDNN's linear has no backward here), so logits and gradients are the blas engine's exactly."""
    ids = torch.randint(4, 4000, (2, 80), generator=torch.Generator().manual_seed(3))
    seen = {}
    for m in ("auto", "blas"):
        eng, grads = engines[m], []
        eng.moe_hook = lambda li, h, idx, w, out: out.register_hook(grads.append) if li == 0 else None
        try:
            logits = eng.logits_with_grad(ids)
            logits.logsumexp(-1).sum().backward()
        finally:
            eng.moe_hook = None
        assert len(grads) == 1 and grads[0].abs().sum() > 0
        seen[m] = (logits.detach(), grads[0])
    assert torch.equal(seen["auto"][0], seen["blas"][0])
    assert torch.equal(seen["auto"][1], seen["blas"][1])


def test_large_expert_matrices_are_held_packed(ckpt, engines):
    """With "auto", an expert matrix of 2^18 elements and more is held only in oneDNN's layout (the
    fc here), a smaller one plain (the proj); ``pack_experts=False`` and "blas" keep both plain. The
    packed engine computes what the plain ones do, to float32 rounding, with the same greedy tokens."""
    bank = engines["auto"].layers[0].experts
    assert bank.packed and bank.proj.shape[1:] == (256, 512)
    with pytest.raises(InputError, match="experts packed for oneDNN") as e:
        bank.fc
    assert "pack_experts=False" in e.value.hint
    plain = EmbeddedEngine.from_checkpoint(ckpt, device="cpu", pack_experts=False)
    assert not plain.layers[0].experts.packed and not engines["blas"].layers[0].experts.packed
    # The packed weights are the plain ones, exactly.
    assert torch.equal(bank._mats[0][3].plain(), plain.layers[0].experts.fc[3])
    ids = torch.randint(4, 4000, (3, 40), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(engines["auto"].logits(ids), plain.logits(ids), rtol=1e-4, atol=1e-4)
    tokens = []
    for eng in (engines["auto"], plain):
        seqs = eng.start_many(ids[:, :6].tolist(), [SamplingParams(max_new_tokens=10)] * 3)
        while not all(s.finished for s in seqs):
            eng.step(seqs)
        tokens.append([s.tokens for s in seqs] + [eng.generate([7, 8, 9], SamplingParams(max_new_tokens=10))])
    assert tokens[0] == tokens[1]


def test_calibration_refuses_packed_experts(engines):
    from trtmoe.quant.calibrate import measure

    ids = torch.randint(4, 4000, (2, 16), generator=torch.Generator().manual_seed(9))
    with pytest.raises(InputError, match="plain weights"):
        measure(engines["auto"], ids, formats=("int8",))


def test_quantized_experts_large_blocks_go_to_onednn(tiny_model, tmp_path):
    model = tiny_model("mixtral", num_hidden_layers=1, hidden_size=256, intermediate_size=512, head_dim=64,
                       vocab_size=512, seed=6)
    with HFCheckpoint(model) as src:
        plan = uniform_plan(src.model, "int8")
    convert(model, tmp_path / "q", quant=plan, dtype="float32")
    engs = {m: EmbeddedEngine.from_checkpoint(tmp_path / "q", device="cpu", cpu_matmul=m) for m in ("auto", "blas")}
    ids = torch.randint(4, 500, (4, 128), generator=torch.Generator().manual_seed(4))
    ops = _ops(lambda: engs["auto"].logits(ids))
    # Some int8 expert's dequantized [in, out] weight, read as its [out, in] view.
    assert any(s[1] in ([1024, 256], [256, 512]) for s in ops.get(ONEDNN_OP, [])), ops.get(ONEDNN_OP)
    torch.testing.assert_close(engs["auto"].logits(ids), engs["blas"].logits(ids), rtol=1e-4, atol=1e-4)


def test_unknown_mode_is_refused(ckpt):
    with pytest.raises(InputError, match="cpu_matmul must be one of auto, blas"):
        EmbeddedEngine.from_checkpoint(ckpt, device="cpu", cpu_matmul="mkl")


def test_search_products_go_to_onednn_by_size():
    """The quantization searches' products with candidate weights (``matmul.linear``)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1024, 512, generator=g)
    big, small = torch.randn(64, 512, generator=g), torch.randn(4, 512, generator=g)
    ops = _ops(lambda: matmul.linear(big, w))
    assert [s[1] for s in ops.get(ONEDNN_OP, [])] == [[1024, 512]]  # 64 x 512 x 1024 = 32M multiply-adds
    torch.testing.assert_close(matmul.linear(big, w), big @ w.t(), rtol=1e-4, atol=1e-4)
    assert ONEDNN_OP not in _ops(lambda: matmul.linear(small, w))
    assert torch.equal(matmul.linear(small, w), small @ w.t())


def test_onednn_row_counts_are_rounded_and_padding_is_dropped():
    """oneDNN runs a product at ``rows_bucket`` rows (a bounded set of shapes, so its kernel cache
    stops missing); the padding rows never reach the result."""
    seen = set()
    for m in range(1, 5000):
        b = matmul.rows_bucket(m)
        assert m <= b <= max(m, m * 9 // 8 + 1)
        seen.add(b)
    assert len([b for b in seen if 1024 < b <= 2048]) == 8 and set(range(1, 17)) <= seen
    g = torch.Generator().manual_seed(10)
    w = torch.randn(1024, 512, generator=g)
    dense = matmul.Dense(w, "auto")
    packed = matmul.Packed(w)
    for shape in ((17, 512), (100, 512), (3, 37, 512)):
        x = torch.randn(*shape, generator=g)
        with torch.inference_mode():
            for y in (dense(x), packed(x)):
                assert y.shape == (*shape[:-1], 1024)
                torch.testing.assert_close(y, x @ w.t(), rtol=1e-4, atol=1e-4)
    x = torch.randn(100, 512, generator=g)
    ops = _ops(lambda: packed(x))
    assert [s[0] for s in ops[ONEDNN_OP]] == [[104, 512]]  # 100 rows run as 104
