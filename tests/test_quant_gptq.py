"""Error-feedback INT4 rounding (``--rounding gptq`` / ``awq_gptq``): only the codes change — the scales,
the packed layout and the dequantization are the format's own — the codes lower the output error on the
routed tokens' Gram matrix below round-to-nearest (and below awq alone), calibration keeps that Gram
matrix only for these roundings, and the embedded checkpoint stores the codes calibration measured."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from trtmoe.checkpoint.writer import convert
from trtmoe.quant import ROUNDING_NAMES, awq, gptq
from trtmoe.quant.calibrate import measure, write_calibration
from trtmoe.quant.formats import FORMATS, unpack_int4
from trtmoe.quant.plan import QuantPlan
from trtmoe.runtime.engine import EmbeddedEngine

INT4 = ("int4", "int4_g128", "int4_g64")
DT = torch.bfloat16


def _correlated(n: int, d: int, seed: int, mix_seed: int = 0) -> torch.Tensor:
    """Rows with correlated channels of uneven scale (what makes error feedback pay); ``mix_seed`` fixes
    the distribution, ``seed`` the sample."""
    mix = torch.randn(d, d, generator=torch.Generator().manual_seed(mix_seed)) / d ** 0.5 + torch.eye(d)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(1000 + seed)) @ mix
    return (x * torch.linspace(0.2, 2.0, d)).to(DT)


def _matrix(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    return (torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05).to(DT)


def _stats(x: torch.Tensor) -> awq.MatrixStats:
    return awq.MatrixStats(x.double().abs().mean(0).float(), x[:256].clone(), x.shape[0], "routed", gptq.gram(x))


def test_roundings_are_the_package_names():
    assert awq.ROUNDINGS == ROUNDING_NAMES and set(awq.ERROR_FEEDBACK) < set(ROUNDING_NAMES)


@pytest.mark.parametrize("name", INT4)
@pytest.mark.parametrize("rounding", ["gptq", "awq_gptq"])
def test_only_codes_change_and_error_drops(name, rounding):
    """Same tensors, shapes and dtypes as the format writes; scales equal those the format computes from
    the (transformed) weight; error on held-out rows of the same distribution is below RTN's."""
    fmt = FORMATS[name]
    w, x, xh = _matrix(96, 256, 1), _correlated(4096, 256, 2), _correlated(2048, 256, 3)
    st = _stats(x)
    rec = awq.recipe_for(fmt, w, DT, st, rounding=rounding)
    assert rec is not None and rec.codes is not None and rec.codes.dtype == torch.int8
    assert int(rec.codes.min()) >= -8 and int(rec.codes.max()) <= 7
    packed = awq.quantize(fmt, w, dtype=DT, stats=st, rounding=rounding)
    base = fmt.quantize(awq.transformed_weight(fmt, w, DT, rec), dtype=DT)
    assert packed.keys() == base.keys() | ({"prequant_scaling_factor"} if rec.pq is not None else set())
    for k, v in base.items():
        assert packed[k].shape == v.shape and packed[k].dtype == v.dtype, k
        if k != "weight" and not (k == "prequant_scaling_factor" and rec.pq is not None):
            assert torch.equal(packed[k], v), k  # the scales are the format's own
    codes = unpack_int4(packed["weight"], dim=-2) if name != "int4" else unpack_int4(packed["weight"], dim=-1).t()
    assert torch.equal(codes, rec.codes)
    assert not torch.equal(packed["weight"], base["weight"])
    rtn = fmt.quantize(w, dtype=DT)
    for rows, margin in ((x, 0.8), (xh, 0.9)):
        e_new = awq.output_error(fmt, packed, w, rows, DT)
        e_rtn = awq.output_error(fmt, rtn, w, rows, DT)
        assert e_new < margin * e_rtn, (rows.shape, e_new, e_rtn)
    if rounding == "awq_gptq":  # codes on top of awq's scale and clip do better than awq alone
        e_awq = awq.output_error(fmt, awq.quantize(fmt, w, dtype=DT, stats=st, rounding="awq"), w, xh, DT)
        assert awq.output_error(fmt, packed, w, xh, DT) < e_awq


def test_codes_never_worse_than_the_base_on_the_gram():
    """The kept candidate's Gram-matrix error is at most the base recipe's (round to nearest here)."""
    fmt = FORMATS["int4_g128"]
    for seed in range(4):
        w, x = _matrix(64, 128, 10 + seed), _correlated(2048, 128, 20 + seed, seed)
        st = _stats(x)
        rec = awq.with_codes(fmt, w, DT, st, None)
        wd = w.float()
        rtn_err = awq._gram_err(st.gram, wd, awq._fake_group(wd, 128, DT), None)
        got = rtn_err if rec is None else awq._gram_err(st.gram, wd, awq._dequant_codes(fmt, wd, rec.codes, DT), None)
        assert got <= rtn_err
        direct = float(((x.float() @ wd.t() - x.float() @ awq._dequant_codes(fmt, wd, rec.codes, DT).t()) ** 2
                        ).double().sum())
        assert got == pytest.approx(direct, rel=1e-3)  # tr(D H Dᵀ) is the summed output error


def test_error_feedback_reduces_to_rounding_when_inputs_are_uncorrelated():
    """With H diagonal no error is fed forward: the codes are round-to-nearest's."""
    fmt = FORMATS["int4_g64"]
    w = _matrix(32, 128, 5).float()
    qs, ds = awq._format_scales(fmt, w, DT)
    q = gptq.codes(w, qs, ds, torch.diag(torch.rand(128) + 0.5), DT)
    want = unpack_int4(fmt.quantize(w.to(DT), dtype=DT)["weight"], dim=-2)
    assert torch.equal(q, want)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("mixtral", num_local_experts=4, num_hidden_layers=2, seed=11, hidden_size=128,
                      intermediate_size=128, head_dim=32, dtype="bfloat16")


@pytest.fixture(scope="module")
def cal(model, tmp_path_factory):
    """awq and awq_gptq calibration artifacts of the tiny model (exact ΔKL, int4_g128)."""
    tmp = tmp_path_factory.mktemp("gptqcal")
    ck = convert(model, tmp / "ck").out_dir
    ids = torch.randint(0, 250, (4, 32), generator=torch.Generator().manual_seed(0))
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    acts = {}
    for r in ("awq", "awq_gptq"):
        acts[r] = awq.ActivationStats()
        res = measure(eng, ids, formats=("int4_g128",), activations=acts[r], rounding=r)
        out = tmp / r
        out.mkdir()
        acts[r].save(out / awq.ACT_FILE)
        write_calibration(out, res)
    return {"dir": {r: tmp / r for r in acts}, "acts": acts}


def _experts(model, l, e):
    src = load_file(str(model / "model.safetensors"))
    q = f"model.layers.{l}.block_sparse_moe.experts.{e}."
    return {"fc": torch.cat([src[q + "w3.weight"], src[q + "w1.weight"]]), "proj": src[q + "w2.weight"]}


def test_calibration_keeps_the_gram_only_for_error_feedback(model, cal, tmp_path):
    """awq calibrations store no Gram matrix (their artifact is unchanged); awq_gptq stores X^T X over
    every routed token, round-trips it, and the embedded checkpoint holds exactly what calibration's
    ΔKL quantized."""
    acts = cal["acts"]
    assert all(s.gram is None for s in acts["awq"].stats.values())
    assert "gram_matrices" not in acts["awq"].summary()
    loaded = awq.ActivationStats.load(cal["dir"]["awq_gptq"] / awq.ACT_FILE)
    for key, s in acts["awq_gptq"].stats.items():
        assert s.gram is not None and s.gram.shape == (s.rows.shape[1],) * 2
        assert torch.equal(loaded.stats[key].gram, s.gram)
    plan = QuantPlan({l: ["int4_g128"] * 4 for l in range(2)}, granularity="matrix", dtype=DT)
    plan = awq.attach(plan, "awq_gptq", cal["dir"]["awq_gptq"])
    assert plan.meta["rounding"] == "awq_gptq"
    out = convert(model, tmp_path / "q", quant=plan).out_dir
    got = load_file(str(out / "rank0.safetensors"))
    fmt = FORMATS["int4_g128"]
    for l in range(2):
        for e in range(4):
            w = _experts(model, l, e)
            for m in ("fc", "proj"):
                want = awq.quantize(fmt, w[m], dtype=DT, stats=loaded.get(l, e, m), rounding="awq_gptq")
                for k, v in want.items():
                    assert torch.equal(got[f"transformer.layers.{l}.mlp.experts.{e}.{m}.{k}"], v), (l, e, m, k)


def test_tensorrt_llm_layout_keeps_the_shared_scale_and_changes_only_codes(model, cal, tmp_path):
    """In TensorRT-LLM's stacked layout awq_gptq writes awq's layer-shared pre-quant scale and the same
    scale shapes, and its codes lower each expert's error over the routed tokens' Gram matrix."""
    from click.testing import CliRunner

    from trtmoe.cli import main

    outs = {}
    for r in ("awq", "awq_gptq"):
        outs[r] = tmp_path / r
        res = CliRunner().invoke(main, ["convert", str(model), "-o", str(outs[r]), "--calib", str(cal["dir"][r]),
                                        "--policy", "uniform", "--format", "int4_g128", "--target", "tensorrt-llm",
                                        "--rounding", r], catch_exceptions=False)
        assert res.exit_code == 0, res.output
    a, g = (load_file(str(outs[r] / "rank0.safetensors")) for r in ("awq", "awq_gptq"))
    assert a.keys() == g.keys() and all(a[k].shape == g[k].shape and a[k].dtype == g[k].dtype for k in a)
    assert (outs["awq"] / "config.json").read_bytes() == (outs["awq_gptq"] / "config.json").read_bytes()
    fmt = FORMATS["int4_g128"]
    stats = cal["acts"]["awq_gptq"]
    for l in range(2):
        for m in ("fc", "proj"):
            p = f"transformer.layers.{l}.mlp.{m}."
            assert torch.equal(a[p + "prequant_scaling_factor"], g[p + "prequant_scaling_factor"])
            assert not torch.equal(a[p + "weight"], g[p + "weight"])
            for e in range(4):
                w = _experts(model, l, e)[m].float()
                errs = []
                for t in (a, g):
                    pq = t[p + "prequant_scaling_factor"].reshape(-1)
                    deq = (unpack_int4(t[p + "weight"][e], dim=-2).to(DT)
                           * t[p + "weights_scaling_factor"][e].repeat_interleave(128, -1)).float()
                    h = stats.get(l, e, m).gram * torch.outer(pq.float(), pq.float())
                    errs.append(awq._gram_err(h, w, deq, pq))
                assert errs[1] <= errs[0] * (1 + 1e-6), (l, m, e, errs)
    # Per-channel W4A16 layers are stored as float (trtllm-build quantizes them): codes cannot be, so
    # awq_gptq stores awq's clipped weights there, byte for byte.
    for r in ("awq", "awq_gptq"):
        res = CliRunner().invoke(main, ["convert", str(model), "-o", str(tmp_path / f"pc-{r}"), "--calib",
                                        str(cal["dir"][r]), "--policy", "uniform", "--format", "int4", "--target",
                                        "tensorrt-llm", "--rounding", r], catch_exceptions=False)
        assert res.exit_code == 0, res.output
    assert (tmp_path / "pc-awq" / "rank0.safetensors").read_bytes() == \
        (tmp_path / "pc-awq_gptq" / "rank0.safetensors").read_bytes()


def test_too_few_rows_and_no_gram_keeps_the_base_recipe():
    """Without a Gram matrix and with fewer than MIN_ROWS_PER_INPUT sampled rows per input channel the
    codes would fit the sample's noise: no codes are chosen (gptq = RTN, awq_gptq = awq)."""
    fmt = FORMATS["int4_g128"]
    w, x = _matrix(64, 128, 3), _correlated(4 * 128, 128, 4)
    st = awq.MatrixStats(x.double().abs().mean(0).float(), x, x.shape[0], "routed", None)
    assert awq.recipe_for(fmt, w, DT, st, rounding="gptq") is None
    a = awq.recipe_for(fmt, w, DT, st, rounding="awq")
    b = awq.recipe_for(fmt, w, DT, st, rounding="awq_gptq")
    assert b is not None and b.codes is None and torch.equal(a.pq, b.pq)
    x = _correlated(awq.MIN_ROWS_PER_INPUT * 128, 128, 4)
    st = awq.MatrixStats(x.double().abs().mean(0).float(), x, x.shape[0], "routed", None)
    assert awq.recipe_for(fmt, w, DT, st, rounding="gptq").codes is not None
