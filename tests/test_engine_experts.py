"""Expert banks of the embedded engine: the grouped call a decode step makes (every busy expert over
its own block of rows) equals running the experts one by one, for float banks (bit for bit) and for
packed banks run as stacks, activation-aware INT4 included (each expert's own pre-quant scale)."""

from __future__ import annotations

import pytest
import torch

from trtmoe.checkpoint.writer import convert
from trtmoe.quant import awq
from trtmoe.quant.calibrate import measure, write_calibration
from trtmoe.quant.plan import QuantPlan
from trtmoe.runtime.engine import EmbeddedEngine
from trtmoe.runtime.experts import FloatExperts, PackedExperts

E, L = 8, 2


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("mixtral", num_local_experts=E, num_hidden_layers=L, seed=11, hidden_size=128,
                      intermediate_size=128, head_dim=32, dtype="bfloat16")


def _one_by_one(bank, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    ys, start = [], 0
    for e, n in enumerate(counts):
        if n:
            ys.append(bank.forward(e, x[start:start + n]))
            start += n
    return torch.cat(ys)


def _blocks(seed: int, hidden: int):
    g = torch.Generator().manual_seed(seed)
    for counts in ([1, 0, 0, 2, 0, 0, 0, 1], [3, 1, 4, 1, 5, 0, 2, 6], [0] * 7 + [9], [1] * 8):
        yield counts, torch.randn(sum(counts), hidden, generator=g)


def test_float_bank_grouped_equals_expert_by_expert(model, tmp_path):
    eng = EmbeddedEngine.from_checkpoint(convert(model, tmp_path / "ck").out_dir, device="cpu")
    bank = eng.layers[0].experts
    assert isinstance(bank, FloatExperts)
    for counts, x in _blocks(0, eng.cfg.hidden_size):
        assert torch.equal(bank.forward_grouped(x, counts), _one_by_one(bank, x, counts)), counts


def test_awq_experts_with_their_own_prequant_scales_run_stacked(model, tmp_path):
    ck = convert(model, tmp_path / "float").out_dir
    ids = torch.randint(0, 250, (8, 32), generator=torch.Generator().manual_seed(0))
    acts = awq.ActivationStats()
    res = measure(EmbeddedEngine.from_checkpoint(ck, device="cpu"), ids, formats=("int4_g128",), activations=acts)
    calib = tmp_path / "calib"
    calib.mkdir()
    acts.save(calib / awq.ACT_FILE)
    write_calibration(calib, res)
    plan = QuantPlan({l: ["int4_g128"] * E for l in range(L)}, granularity="expert", dtype=torch.bfloat16)
    plan = awq.attach(plan, "awq", calib)
    # The reference path (a serving engine runs these experts in the CPU kernels, one by one).
    eng = EmbeddedEngine.from_checkpoint(convert(model, tmp_path / "awq", quant=plan).out_dir, device="cpu",
                                         pack_experts=False)
    bank = eng.layers[1].experts
    assert isinstance(bank, PackedExperts)
    (st,) = bank._stacks  # one stack of all experts, although their pre-quant scales differ
    assert sorted(st.experts) == list(range(E))
    pq = st.fc["prequant_scaling_factor"]
    assert "prequant_scaling_factor" not in st.fc_shared and pq.shape[0] == E
    assert not torch.equal(pq[0], pq[1])
    for counts, x in _blocks(1, eng.cfg.hidden_size):
        got, want = bank.forward_grouped(x, counts), _one_by_one(bank, x, counts)
        # A stacked call is one batched matmul: float32 rounding may differ in the last bits.
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), counts
        # Without each expert's own scale the result would differ clearly.
        assert not torch.allclose(got, _without_prequant(bank, x, counts), rtol=1e-3, atol=1e-3)


def _without_prequant(bank, x, counts):
    ys, start = [], 0
    for e, n in enumerate(counts):
        if n:
            sh = bank.shards[e][0]
            fc = dict(sh.fc, prequant_scaling_factor=torch.ones_like(sh.fc["prequant_scaling_factor"]))
            h = sh.fc_fmt.linear(x[start:start + n], fc)
            up, gate = h.chunk(2, dim=-1)
            ys.append(sh.proj_fmt.linear(torch.nn.functional.silu(gate) * up, sh.proj))
            start += n
    return torch.cat(ys)


def _uniform(model, fmt):
    from trtmoe.hf.reader import HFCheckpoint
    from trtmoe.quant.plan import uniform_plan

    with HFCheckpoint(model) as src:
        return uniform_plan(src.model, fmt)


@pytest.mark.parametrize("fmt", [None, "int8", "int4_g64"])
def test_one_token_picks_equal_expert_by_expert(model, tmp_path, fmt):
    """A decode step's one-token block runs its top-k experts through ``forward_picks`` (a packed
    bank: one stacked call per matrix on the token); each output equals that expert alone."""
    quant = _uniform(model, fmt) if fmt else None
    eng = EmbeddedEngine.from_checkpoint(convert(model, tmp_path / "ck", quant=quant).out_dir, device="cpu")
    bank = eng.layers[0].experts
    assert isinstance(bank, PackedExperts if fmt else FloatExperts)
    x = torch.randn(1, eng.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    for picks in ([3], [1, 5], [0, 2, 7], list(range(E))):
        got = bank.forward_picks(x, picks)
        assert len(got) == len(picks)
        for e, y in zip(picks, got):
            want = bank.forward(e, x)
            assert y.shape == want.shape == (1, eng.cfg.hidden_size)
            if fmt is None:
                assert torch.equal(y, want), (picks, e)
            else:  # a stacked call is one batched matmul: the last bits may differ
                assert torch.allclose(y, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), (picks, e)


@pytest.mark.parametrize("fmt", [None, "int4_g64"])
@torch.inference_mode()
def test_one_token_moe_block_equals_the_grouped_path(model, tmp_path, fmt):
    """The MoE layer's one-token shortcut gives what the grouped path computes for the same token
    inside a bigger block (up to float32 rounding: a matmul over more rows may round differently)."""
    quant = _uniform(model, fmt) if fmt else None
    eng = EmbeddedEngine.from_checkpoint(convert(model, tmp_path / "ck", quant=quant).out_dir, device="cpu")
    g = torch.Generator().manual_seed(4)
    lay = eng.layers[1]
    for _ in range(4):
        h = torch.randn(3, eng.cfg.hidden_size, generator=g)
        alone = eng._moe(1, lay, h[:1], stats=[])
        grouped = eng._moe(1, lay, h, stats=[])[:1]
        assert torch.allclose(alone, grouped, rtol=1e-5, atol=1e-5 * float(grouped.abs().max()))
        assert not torch.allclose(alone, eng._moe(1, lay, h[1:2], stats=[]), rtol=1e-3, atol=1e-3)
