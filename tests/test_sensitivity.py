"""Fisher sensitivity (the default): agreement with the exact end-to-end ΔKL on the trained fixture,
the probes' covariance, a cost that does not grow with the number of experts, resumption after a kill
or an interrupt, and the calib.json layout every consumer reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy.stats import spearmanr

from trtmoe.checkpoint.writer import convert
from trtmoe.data import split_texts, write_split_text
from trtmoe.quant.calibrate import calibrate, measure, token_batches
from trtmoe.quant.policies import build_units, make_plan
from trtmoe.quant.sensitivity import _probe, fisher_measure
from trtmoe.runtime.engine import EmbeddedEngine
from trtmoe.runtime.load import load_tokenizer

from test_quant_pipeline import make_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "trained_mixtral"


@pytest.mark.parametrize("kind", ["gaussian", "sample"])
def test_probe_covariance_is_the_softmax_fisher(kind):
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0, 1.5]])
    p = logits.softmax(-1)[0]
    want = torch.diag(p) - torch.outer(p, p)
    gen = torch.Generator().manual_seed(0)
    v = _probe(logits.expand(200_000, 5), kind, gen)
    got = v.T.double() @ v.double() / v.shape[0]
    assert torch.allclose(got, want.double(), atol=4e-3)
    assert v.sum(-1).abs().max() < 1e-5  # a probe never moves the logits' common offset


# How closely Fisher must agree with the exact ΔKL on the trained fixture (16 × 64 calibration
# tokens, int4). Measured: expert Spearman rho 0.976 / 0.929 / 0.881 / 0.976 for layers 0-3, so
# layer 2 passes EXPERT_RHO_MIN by 0.031; matrix rho at least 0.595 (layer 2 fc, a margin of 0.045);
# summed Fisher / summed exact 0.79. A run that fails by a little is a finding about the estimate,
# not a reason to lower these: test_agreement_thresholds_stay_where_they_were_set pins them, so a
# change shows in review.
EXPERT_RHO_MIN = 0.85
MATRIX_RHO_MIN = 0.55
TOTAL_RATIO_MAX = 1.5


def test_agreement_thresholds_stay_where_they_were_set():
    assert (EXPERT_RHO_MIN, MATRIX_RHO_MIN, TOTAL_RATIO_MAX) == (0.85, 0.55, 1.5)


@pytest.fixture(scope="module")
def fixture_pair(tmp_path_factory):
    """Fisher and exact (RTN) sensitivities of the trained fixture on the same 16 × 64 calibration tokens."""
    ck = convert(FIXTURE, tmp_path_factory.mktemp("ck") / "ck").out_dir
    ids = token_batches(split_texts("calib", max_bytes=64 * 16 * 64), load_tokenizer(FIXTURE), 16, 64)
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    return fisher_measure(eng, ids, formats=("int4",)), measure(eng, ids, formats=("int4",), rounding="rtn")


def test_fisher_ranks_experts_as_the_exact_kl_does(fixture_pair):
    fi, ex = fixture_pair
    for l in ex["moe_layers"]:
        rho = spearmanr(ex["sensitivity"]["delta_kl"]["int4"][l], fi["sensitivity"]["delta_kl"]["int4"][l]).statistic
        assert rho >= EXPERT_RHO_MIN, (l, rho)
        for m in ("fc", "proj"):
            a = ex["sensitivity"]["matrices"][m]["measured"]["int4"][l]
            b = fi["sensitivity"]["matrices"][m]["measured"]["int4"][l]
            assert spearmanr(a, b).statistic >= MATRIX_RHO_MIN, (l, m, spearmanr(a, b).statistic)
    # Same currency: the summed estimate is within a factor 1.5 of the summed measurement.
    tot = lambda c: sum(map(sum, c["sensitivity"]["delta_kl"]["int4"]))  # noqa: E731
    assert 1 / TOTAL_RATIO_MAX < tot(fi) / tot(ex) < TOTAL_RATIO_MAX, tot(fi) / tot(ex)


def test_fisher_calibration_has_the_layout_consumers_read(fixture_pair):
    fi, ex = fixture_pair
    assert fi["sensitivity"]["method"] == "fisher" and set(fi) == set(ex) - {"rounding", "activations"}
    assert set(fi["routing"]) == set(ex["routing"])
    assert fi["routing"]["counts"] == ex["routing"]["counts"]  # the same reference pass
    for m in ("fc", "proj"):
        assert {"delta_kl", "measured", "estimated"} <= set(fi["sensitivity"]["matrices"][m])
    for l in fi["moe_layers"]:
        for e in range(fi["num_experts"]):
            s = fi["sensitivity"]
            assert s["delta_kl"]["int4"][l][e] == pytest.approx(
                s["matrices"]["fc"]["delta_kl"]["int4"][l][e] + s["matrices"]["proj"]["delta_kl"]["int4"][l][e])
    plan = make_plan(fi, "graded", budget_bpw=6.0, granularity="matrix", dtype=torch.bfloat16)
    assert plan.used_formats() <= {"float", "int4"} and build_units(fi, "expert", torch.bfloat16)
    # Under-observed experts also get the estimate from the layer's tokens.
    for u in fi["routing"]["under_observed"]:
        est = fi["sensitivity"]["matrices"]["proj"]["estimated"]["int4"][u["layer"]][u["expert"]]
        assert est > 0


def test_cost_does_not_grow_with_the_number_of_experts(tiny_model, tmp_path):
    costs = {}
    ids = torch.randint(0, 250, (4, 32), generator=torch.Generator().manual_seed(3))
    for E in (4, 16):
        hf = tiny_model("mixtral", num_local_experts=E, num_hidden_layers=2, seed=7)
        eng = EmbeddedEngine.from_checkpoint(convert(hf, tmp_path / f"ck{E}").out_dir, device="cpu")
        fi = fisher_measure(eng, ids, formats=("int8", "int4"))
        costs[E] = fi["sensitivity"]["cost_forward_passes"]
        ex = measure(eng, ids[:2, :16], formats=("int8",), rounding="rtn")
        costs[f"exact{E}"] = ex["sensitivity"]["cost_forward_passes"]
    assert costs[4] <= 6 and costs[16] <= 6
    # 16 experts on 128 tokens starve most of them: their estimate adds at most 1/16 of the scoring.
    assert abs(costs[4] - costs[16]) < 0.15 * costs[4]
    assert costs["exact16"] > 2 * costs["exact4"]  # the oracle's cost grows with E


@pytest.fixture(scope="module")
def small(tiny_model, tmp_path_factory):
    model = tiny_model("mixtral", num_local_experts=4, num_hidden_layers=2, seed=5)
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    text = tmp_path_factory.mktemp("txt") / "calib.txt"
    write_split_text("calib", text, max_bytes=8_000)
    return model, tok, text


_CHILD = (
    "import os, signal, sys\n"
    "import torch\n"
    "torch.set_num_threads(1)  # as the parent's one_torch_thread: the same products, the same bytes\n"
    "from trtmoe.quant.calibrate import calibrate\n"
    "n = [0]\n"
    "def stop(what, d, t):\n"
    "    n[0] += 1\n"
    "    if n[0] == int(sys.argv[5]):\n"
    "        if sys.argv[6] == 'kill': os.kill(os.getpid(), signal.SIGKILL)\n"
    "        raise KeyboardInterrupt\n"
    "calibrate(sys.argv[1], sys.argv[2], sys.argv[4], tokenizer=sys.argv[3], samples=4, seq_len=16, batch_size=2,\n"
    "          formats=('int8', 'int4'), rounding=sys.argv[7], progress=stop)\n")


@pytest.mark.parametrize("how,rounding", [("kill", "rtn"), ("interrupt", "awq")])
def test_an_interrupted_calibration_resumes_and_gives_the_same_result(small, tmp_path, how, rounding):
    model, tok, text = small
    fresh = calibrate(model, text, tmp_path / "fresh", tokenizer=tok, samples=4, seq_len=16, batch_size=2,
                      formats=("int8", "int4"), rounding=rounding)
    out = tmp_path / "calib"
    # Progress calls: 2 batches, then 4 experts per layer, one call per expert, then one per layer:
    # stop inside the second layer, after the first layer's result is on disk.
    r = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(text), str(tok), str(out), "10", how,
                        rounding], cwd=REPO, capture_output=True, text=True)
    assert r.returncode != 0 and not out.exists()
    left = list(tmp_path.glob(".calib.trtmoe-partial-*"))
    assert len(left) == 1
    layers = left[0] / "sensitivity-progress" / "layers"
    assert sorted(p.name for p in layers.iterdir()) == ["layer-000.safetensors"], r.stderr[-2000:]
    notes = []
    res = calibrate(model, text, out, tokenizer=tok, samples=4, seq_len=16, batch_size=2,
                    formats=("int8", "int4"), rounding=rounding, notes=notes)
    assert any("2 of 2 batches and 1 of 2 MoE layers were already done" in n for n in notes), notes
    assert not list(tmp_path.glob(".calib*"))
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "fresh").iterdir())
    assert (out / "calib.json").read_bytes().replace(str(out).encode(), b"") == \
        (tmp_path / "fresh" / "calib.json").read_bytes().replace(str(tmp_path / "fresh").encode(), b"")
    assert res["sensitivity"] == fresh["sensitivity"]
    # The recipes of the layer scored before the stop come back from its progress, byte for byte.
    assert (rounding == "awq") == (out / "recipes" / "0.safetensors").is_file()
    for name in ("activations.safetensors", "recipes/0.safetensors", "recipes/1.safetensors"):
        if (out / name).exists():
            assert (out / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()


def test_progress_of_other_inputs_is_not_reused(small, tmp_path):
    model, tok, text = small
    out = tmp_path / "calib"
    r = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(text), str(tok), str(out), "10", "kill",
                        "rtn"], cwd=REPO, capture_output=True)
    assert r.returncode == -9
    notes = []
    other = calibrate(model, text, out, tokenizer=tok, samples=4, seq_len=16, batch_size=2, formats=("int8",),
                      rounding="rtn", notes=notes)
    assert not any("resumed" in n for n in notes)
    assert other["formats"] == ["int8"]


def test_exact_is_still_selectable_and_reproduces_measure(small, tmp_path):
    model, tok, text = small
    ex = calibrate(model, text, None, tokenizer=tok, samples=2, seq_len=16, formats=("int8",), rounding="rtn",
                   sensitivity="exact")
    assert ex["sensitivity"]["method"] == "exact"
    ck = convert(model, tmp_path / "ck").out_dir
    tok_ = load_tokenizer(tok)
    tok_.add_bos = ex["tokens"]["add_bos"]
    from trtmoe.data import load_texts

    ids = token_batches(load_texts(text), tok_, 2, 16)
    direct = measure(EmbeddedEngine.from_checkpoint(ck, device="cpu"), ids, formats=("int8",), rounding="rtn")
    assert ex["sensitivity"]["delta_kl"] == direct["sensitivity"]["delta_kl"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fisher_on_cuda_agrees_with_cpu(tiny_model, tmp_path):
    hf = tiny_model("mixtral", num_local_experts=4, num_hidden_layers=2, seed=5)
    ck = convert(hf, tmp_path / "ck").out_dir
    ids = torch.randint(0, 250, (4, 32), generator=torch.Generator().manual_seed(3))
    cpu = fisher_measure(EmbeddedEngine.from_checkpoint(ck, device="cpu"), ids, formats=("int4",))
    gpu = fisher_measure(EmbeddedEngine.from_checkpoint(ck, device="cuda", compute_dtype=torch.float32), ids,
                         formats=("int4",))
    a = torch.tensor(cpu["sensitivity"]["delta_kl"]["int4"])
    b = torch.tensor(gpu["sensitivity"]["delta_kl"]["int4"])
    assert torch.allclose(a, b, rtol=0.05, atol=1e-9)
