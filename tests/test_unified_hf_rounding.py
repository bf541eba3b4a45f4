"""The unified-HF export writes the routed experts' FP8 / NVFP4 codes by the calibration's activation-aware
rounding (``trtmoe.checkpoint.unified_rounding``): the same tensor names, shapes and dtypes as round to
nearest, the same global and input scales, codes equal to those calibration measured for that matrix
(the Gram matrix rebuilt from the calibration's stored inputs), a lower Gram-weighted output error, and a
checkpoint the embedded engine loads and runs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tokenized_tiny_mixtral
from safetensors import safe_open

from trtmoe.build.unified_hf import convert_unified
from trtmoe.errors import InputError
from trtmoe.quant import awq, fp_gptq
from trtmoe.quant.calibrate import calibrate
from trtmoe.quant.formats import FORMATS
from trtmoe.runtime.unified_load import load_unified_engine


def _tensors(ck) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ck.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def calibrated(tiny_model, tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("uhf_round")
    model, text = tokenized_tiny_mixtral(tiny_model, d, "m")
    calibrate(model, text, d / "calib", samples=4, seq_len=32, formats=("fp8", "nvfp4"), rounding="gptq")
    yield model, d
    torch.set_num_threads(n)


def test_export_writes_the_codes_calibration_measured(calibrated):
    model, d = calibrated
    spec = ("0=nvfp4", "1=fp8")
    kw = dict(target="vllm", layer_formats=spec, engine="vllm-0.33", sm=100, calib=d / "calib")
    r = convert_unified(model, d / "gptq", **kw)  # the calibration's rounding (gptq)
    n = convert_unified(model, d / "rtn", rounding="rtn", **kw)
    assert json.loads((d / "gptq" / "manifest.json").read_text())["plan"]["rounding"] == "gptq"
    assert r.result.hf_quant_config == n.result.hf_quant_config
    a, b = _tensors(d / "gptq"), _tensors(d / "rtn")
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
    changed = set()
    for k in a:
        if not torch.equal(_bits(a[k]), _bits(b[k])):
            changed.add(k)
    # only routed-expert codes and NVFP4 block scales differ; global and input scales are the same
    assert changed and all(".experts." in k and k.endswith((".weight", ".weight_scale")) for k in changed), changed
    assert not any(k.endswith(".weight_scale") and ".layers.1." in k for k in changed)  # FP8: per-tensor scale kept
    assert any(".layers.0." in k for k in changed) and any(".layers.1." in k for k in changed)

    # every expert matrix is what calibration's rounding gives it, from the same stored inputs, and its
    # output error on the routed tokens is at most round to nearest's
    stats = awq.ActivationStats.load(d / "calib" / awq.ACT_FILE)
    for layer, fmt in ((0, FORMATS["nvfp4"]), (1, FORMATS["fp8"])):
        for e in range(4):
            pre = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
            src = {p: _src(model, pre + f"{p}.weight") for p in ("w1", "w2", "w3")}  # gate, down, up
            for proj, kind in (("w1", "fc"), ("w3", "fc"), ("w2", "proj")):
                st = stats.get(layer, e, kind)
                if kind == "proj":
                    st = st.with_fc(torch.cat([src["w3"], src["w1"]]))
                h = st.gram_matrix()
                got = {k.rsplit(".", 1)[1]: v for k, v in a.items() if k.startswith(pre + proj + ".")}
                rtn = {k.rsplit(".", 1)[1]: v for k, v in b.items() if k.startswith(pre + proj + ".")}
                w = src[proj].float()
                assert fp_gptq.gram_error(h, w, fmt.modelopt_dequantize(got)) <= \
                    fp_gptq.gram_error(h, w, fmt.modelopt_dequantize(rtn))
                shared = None
                if kind == "fc":  # gate and up share the global scale of their fused pair
                    shared = torch.stack([src["w1"].float().abs().amax(), src["w3"].float().abs().amax()]).amax()
                want = fp_gptq.quantize(fmt, src[proj], h, dtype=src[proj].dtype, input_amax=1.0, weight_amax=shared,
                                        search=False, rows=st.gram_count())
                for k in ("weight", "weight_scale"):
                    assert torch.equal(_bits(want[k].reshape(got[k].shape)), _bits(got[k])), (pre + proj, k)


def test_rounded_checkpoint_runs_in_the_embedded_engine(calibrated):
    model, d = calibrated
    kw = dict(target="vllm", layer_formats=("0=nvfp4", "1=nvfp4"), engine="vllm-0.33", sm=100, calib=d / "calib")
    convert_unified(model, d / "nv_gptq", rounding="gptq", **kw)
    convert_unified(model, d / "nv_rtn", rounding="rtn", **kw)
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = load_unified_engine(model, device="cpu").logits(ids).float().log_softmax(-1)
        kls = {}
        for name in ("nv_gptq", "nv_rtn"):
            lg = load_unified_engine(d / name, device="cpu").logits(ids).float()
            assert bool(torch.isfinite(lg).all())
            kls[name] = float((ref.exp() * (ref - lg.log_softmax(-1))).sum(-1).mean())
    assert all(v > 0 for v in kls.values())  # both quantized: neither is the source itself
    assert kls["nv_gptq"] != kls["nv_rtn"]


def test_a_named_rounding_needs_a_calibration(calibrated):
    model, d = calibrated
    with pytest.raises(InputError, match="needs a calibration"):
        convert_unified(model, d / "x", target="vllm", layer_formats=("0=nvfp4",), engine="vllm-0.33", sm=100,
                        rounding="gptq", calib_ids=None)


def _src(model, name):
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            if name in fh.keys():
                return fh.get_tensor(name)
    raise KeyError(name)


def test_cli_rounding_option_reaches_the_export(calibrated):
    from click.testing import CliRunner

    from trtmoe.cli import main

    model, d = calibrated
    for r in ("rtn", "gptq"):
        res = CliRunner().invoke(main, ["convert", str(model), "-o", str(d / f"cli_{r}"), "--target", "vllm",
                                        "--layer-format", "0=nvfp4", "--layer-format", "1=nvfp4", "--sm", "100",
                                        "--calib", str(d / "calib"), "--rounding", r], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        assert json.loads((d / f"cli_{r}" / "manifest.json").read_text())["plan"]["rounding"] == r
    a, b = _tensors(d / "cli_rtn"), _tensors(d / "cli_gptq")
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a if k.endswith(".weight"))


def test_a_calibration_without_float_rounding_is_called_stale(calibrated, tmp_path):
    """calib.json records the rounding its float formats were measured under; a calibration that lacks the
    key (made before float codes followed the rounding) still exports with the codes, and says its
    predictions are round to nearest's."""
    import shutil

    model, d = calibrated
    calib = json.loads((d / "calib" / "calib.json").read_text())
    assert calib["float_rounding"] == "gptq" == calib["rounding"]
    kw = dict(target="vllm", layer_formats=("0=nvfp4", "1=fp8"), engine="vllm-0.33", sm=100)
    fresh = convert_unified(model, tmp_path / "fresh", calib=d / "calib", **kw)
    assert not any("predates" in n for n in fresh.result.plan.meta.get("notes", []))

    old = tmp_path / "old_calib"
    shutil.copytree(d / "calib", old)
    del calib["float_rounding"]
    (old / "calib.json").write_text(json.dumps(calib))
    r = convert_unified(model, tmp_path / "old", calib=old, **kw)
    notes = r.result.plan.meta.get("notes", [])
    assert any("predates" in n and "gptq codes" in n for n in notes), notes
    assert r.result.plan.meta["rounding"] == "gptq"
    assert awq.stale_float_rounding(calib) and not awq.stale_float_rounding({**calib, "rounding": "rtn"})
    assert not awq.stale_float_rounding({**calib, "formats": ["int4_g128"]})
