"""Source checkpoints whose experts are stored quantized (FP8 with 128x128 block scales as DeepSeek-V3
ships, MXFP4 blocks/scales as gpt-oss ships) are read dequantized with their own scales."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtmoe.checkpoint.writer import convert
from trtmoe.errors import CheckpointError, UnsupportedError
from trtmoe.hf.reader import HFCheckpoint
from trtmoe.quant.formats import FORMATS


def _rewrite(src: Path, out: Path, how) -> Path:
    """A copy of ``src`` whose routed-expert weights ``how(name, w)`` replaces (a dict of tensors)."""
    shutil.copytree(src, out)
    (f,) = sorted(out.glob("*.safetensors"))
    t = load_file(f)
    new = {}
    for k, v in t.items():
        new.update(how(k, v) if ".experts." in k else {k: v})
    save_file(new, f)
    return out


def _fp8(k, w):
    p = FORMATS["fp8_block_wo"].quantize(w, dtype=torch.bfloat16)
    return {k: p["weight"], k + "_scale_inv": p["weight_scale"]}


def _mxfp4(k, w):
    p = FORMATS["mxfp4"].quantize(w, dtype=torch.bfloat16)
    o = w.shape[0]
    return {k + "_blocks": p["weight"].reshape(o, -1, 16), k + "_scales": p["weight_scale"]}


def _deq(fmt):
    def how(k, w):
        f = FORMATS[fmt]
        return {k: f.dequantize(f.quantize(w, dtype=torch.bfloat16), dtype=torch.bfloat16)}
    return how


@pytest.mark.parametrize("fmt,how", [("fp8_block_wo", _fp8), ("mxfp4", _mxfp4)])
def test_quantized_source_reads_as_its_dequantized_weights(tiny_model, tmp_path, fmt, how):
    base = tiny_model("mixtral", dtype="bfloat16", hidden_size=128, intermediate_size=160)  # partial FP8 blocks
    q = _rewrite(base, tmp_path / "q", how)
    ref = _rewrite(base, tmp_path / "ref", _deq(fmt))
    with HFCheckpoint(q) as a, HFCheckpoint(ref) as b:
        name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
        assert a.info(name).shape == b.info(name).shape == (160, 128)
        assert torch.equal(a.read(name), b.read(name))
        assert torch.equal(a.read(name, (70, 150)), b.read(name, (70, 150)))  # rows across a block edge
        # Read as float32 the dequantized product is not rounded to bfloat16 on the way.
        f = FORMATS[fmt]
        with HFCheckpoint(base) as c:
            exact = f.dequantize(f.quantize(c.read(name), dtype=torch.bfloat16), dtype=torch.float32)
        assert torch.equal(a.read(name, dtype=torch.float32), exact)
    convert(q, tmp_path / "ck_q")
    convert(ref, tmp_path / "ck_ref")
    for f in sorted((tmp_path / "ck_ref").glob("rank*.safetensors")):
        x, y = load_file(f), load_file(tmp_path / "ck_q" / f.name)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_fp8_source_without_scales_is_refused(tiny_model, tmp_path):
    base = tiny_model("mixtral", dtype="bfloat16", hidden_size=128, intermediate_size=128)
    q = _rewrite(base, tmp_path / "q", lambda k, w: {k: w.float().clamp(-448, 448).to(torch.float8_e4m3fn)})
    with pytest.raises(UnsupportedError, match="F8_E4M3"):
        HFCheckpoint(q)


def test_mismatched_block_scales_are_refused(tiny_model, tmp_path):
    base = tiny_model("mixtral", dtype="bfloat16", hidden_size=128, intermediate_size=128)

    def bad(k, w):
        d = _fp8(k, w)
        d[k + "_scale_inv"] = torch.ones(3, 3)
        return d

    q = _rewrite(base, tmp_path / "q", bad)
    with pytest.raises(CheckpointError, match="block"):
        HFCheckpoint(q)


def test_block_size_comes_from_the_quantization_config(tiny_model, tmp_path):
    base = tiny_model("mixtral", dtype="bfloat16", hidden_size=128, intermediate_size=128)

    def blocks64(k, w):
        s = w.float().abs().unflatten(1, (-1, 64)).unflatten(0, (-1, 64)).amax((1, 3)) / 448
        q = (w.float() / s.repeat_interleave(64, 0).repeat_interleave(64, 1)).to(torch.float8_e4m3fn)
        return {k: q, k + "_scale_inv": s}

    q = _rewrite(base, tmp_path / "q", blocks64)
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    (q / "config.json").write_text(json.dumps(cfg))
    with HFCheckpoint(q) as a, HFCheckpoint(base) as b:
        name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
        err = (a.read(name, dtype=torch.float32) - b.read(name, dtype=torch.float32)).abs().max()
        assert float(err) <= float(b.read(name, dtype=torch.float32).abs().max()) / 16
