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
    eng = EmbeddedEngine.from_checkpoint(convert(model, tmp_path / "awq", quant=plan).out_dir, device="cpu")
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
