"""Activation-aware search (pre-quant scale, clip) for W4A8 AWQ, measured as the kernel runs it."""

import pytest
import torch

from trtmoe.errors import InputError
from trtmoe.quant.awq import search_w4a8, w4a8_output_error
from trtmoe.quant.formats import FORMATS

FMT = FORMATS["w4a8_awq"]


def _case(seed: int, outliers: bool):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(512, 256, generator=g)
    if outliers:  # a few input channels much larger than the rest, as in real activations
        scale = torch.ones(256)
        scale[torch.randperm(256, generator=g)[:8]] = 30.0
        x = x * scale * torch.exp(0.5 * torch.randn(256, generator=g))
    return w, x.to(torch.bfloat16).float()


@pytest.mark.parametrize("seed", [0, 1])
def test_search_lowers_output_error_vs_plain_rounding(seed):
    w, x = _case(seed, outliers=True)
    packed, info = search_w4a8(FMT, w, x, dtype=torch.bfloat16)
    rtn = FMT.quantize(w, dtype=torch.bfloat16, input_amax=x.abs().amax(0).to(torch.bfloat16))
    y = x @ w.float().T
    rtn_err = w4a8_output_error(FMT, rtn, x, y)
    err = w4a8_output_error(FMT, packed, x, y)
    assert info["rtn_error"] == pytest.approx(rtn_err, rel=1e-6)
    assert info["error"] == pytest.approx(err, rel=1e-6)
    assert err < 0.8 * rtn_err, (err, rtn_err, info)
    assert info["alpha"] > 0 and not torch.all(packed["pre_quant_scale"] == 1)
    # the result is an ordinary packed matrix of the format: the pre-quant scale is positive, the input
    # scale follows the pre-scaled inputs' amax
    assert bool((packed["pre_quant_scale"].float() > 0).all())
    pq = packed["pre_quant_scale"].float()
    amax = float((x.abs().amax(0).to(torch.bfloat16).float() * pq).max())
    assert float(packed["input_scale"]) == pytest.approx(amax / 448.0, rel=1e-2)


def test_search_never_worse_than_plain_rounding():
    w, x = _case(2, outliers=False)
    _, info = search_w4a8(FMT, w, x, dtype=torch.bfloat16)
    assert info["error"] <= info["rtn_error"]


def test_search_refuses_other_formats_and_shapes():
    w, x = _case(3, outliers=False)
    with pytest.raises(InputError):
        search_w4a8(FORMATS["int4_g128"], w, x, dtype=torch.bfloat16)
    with pytest.raises(InputError):
        search_w4a8(FMT, w, x[:, :128], dtype=torch.bfloat16)
