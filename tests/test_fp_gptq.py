"""Activation-aware rounding of the fused-MoE float formats (``trtmoe.quant.fp_gptq``): the tensors are
valid in the format (ModelOpt's tensors, codes on the grid, scales representable and where the format's
rule allows them), only ``weight`` / ``weight_scale`` differ from round to nearest, the Gram-weighted
output error drops below round to nearest's on correlated inputs (and on held-out rows of the same
distribution), and with uncorrelated inputs error feedback alone is round to nearest bit for bit."""

from __future__ import annotations

import pytest
import torch

from trtmoe.errors import InputError
from trtmoe.quant import fp_gptq
from trtmoe.quant.formats import (E4M3_MAX, FORMATS, _nvfp4_block_scales, e2m1_codes, e2m1_values,
                                  e8m0_exponents, unpack_nibbles)

DT = torch.bfloat16
FP = ("nvfp4", "nvfp4_w4a16", "mxfp4", "fp8", "fp8_block", "fp8_block_wo")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _correlated(n: int, d: int, seed: int) -> torch.Tensor:
    mix = torch.randn(d, d, generator=torch.Generator().manual_seed(0)) / d ** 0.5 + torch.eye(d)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(1000 + seed)) @ mix
    return (x * torch.linspace(0.2, 2.0, d)).to(DT)


def _gram(x: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return (xd.t() @ xd).float()


def _matrix(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    return (torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05).to(DT)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _err(fmt, h, w, packed) -> float:
    return fp_gptq.gram_error(h, w.float(), fmt.dequantize(packed, dtype=torch.float32))


@pytest.mark.parametrize("name", FP)
def test_tensors_are_valid_in_the_format(name):
    fmt = FORMATS[name]
    w, x = _matrix(160, 256, 1), _correlated(4096, 256, 2)
    base = fmt.quantize(w, dtype=DT, input_amax=3.0)
    q = fp_gptq.quantize(fmt, w, _gram(x), dtype=DT, input_amax=3.0, never_worse=False)
    assert {k: (v.shape, v.dtype) for k, v in q.items()} == {k: (v.shape, v.dtype) for k, v in base.items()}
    # Only the codes and the block scales may change; global and input scales are the format's own.
    for k in q:
        if k not in ("weight", "weight_scale"):
            assert torch.equal(q[k], base[k]), k
    if name in ("fp8",):
        assert torch.equal(q["weight_scale"], base["weight_scale"])
    assert not _same(q, base)
    # ModelOpt's tensors of the result dequantize to what the engine's kernel computes with.
    mo = fmt.modelopt_tensors(q, dtype=DT)
    specs = fmt.modelopt_tensor_specs(160, 256, DT)
    assert [(k, mo[k].dtype, tuple(mo[k].reshape(s).shape)) for k, _, s in specs] == [(k, d, s) for k, d, s in specs]
    deq = fmt.modelopt_dequantize({k: mo[k].reshape(s) for k, _, s in specs})
    assert torch.equal(deq, fmt.dequantize(q, dtype=torch.float32))
    assert bool(torch.isfinite(deq).all())
    if name.startswith("nvfp4"):
        gs = q["weight_scale_2"].float()
        bs = q["weight_scale"].float()
        assert bool((bs >= 2.0 ** -9).all()) and bool((bs <= E4M3_MAX).all())
        codes = unpack_nibbles(q["weight"])
        v = e2m1_values(codes).reshape(160, 16, 16)
        assert torch.equal(deq.reshape(160, 16, 16), v * (bs.unsqueeze(-1) * gs))
        # every stored block scale is one the format's own rule gives some block amax
        assert torch.equal(_nvfp4_block_scales(bs * 6 * gs, gs), bs)
    elif name == "mxfp4":
        e = q["weight_scale"].float() - 127
        ref = e8m0_exponents(w.float().reshape(160, 8, 32).abs().amax(-1))
        # the rule's exponent of the block as error feedback left it, or one below: near the weight's own
        assert bool(((e - ref).abs() <= 2).all()) and bool(((e >= -127) & (e <= 127)).all())
        v = e2m1_values(unpack_nibbles(q["weight"])).reshape(160, 8, 32)
        assert torch.equal(deq.reshape(160, 8, 32), v * torch.exp2(e).unsqueeze(-1))
    else:
        wq = q["weight"].float()
        assert bool(torch.isfinite(wq).all()) and float(wq.abs().max()) <= E4M3_MAX
        assert torch.equal(wq.to(torch.float8_e4m3fn).float(), wq)
        assert bool((q["weight_scale"] > 0).all())


@pytest.mark.parametrize("name", FP)
def test_gram_weighted_error_below_round_to_nearest(name):
    """Correlated inputs: error feedback (with the scale search) lowers ‖X(W−Ŵ)ᵀ‖² well below round to
    nearest's, on the calibration rows and on held-out rows of the same distribution."""
    fmt = FORMATS[name]
    w, x, xh = _matrix(96, 256, 3), _correlated(4096, 256, 4), _correlated(4096, 256, 5)
    h, hh = _gram(x), _gram(xh)
    base = fmt.quantize(w, dtype=DT, input_amax=3.0)
    q = fp_gptq.quantize(fmt, w, h, dtype=DT, input_amax=3.0, never_worse=False)
    # FP8 is dampened much more (DAMP_FP8): it keeps less of the feedback's gain on these rows
    bound = 0.9 if name.startswith("fp8") else 0.8
    assert _err(fmt, h, w, q) < bound * _err(fmt, h, w, base)
    assert _err(fmt, hh, w, q) < (bound + 0.05) * _err(fmt, hh, w, base)
    fb = fp_gptq.quantize(fmt, w, h, dtype=DT, input_amax=3.0, search=False, never_worse=False)
    assert _err(fmt, h, w, fb) < bound * _err(fmt, h, w, base)


@pytest.mark.parametrize("name", FP)
def test_identity_gram_error_feedback_is_round_to_nearest(name):
    fmt = FORMATS[name]
    w = _matrix(128, 256, 6)
    base = fmt.quantize(w, dtype=DT, input_amax=3.0)
    q = fp_gptq.quantize(fmt, w, torch.eye(256) * 7.0, dtype=DT, input_amax=3.0, search=False, never_worse=False)
    assert _same(q, base)


@pytest.mark.parametrize("name", ("nvfp4", "mxfp4", "fp8_block_wo"))
def test_identity_gram_scale_search_never_loses(name):
    """Uncorrelated inputs and no feedback: each block's search minimizes exactly its own squared error,
    round to nearest's scale among the candidates, so the total is never above round to nearest's; for
    the 4-bit formats it is below (clipping a block's outlier pays)."""
    fmt = FORMATS[name]
    w = _matrix(128, 256, 7)
    h = torch.eye(256)
    base = fmt.quantize(w, dtype=DT, input_amax=1.0)
    q = fp_gptq.quantize(fmt, w, h, dtype=DT, input_amax=1.0, feedback=False, never_worse=False)
    e, e0 = _err(fmt, h, w, q), _err(fmt, h, w, base)
    assert e <= e0
    if name != "fp8_block_wo":
        assert e < 0.97 * e0


def test_fused_amax_keeps_the_shared_global_scale():
    fmt = FORMATS["nvfp4"]
    w, x = _matrix(64, 128, 8), _correlated(2048, 128, 9)
    shared = torch.tensor(float(w.float().abs().max()) * 1.5)
    q = fp_gptq.quantize(fmt, w, _gram(x), dtype=DT, input_amax=2.0, weight_amax=shared)
    assert torch.equal(q["weight_scale_2"], fmt.quantize(w, dtype=DT, input_amax=2.0, weight_amax=shared)["weight_scale_2"])
    assert torch.equal(q["input_scale"], fmt.quantize(w, dtype=DT, input_amax=2.0)["input_scale"])


def test_never_worse_falls_back_to_round_to_nearest():
    """A Gram matrix from other inputs than the one judged: the result is whichever is better on ``h``."""
    fmt = FORMATS["nvfp4"]
    w, x = _matrix(64, 128, 10), _correlated(2048, 128, 11)
    h = _gram(x)
    q = fp_gptq.quantize(fmt, w, h, dtype=DT, input_amax=1.0)
    base = fmt.quantize(w, dtype=DT, input_amax=1.0)
    assert _err(fmt, h, w, q) <= _err(fmt, h, w, base)
    # all-zero inputs: no candidate beats round to nearest (every error is 0), which is kept
    z = fp_gptq.quantize(fmt, w, torch.zeros(128, 128), dtype=DT, input_amax=1.0)
    assert _same(z, base)


def test_refuses_what_it_does_not_round():
    w = _matrix(64, 128, 12)
    with pytest.raises(InputError):
        fp_gptq.quantize(FORMATS["int4_g128"], w, torch.eye(128), dtype=DT)
    with pytest.raises(InputError):
        fp_gptq.quantize(FORMATS["nvfp4"], w, torch.eye(64), dtype=DT, input_amax=1.0)
    assert not fp_gptq.applies(FORMATS["w4a8_awq"]) and fp_gptq.applies(FORMATS["mxfp4"])


def test_e2m1_codes_of_values_round_trip():
    v = e2m1_values(torch.arange(16, dtype=torch.uint8))
    c = e2m1_codes(v)
    assert torch.equal(e2m1_values(c), v)


def test_embedded_checkpoint_stores_the_codes_calibration_measured(tiny_model, tmp_path):
    """A per-expert plan in the weight-only float formats on the embedded target, from an awq_gptq
    calibration: each expert matrix holds exactly what calibration's ΔKL quantized (awq.quantize of
    that matrix from the same statistics), and differs from round to nearest."""
    from safetensors.torch import load_file

    from trtmoe.checkpoint.writer import convert
    from trtmoe.quant import awq
    from trtmoe.quant.calibrate import measure, write_calibration
    from trtmoe.quant.plan import QuantPlan
    from trtmoe.runtime.engine import EmbeddedEngine

    model = tiny_model("mixtral", num_local_experts=4, num_hidden_layers=2, seed=11, hidden_size=128,
                       intermediate_size=128, head_dim=32, dtype="bfloat16")
    ck = convert(model, tmp_path / "ck").out_dir
    ids = torch.randint(0, 250, (4, 32), generator=torch.Generator().manual_seed(0))
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    acts = awq.ActivationStats(inputs_dir=tmp_path / "cal" / awq.INPUTS_DIR)
    fmts = ("nvfp4_w4a16", "fp8_block_wo")
    res = measure(eng, ids, formats=fmts, activations=acts, rounding="awq_gptq")
    acts.save(tmp_path / "cal" / awq.ACT_FILE)
    write_calibration(tmp_path / "cal", res)
    loaded = awq.ActivationStats.load(tmp_path / "cal" / awq.ACT_FILE)
    plan = QuantPlan({0: ["nvfp4_w4a16"] * 4, 1: ["fp8_block_wo"] * 4}, granularity="matrix", dtype=DT)
    plan = awq.attach(plan, "awq_gptq", tmp_path / "cal")
    assert plan.meta["rounding"] == "awq_gptq"
    got = load_file(str(convert(model, tmp_path / "q", quant=plan).out_dir / "rank0.safetensors"))
    rtn = load_file(str(convert(model, tmp_path / "r", quant=awq.attach(plan, "rtn", None)).out_dir
                        / "rank0.safetensors"))
    src = load_file(str(model / "model.safetensors"))
    differ = 0
    for l, name in enumerate(fmts):
        fmt = FORMATS[name]
        for e in range(4):
            q = f"model.layers.{l}.block_sparse_moe.experts.{e}."
            w = {"fc": torch.cat([src[q + "w3.weight"], src[q + "w1.weight"]]), "proj": src[q + "w2.weight"]}
            for m in ("fc", "proj"):
                want = awq.quantize(fmt, w[m], dtype=DT, stats=loaded.get(l, e, m).with_fc(w["fc"]), rounding="awq_gptq")
                for k, v in want.items():
                    key = f"transformer.layers.{l}.mlp.experts.{e}.{m}.{k}"
                    assert torch.equal(_bits(got[key]), _bits(v)), key
                differ += not torch.equal(_bits(got[f"transformer.layers.{l}.mlp.experts.{e}.{m}.weight"]),
                                          _bits(rtn[f"transformer.layers.{l}.mlp.experts.{e}.{m}.weight"]))
    assert differ >= 8
