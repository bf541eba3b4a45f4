"""Error-feedback INT4 rounding (``--rounding gptq`` / ``awq_gptq``): only the codes change — the scales,
the packed layout and the dequantization are the format's own — the codes lower the output error on the
routed tokens' Gram matrix below round-to-nearest (and below awq alone), calibration keeps that Gram
matrix only for these roundings, and the embedded checkpoint stores the codes calibration measured.
Matrices with more than ``max_gram_in`` inputs get their Gram matrix rebuilt at convert time from the
layers' stored MoE inputs: bit for bit the stored one on the same tokens, in bounded memory and size."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_codes_are_chosen_on_the_base_scale_without_its_clip_with_one_factorization(monkeypatch):
    """A base recipe with a pre-quant scale and a clip: the codes are rounded once, against the Gram
    matrix of the scaled input (one factorization), on the scaled weight without the clip; the recipe
    keeps the base's scale, records the base's clip, and its error is below the base's."""
    fmt = FORMATS["int4_g128"]
    w, x = _matrix(64, 128, 5), _correlated(2048, 128, 6, 2)
    st = _stats(x)
    base = awq._awq_recipe(fmt, w, DT, st, "search")
    assert base is not None and base.pq is not None and base.clip is not None
    calls, rounded = [], []
    real, real_codes = gptq.factor, gptq.codes
    monkeypatch.setattr(gptq, "factor", lambda h, *a, **k: calls.append(h) or real(h, *a, **k))
    monkeypatch.setattr(gptq, "codes", lambda w, *a, **k: rounded.append(w) or real_codes(w, *a, **k))
    awq._FACTORS.clear()
    won = []
    rec = awq.with_codes(fmt, w, DT, st, base, on_choice=won.append)
    pq = base.pq.float()
    assert len(calls) == 1 and torch.allclose(calls[0], st.gram.float() * torch.outer(pq, pq))
    assert len(rounded) == 1
    assert torch.equal(rounded[0], awq.transformed_weight(fmt, w, DT, awq.Recipe(base.pq, None)).float())
    assert won == [0] and rec.pq is base.pq and rec.clip is None and rec.base_clip is base.clip
    wd = awq._in_dtype(w, DT)
    deq_base = awq._fake(fmt, awq.transformed_weight(fmt, w, DT, base).float(), DT, base.clip)
    wt = awq.transformed_weight(fmt, w, DT, rec).float()
    h = st.gram.float() * torch.outer(pq, pq)
    assert awq._gram_err(h, wd, awq._dequant_codes(fmt, wt, rec.codes, DT), base.pq) \
        < awq._gram_err(h, wd, deq_base, base.pq)
    again = awq.with_codes(fmt, w, DT, st, base, choice=0)  # a stored choice: the same codes, no errors
    assert torch.equal(again.codes, rec.codes) and again.pq is base.pq and again.base_clip is base.clip
    assert awq.with_codes(fmt, w, DT, st, base, choice=-1) is base


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
    """awq and awq_gptq calibration artifacts of the tiny model (exact ΔKL, int4_g128); awq_gptq with
    every Gram matrix stored (max_gram_in=1024)."""
    tmp = tmp_path_factory.mktemp("gptqcal")
    ck = convert(model, tmp / "ck").out_dir
    ids = torch.randint(0, 250, (4, 32), generator=torch.Generator().manual_seed(0))
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    acts = {}
    for r in ("awq", "awq_gptq"):
        acts[r] = awq.ActivationStats()
        res = measure(eng, ids, formats=("int4_g128",), activations=acts[r], rounding=r, max_gram_in=1024)
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
    """awq calibrations have no Gram matrix; awq_gptq with max_gram_in=1024 stores X^T X over every
    routed token, round-trips it, and the embedded checkpoint holds exactly what calibration's ΔKL
    quantized."""
    acts = cal["acts"]
    assert all(s.gram is None and s.gram_matrix() is None for s in acts["awq"].stats.values())
    assert "gram_matrices" not in acts["awq"].summary() and "gram_from_inputs" not in acts["awq"].summary()
    loaded = awq.ActivationStats.load(cal["dir"]["awq_gptq"] / awq.ACT_FILE)
    for key, s in acts["awq_gptq"].stats.items():
        assert s.gram is not None and s.gram.shape == (s.rows.shape[1],) * 2
        assert torch.equal(loaded.get(*key).gram, s.gram)
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
                want = awq.quantize(fmt, w[m], dtype=DT, stats=loaded.get(l, e, m).with_fc(w["fc"]),
                                    rounding="awq_gptq")
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
                    h = stats.get(l, e, m).gram_matrix() * torch.outer(pq.float(), pq.float())
                    errs.append(awq._gram_err(h, w, deq, pq))
                assert errs[1] <= errs[0] * (1 + 1e-6), (l, m, e, errs)
    # Per-channel W4A16 layers are stored as float (trtllm-build quantizes them): codes cannot be. Asked
    # for by name, awq_gptq is refused; taken from the calibration, the checkpoint is rounded with what
    # reaches the engine (awq's clipped weights, byte for byte) and the manifest says awq.
    res = CliRunner().invoke(main, ["convert", str(model), "-o", str(tmp_path / "pc-named"), "--calib",
                                    str(cal["dir"]["awq_gptq"]), "--policy", "uniform", "--format", "int4",
                                    "--target", "tensorrt-llm", "--rounding", "awq_gptq"])
    assert res.exit_code == 2 and "--rounding awq_gptq" in res.stderr and "codes" in res.stderr, res.output
    assert not (tmp_path / "pc-named").exists()
    for r, named in (("awq", ["--rounding", "awq"]), ("awq_gptq", [])):
        res = CliRunner().invoke(main, ["convert", str(model), "-o", str(tmp_path / f"pc-{r}"), "--calib",
                                        str(cal["dir"][r]), "--policy", "uniform", "--format", "int4", "--target",
                                        "tensorrt-llm", *named], catch_exceptions=False)
        assert res.exit_code == 0, res.output
    assert (tmp_path / "pc-awq" / "rank0.safetensors").read_bytes() == \
        (tmp_path / "pc-awq_gptq" / "rank0.safetensors").read_bytes()
    q = json.loads((tmp_path / "pc-awq_gptq" / "manifest.json").read_text())["quantization"]
    assert q["rounding"] == "awq", q


def test_uniform_per_channel_int4_keeps_the_codes_on_the_embedded_target(model, cal, tmp_path):
    """``--policy uniform --format int4 --rounding awq_gptq`` writes the error-feedback codes (each expert
    packed: the layer layout would store float weights the engine rounds to nearest), so its bytes
    differ from awq's and its error over every routed token is lower; the manifest says what was done.
    The layer layout asked for by name with those codes is refused."""
    from click.testing import CliRunner

    from trtmoe.cli import main

    outs = {}
    for r in ("awq", "awq_gptq"):
        outs[r] = tmp_path / r
        res = CliRunner().invoke(main, ["convert", str(model), "-o", str(outs[r]), "--calib", str(cal["dir"][r]),
                                        "--policy", "uniform", "--format", "int4", "--rounding", r],
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
    man = {r: json.loads((outs[r] / "manifest.json").read_text())["quantization"] for r in outs}
    assert man["awq_gptq"]["rounding"] == "awq_gptq" and man["awq"]["rounding"] == "awq"
    a, g = (load_file(str(outs[r] / "rank0.safetensors")) for r in ("awq", "awq_gptq"))
    fmt = FORMATS["int4"]
    stats = cal["acts"]["awq_gptq"]
    worse = better = 0
    for l in range(2):
        for m in ("fc", "proj"):
            for e in range(4):
                w = _experts(model, l, e)[m]
                h = stats.get(l, e, m).with_fc(_experts(model, l, e)["fc"]).gram_matrix()
                # awq: float weights (clipped) that the engine rounds to nearest per channel at load
                fw = a[f"transformer.layers.{l}.mlp.{'fc' if m == 'fc' else 'proj'}.weight"][e]
                pa = fmt.quantize(fw, dtype=DT)
                # awq_gptq: the packed codes of each expert
                p = f"transformer.layers.{l}.mlp.experts.{e}.{m}."
                pg = {k: g[p + k] for k in pa}
                assert not torch.equal(pa["weight"], pg["weight"]), (l, m, e)
                errs = [awq._gram_err(h, w.float(), (unpack_int4(t["weight"], dim=-1).t().to(DT)
                                                     * t["per_channel_scale"].unsqueeze(-1)).float(), None)
                        for t in (pa, pg)]
                better += errs[1] < errs[0]
                worse += errs[1] > errs[0] * (1 + 1e-6)
    assert worse == 0 and better > 0, (better, worse)
    res = CliRunner().invoke(main, ["convert", str(model), "-o", str(tmp_path / "layer"), "--calib",
                                    str(cal["dir"]["awq_gptq"]), "--policy", "uniform", "--format", "int4",
                                    "--granularity", "layer", "--rounding", "awq_gptq"])
    assert res.exit_code == 2 and "--granularity expert" in res.stderr, res.output


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


# ---------------------------------------------------------------------------------------------
# Gram matrices rebuilt from the stored MoE inputs (matrices with more than max_gram_in inputs)


@pytest.fixture(scope="module")
def cal_inputs(model, tmp_path_factory):
    """The ``cal`` fixture's awq_gptq calibration of the same tokens with ``max_gram_in=0``: no Gram
    matrix stored, every one rebuilt from the layers' stored MoE inputs."""
    tmp = tmp_path_factory.mktemp("gptqin")
    ck = convert(model, tmp / "ck").out_dir
    ids = torch.randint(0, 250, (4, 32), generator=torch.Generator().manual_seed(0))
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    out = tmp / "awq_gptq"
    acts = awq.ActivationStats(inputs_dir=out / awq.INPUTS_DIR)
    res = measure(eng, ids, formats=("int4_g128",), activations=acts, rounding="awq_gptq", max_gram_in=0)
    acts.save(out / awq.ACT_FILE)
    write_calibration(out, res)
    return {"dir": out, "acts": acts, "res": res}


def test_rebuilt_gram_equals_the_stored_one_and_so_do_the_codes(model, cal, cal_inputs, tmp_path):
    """From the same tokens, the Gram matrix rebuilt at convert time (fc: the routed rows; proj:
    silu(gate x) * up x from the float fc weight) is bit for bit the stored one, so calibration's ΔKL and
    every checkpoint byte (per expert matrix; per-channel int4 with proj's inputs split by moe_tp) are
    those of the stored-Gram path."""
    import json

    from click.testing import CliRunner

    from trtmoe.cli import main

    stored = awq.ActivationStats.load(cal["dir"]["awq_gptq"] / awq.ACT_FILE)
    loaded = awq.ActivationStats.load(cal_inputs["dir"] / awq.ACT_FILE)
    assert loaded.stats.keys() == stored.stats.keys() and len(stored.stats) == 16
    summary = cal_inputs["acts"].summary()
    assert summary["gram_from_inputs"] == 16 and "gram_matrices" not in summary
    for (l, e, m) in sorted(loaded.stats):
        s, ref = loaded.get(l, e, m), stored.get(l, e, m)
        assert s.gram is None and s.inputs is not None
        g = s.with_fc(_experts(model, l, e)["fc"]).gram_matrix()
        assert torch.equal(g, ref.gram), (l, e, m)
        fc = _experts(model, l, e)["fc"]
        assert torch.equal(s.with_fc(fc).rows, ref.with_fc(fc).rows) and s.count == ref.count
    a, b = (json.loads((d / "calib.json").read_text()) for d in (cal["dir"]["awq_gptq"], cal_inputs["dir"]))
    assert a.pop("activations") != b.pop("activations") and a == b  # the same ΔKL, to the last digit
    plan = QuantPlan({l: ["int4_g128"] * 4 for l in range(2)}, granularity="matrix", dtype=DT)
    outs = [convert(model, tmp_path / f"q{i}", quant=awq.attach(plan, "awq_gptq", d)).out_dir
            for i, d in enumerate((cal["dir"]["awq_gptq"], cal_inputs["dir"]))]
    assert (outs[0] / "rank0.safetensors").read_bytes() == (outs[1] / "rank0.safetensors").read_bytes()
    for i, d in enumerate((cal["dir"]["awq_gptq"], cal_inputs["dir"])):
        res = CliRunner().invoke(main, ["convert", str(model), "-o", str(tmp_path / f"t{i}"), "--calib", str(d),
                                        "--policy", "uniform", "--format", "int4", "--tp", "2", "--moe-tp", "2",
                                        "--rounding", "awq_gptq"],
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
    for r in ("rank0.safetensors", "rank1.safetensors"):
        assert (tmp_path / "t0" / r).read_bytes() == (tmp_path / "t1" / r).read_bytes(), r


def _layer(E: int, H: int, I: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    fc, proj = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    x = torch.randn(n, H, generator=g)
    routed = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(n)])
    return fc, proj, x, routed


def test_stored_inputs_are_bounded_and_one_layer_is_resident(tmp_path):
    """At most max_input_tokens evenly spaced rows of a layer are stored, in one file whose size does not
    depend on the number of experts; the rebuilt Gram matrices are those of the sampled rows; and however
    many layers there are, one layer's rows are in memory at a time."""
    H, I, n, cap = 32, 48, 300, 100
    sizes = {}
    for E in (4, 8):
        fc, proj, x, routed = _layer(E, H, I, n, E)
        st = awq.collect_layer(fc, proj, x, routed, gram=True, max_gram_in=0, max_input_tokens=cap, layer=0,
                               min_routed=1)
        acts = awq.ActivationStats(inputs_dir=tmp_path / f"E{E}")
        acts.add_layer(0, st)
        f = tmp_path / f"E{E}" / "0.safetensors"
        sizes[E] = f.stat().st_size
        assert sizes[E] <= cap * (H * x.element_size() + 2 * 4) + 1024
        li = st[(0, "fc")].inputs.layer_inputs
        assert (li.rows, li.tokens) == (cap, n)
        xs, rs = x[::3], routed[::3]  # floor(i * 300 / 100) = 3 i
        for e in range(E):
            rows = xs[rs.eq(e).any(-1)]
            up, gate = (rows @ fc[e].t()).chunk(2, dim=-1)
            assert torch.equal(st[(e, "fc")].gram_matrix(), gptq.gram(rows))
            assert torch.equal(st[(e, "proj")].gram_matrix(), gptq.gram(torch.nn.functional.silu(gate) * up))
            assert st[(e, "fc")].count == int(routed.eq(e).any(-1).sum())  # counted over every token
    assert sizes[4] == sizes[8]
    layers = []
    acts = awq.ActivationStats(inputs_dir=tmp_path / "many")
    for l in range(4):
        fc, proj, x, routed = _layer(4, H, I, n, 10 + l)
        acts.add_layer(l, awq.collect_layer(fc, proj, x, routed, gram=True, max_gram_in=0, layer=l))
        layers.append(acts.get(l, 0, "fc").inputs.layer_inputs)
    resident = lambda: [li.layer for li in layers if li._x is not None]  # noqa: E731
    assert resident() == [3]
    for l in (0, 2, 1):
        acts.get(l, 1, "proj").gram_matrix()
        assert resident() == [l]


def test_rebuilt_gram_in_row_chunks_matches_the_whole(monkeypatch):
    """With more routed rows than a chunk, the proj inputs are formed and accumulated a chunk at a time
    (float64): the same Gram matrix to float32 rounding as forming them all at once."""
    fc, proj, x, routed = _layer(4, 32, 48, 300, 5)
    whole = awq.collect_layer(fc, proj, x, routed, gram=True, max_gram_in=0, layer=0)
    want = {k: s.gram_matrix() for k, s in whole.items()}
    monkeypatch.setattr(awq, "GRAM_CHUNK_ROWS", 16)
    parts = awq.collect_layer(fc, proj, x, routed, gram=True, max_gram_in=0, layer=0)
    for k, s in parts.items():
        assert torch.allclose(s.gram_matrix(), want[k], rtol=1e-6, atol=1e-6), k


def test_calibrate_streams_the_inputs_and_gives_the_stored_gram_result(tiny_model, tmp_path):
    """``trtmoe calibrate`` (Fisher sensitivity) with max_gram_in=0 writes one MoE-inputs file per MoE
    layer and no Gram matrix; its ΔKL and the checkpoint converted from it are those of the stored-Gram
    calibration of the same text."""
    import json

    from conftest import tokenized_tiny_mixtral

    from trtmoe.quant.calibrate import calibrate

    model, text = tokenized_tiny_mixtral(tiny_model, tmp_path, "m")
    res, outs = {}, {}
    for thr in (1024, 0):
        d = tmp_path / f"c{thr}"
        res[thr] = calibrate(model, text, d, samples=4, seq_len=32, formats=("int4",), rounding="gptq",
                             max_gram_in=thr)
        plan = awq.attach(QuantPlan({l: ["int4"] * res[thr]["num_experts"] for l in res[thr]["moe_layers"]},
                                    granularity="matrix", dtype=DT), "gptq", d)
        outs[thr] = convert(model, tmp_path / f"q{thr}", quant=plan).out_dir
    files = sorted(p.name for p in (tmp_path / "c0" / awq.INPUTS_DIR).iterdir())
    assert files == sorted(f"{l}.safetensors" for l in res[0]["moe_layers"])
    assert (tmp_path / "c1024" / awq.INPUTS_DIR).is_dir()  # every matrix's rows come from them
    assert res[0]["activations"]["gram_from_inputs"] == res[1024]["activations"]["gram_matrices"]
    a, b = (json.loads((tmp_path / f"c{t}" / "calib.json").read_text()) for t in (1024, 0))
    a.pop("activations"), b.pop("activations")
    assert a == b
    assert (outs[0] / "rank0.safetensors").read_bytes() == (outs[1024] / "rank0.safetensors").read_bytes()


def test_resumed_layers_keep_their_inputs(tmp_path):
    """A layer's statistics stored in the resumable progress (a data-only tree file) carry its MoE
    inputs (not the model's weights); added to the next run's statistics they are written back byte
    for byte."""
    from trtmoe.hf.tree_file import read_tree, write_tree

    fc, proj, x, routed = _layer(4, 32, 48, 200, 3)
    a = awq.ActivationStats(inputs_dir=tmp_path / "a")
    a.add_layer(2, awq.collect_layer(fc, proj, x, routed, gram=True, max_gram_in=0, layer=2))
    write_tree(tmp_path / "state.safetensors", awq.layer_state({k[1:]: s for k, s in a.stats.items()}))
    state = awq.layer_from_state(read_tree(tmp_path / "state.safetensors"))
    assert all(s.inputs.fc is None for s in state.values())
    b = awq.ActivationStats(inputs_dir=tmp_path / "b")
    b.add_layer(2, state)
    assert (tmp_path / "a" / "2.safetensors").read_bytes() == (tmp_path / "b" / "2.safetensors").read_bytes()
    st = b.get(2, 1, "proj").with_fc(fc[1])
    assert torch.equal(st.gram_matrix(), a.get(2, 1, "proj").gram_matrix())


def test_missing_or_damaged_inputs_are_one_error_naming_the_file(model, cal_inputs, tmp_path):
    """Converting with activation-aware rounding from an artifact whose stored MoE inputs are missing or
    damaged stops with one error line naming the file; rtn, which does not read them, still converts."""
    import shutil

    from click.testing import CliRunner

    from trtmoe.cli import main

    def run(calib, rounding, out):
        return CliRunner().invoke(main, ["convert", str(model), "-o", str(tmp_path / out), "--calib", str(calib),
                                         "--policy", "uniform", "--format", "int4_g128", "--rounding", rounding])

    for damage in ("missing", "damaged"):
        d = Path(shutil.copytree(cal_inputs["dir"], tmp_path / damage))
        f = d / awq.INPUTS_DIR / "1.safetensors"
        if damage == "missing":
            f.unlink()
        else:
            data = bytearray(f.read_bytes())
            data[-5] ^= 0xFF
            f.write_bytes(bytes(data))
        for rounding in ("awq_gptq", "awq"):
            res = run(d, rounding, f"out-{damage}-{rounding}")
            assert res.exit_code == 2, res.output
            errors = [ln for ln in res.output.splitlines() if ln.startswith("error")]
            assert len(errors) == 1 and str(f) in errors[0], res.output
            assert ("missing" if damage == "missing" else "sha256") in errors[0]
            assert "Traceback" not in res.output
        res = run(d, "rtn", f"rtn-{damage}")
        assert res.exit_code == 0, res.output


# ---------------------------------------------------------------------------------------------
# the error from the rows when they are fewer than the inputs


def test_error_from_few_rows_is_the_gram_error_and_picks_the_same_codes(monkeypatch):
    """A matrix whose Gram matrix is rebuilt from fewer routed rows than half its inputs has its
    candidates' errors computed from those rows: the same value as from the Gram matrix (float64
    sums of the same products, up to the Gram's float32 rounding), and the same recipe."""
    in_f, out_f = 256, 64
    fc = torch.stack([_matrix(2 * in_f, 128, 20 + e) for e in range(2)]).float()
    proj = torch.stack([_matrix(128, in_f, 30 + e) for e in range(2)]).float()
    x = _correlated(200, 128, 5, mix_seed=3).float()
    routed = torch.zeros(200, 1, dtype=torch.long)
    routed[::4] = 1  # expert 1: 50 of the 200 tokens, fewer than half proj's 256 inputs
    st = awq.collect_layer(fc, proj, x, routed, gram=True, max_gram_in=0, layer=0)
    s = st[(1, "proj")].with_fc(fc[1])
    rows = s.gram_rows(in_f // 2)
    assert rows is not None and rows.shape == (50, in_f)
    assert s.gram_rows(49) is None and st[(0, "proj")].with_fc(fc[0]).gram_rows(in_f // 2) is None
    assert torch.allclose(gptq.gram(rows), s.gram_matrix(), rtol=0, atol=0)
    w = proj[1].to(DT)
    wd = awq._in_dtype(w, DT)
    fmt = FORMATS["int4_g128"]
    pq = (torch.rand(in_f, generator=torch.Generator().manual_seed(1)) + 0.5).to(DT)
    deq = awq._fake(fmt, awq._in_dtype(wd / pq.float(), DT), DT, None)
    h = s.gram_matrix() * torch.outer(pq.float(), pq.float())
    assert awq._rows_err(rows, wd, deq, pq) == pytest.approx(awq._gram_err(h, wd, deq, pq), rel=1e-5)
    base = awq.recipe_for(fmt, w, DT, s, rounding="awq")
    fast = awq.with_codes(fmt, w, DT, s, base)
    monkeypatch.setattr(awq.MatrixStats, "gram_rows", lambda self, n: None)
    slow = awq.with_codes(fmt, w, DT, s, base)
    assert torch.equal(fast.codes, slow.codes) and fast.pq is slow.pq and fast.clip is slow.clip


def test_formats_that_round_a_matrix_unscaled_share_its_factorization(monkeypatch):
    """Per-channel int4 (no pre-quant scale) and a group format rounded without a scale (``gptq``, or
    awq's search choosing none) both round against the plain Gram matrix: one factorization serves
    them, and the codes are those of a fresh one."""
    w, x = _matrix(64, 128, 7), _correlated(2048, 128, 8, 2)
    st = _stats(x)
    calls = []
    real = gptq.factor
    monkeypatch.setattr(gptq, "factor", lambda h, *a, **k: calls.append(h) or real(h, *a, **k))
    awq._FACTORS.clear()
    got = {"int4": awq.recipe_for(FORMATS["int4"], w, DT, st, rounding="awq_gptq"),
           "int4_g128": awq.recipe_for(FORMATS["int4_g128"], w, DT, st, rounding="gptq")}
    assert len(calls) == 1 and calls[0] is st.gram
    for f, rec in got.items():
        awq._FACTORS.clear()
        again = awq.recipe_for(FORMATS[f], w, DT, st, rounding="awq_gptq" if f == "int4" else "gptq")
        assert rec is not None and rec.codes is not None and torch.equal(rec.codes, again.codes)


def _layer_stats(E: int = 3, H: int = 128, I: int = 64, n: int = 600):
    g = torch.Generator().manual_seed(5)
    fc = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(DT).float()
    proj = (torch.randn(E, H, I, generator=g) * 0.05).to(DT).float()
    x = _correlated(n, H, 13, 2).float()
    routed = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(n)])
    st = awq.collect_layer(fc, proj, x, routed, gram=True, layer=0, max_gram_in=4096)
    return fc, proj, awq.ActivationStats({(0, e, m): s for (e, m), s in st.items()})


@pytest.mark.parametrize("shared", [False, True])
def test_a_search_device_moves_the_search_there_and_keeps_the_result_on_the_host(shared, monkeypatch):
    """``convert --device``: CheckpointRounding's searches take the matrix and its statistics to the
    device and give their transform back on the host. Without a GPU the moving path is run on an
    indexed CPU device (``cpu:0``, which takes that path): it gives the host's transforms and codes
    exactly, every tensor the searches see is on it, and what comes back is on the plain host."""
    fc, proj, acts = _layer_stats()
    E = fc.shape[0]
    mat = lambda e, m: fc[e] if m == "fc" else proj[e]  # noqa: E731
    fmt = FORMATS["int4_g64"]

    def recipes(device):
        awq._RECIPES.clear()
        awq._FACTORS.clear()
        r = awq.CheckpointRounding(acts, DT, rounding="awq_gptq", device=device)
        return {(e, m): r.recipe(fmt, 0, e, m, (0, proj.shape[-1]), mat(e, m), lambda x, m=m: mat(x, m),
                                 list(range(E)) if shared else None, matrix=mat)
                for e in range(E) for m in ("fc", "proj")}

    host = recipes("cpu")
    seen, moved = [], []
    real_codes, real_on = gptq.codes, awq.MatrixStats.on
    monkeypatch.setattr(gptq, "codes", lambda w, *a, **k: seen.append(w.device) or real_codes(w, *a, **k))
    monkeypatch.setattr(awq.MatrixStats, "on", lambda self, *a, **k: moved.append(a[0]) or real_on(self, *a, **k))
    dev = recipes("cpu:0")
    assert moved and all(d == torch.device("cpu:0") for d in moved)
    assert seen and all(d == torch.device("cpu") for d in seen)  # tensors moved to cpu:0 live on the CPU
    for k, a in host.items():
        b = dev[k]
        assert (a is None) == (b is None)
        if a is None:
            continue
        for name in ("pq", "clip", "codes", "base_clip"):
            ta, tb = getattr(a, name), getattr(b, name)
            assert (ta is None) == (tb is None), (k, name)
            if ta is not None:
                assert torch.equal(ta, tb) and tb.device == torch.device("cpu"), (k, name)
    assert any(r is not None and r.codes is not None for r in host.values())


def test_the_plan_rounding_takes_the_convert_device(tmp_path):
    """``rounding_for_plan`` hands the device to the rounding the layout searches with."""
    fc, proj, acts = _layer_stats()
    acts.save(tmp_path / "acts.safetensors")
    from types import SimpleNamespace
    plan = SimpleNamespace(meta={"rounding": "awq_gptq", "activations": {"path": str(tmp_path / "acts.safetensors")}})
    assert awq.rounding_for_plan(plan, DT).device == torch.device("cpu")
    assert awq.rounding_for_plan(plan, DT, "cuda").device == torch.device("cuda")


def test_kept_factorizations_are_bounded_in_bytes(monkeypatch):
    """The factorizations kept for reuse across formats stay under ``_FACTORS_BYTES`` (the newest is
    always kept): at real widths one proj factor is hundreds of MB."""
    stats = [_stats(_correlated(512, 128, s, 2)) for s in range(3)]
    one = 128 * 128 * 4 * 2  # a factor's hinv and its Gram matrix, float32
    monkeypatch.setattr(awq, "_FACTORS_BYTES", 2 * one)
    awq._FACTORS.clear()
    for st in stats:
        awq._factor(st, st.gram, None)
    assert [id(e[0]) for e in awq._FACTORS] == [id(stats[1].gram), id(stats[2].gram)]
    monkeypatch.setattr(awq, "_FACTORS_BYTES", one // 2)
    awq._factor(stats[0], stats[0].gram, None)
    assert len(awq._FACTORS) == 1 and awq._FACTORS[0][0] is stats[0].gram


def test_the_inverse_factor_is_the_upper_cholesky_factor_of_the_inverse():
    """``_upper_inverse_factor`` (float32, from the reversed matrix's Cholesky factor) is upper
    triangular with a positive diagonal and Uᵀ U is h⁻¹ (against float64) for a dampened Gram matrix of
    fewer rows than inputs; a matrix that is not positive definite gets more dampening."""
    x = _correlated(96, 256, 3, 2).float()
    h = gptq.gram(x)
    h = h + gptq.DAMP * float(torch.diagonal(h).mean()) * torch.eye(256)
    u = gptq._upper_inverse_factor(h)
    assert u.dtype == torch.float32 and torch.equal(u, torch.triu(u)) and bool((torch.diagonal(u) > 0).all())
    want = torch.linalg.inv(h.double())
    got = u.double().t() @ u.double()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    bad = h - 2 * float(torch.linalg.eigvalsh(h.double()).min()) * torch.eye(256)  # one negative eigenvalue
    ub = gptq._upper_inverse_factor(bad)
    assert bool(torch.isfinite(ub).all()) and torch.equal(ub, torch.triu(ub))


def test_dampening_grows_as_the_rows_per_input_shrink():
    """Error feedback's relative dampening is the base while a Gram matrix sums many rows per input and
    grows as inputs / rows where it sums few (the codes would fit those rows' noise)."""
    assert gptq.damping(0.01, 128, 1 << 14) == 0.01
    assert gptq.damping(0.01, 128, 64) == pytest.approx(gptq.DAMP_PER_INPUT_ROW * 2)
    assert gptq.damping(1.0, 128, 64) == 1.0  # a larger base (FP8's) stays


def test_the_rows_a_gram_matrix_sums_are_counted_as_it_is_built():
    """Routed experts count their routed rows; an expert routed too few tokens stands in the layer's rows
    and counts those; the count survives moving the statistics to a device, stored or rebuilt alike."""
    fc, proj, x, routed = _layer(4, 32, 48, 300, 7)
    routed[routed == 3] = 0  # expert 3 sees no token: the layer's rows stand in
    for thr in (0, 1024):
        stats = awq.collect_layer(fc, proj, x, routed, gram=True, max_gram_in=thr, layer=0)
        for (e, m), s in stats.items():
            want = 300 if e == 3 else int(routed.eq(e).any(-1).sum())
            assert (s.source == "layer") == (e == 3)
            assert s.gram_count() == want, (thr, e, m)
            assert s.on(torch.device("cpu", 0)).gram_count() == want
