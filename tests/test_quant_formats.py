"""Weight-only formats: numerics against an independent float64 reference, exact packed layouts,
the packed-byte matmul, storage accounting and error cases."""

from __future__ import annotations

import pytest
import torch

from trtmoe.errors import InputError, UnsupportedError
from trtmoe.quant.formats import FORMATS, GroupInt4Format, float_format_for, get_format, pack_int4, unpack_int4

MODEL_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
GROUP_FORMATS = [("int4_g128", 128), ("int4_g64", 64)]
QUANT_NAMES = ["int8", "int4", "int4_g128", "int4_g64"]


# ---------------------------------------------------------------------------------------------
# an independent float64 reference of the published rules


def _round_half_even(x: torch.Tensor) -> torch.Tensor:
    """Round half to even, written out by hand (floor + tie handling) rather than torch.round."""
    f = torch.floor(x)
    frac = x - f
    up = (frac > 0.5) | ((frac == 0.5) & (torch.remainder(f, 2) == 1))
    return f + up.to(x.dtype)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C round(): ties away from zero, as TensorRT-LLM's symmetric_quantize rounds."""
    return torch.sign(x) * torch.floor(torch.abs(x) + 0.5)


def ref_per_channel(w: torch.Tensor, bits: int, dtype: torch.dtype):
    """TRT-LLM W8A16/W4A16: scale = amax/2**(bits-1) per output row, clamp to the signed range.
    Returns (codes [..., out, in], scale float64 [..., out], quotient float64)."""
    w64 = w.to(dtype).to(torch.float64)
    qr = 2 ** (bits - 1)
    scale = w64.abs().amax(dim=-1) / qr
    quot = torch.where(scale[..., None] > 0, w64 / torch.where(scale > 0, scale, 1.0)[..., None],
                       torch.zeros_like(w64))
    codes = _round_half_away(quot).clamp(-qr, qr - 1)
    return codes.to(torch.int64), scale, quot


def ref_group_int4(w: torch.Tensor, dtype: torch.dtype, group: int = 128):
    """Group-wise INT4: scale = amax/7 per (row, ``group``-column group), 1 for an all-zero group."""
    w64 = w.to(dtype).to(torch.float64)
    *lead, out_f, in_f = w64.shape
    g = w64.reshape(*lead, out_f, in_f // group, group)
    scale = g.abs().amax(dim=-1) / 7.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quot = g / scale[..., None]
    codes = _round_half_even(quot).clamp(-8, 7)
    return (codes.reshape(*lead, out_f, in_f).to(torch.int64), scale,
            quot.reshape(*lead, out_f, in_f))


def _near_tie(quot: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    return (quot - torch.floor(quot) - 0.5).abs() < eps


def _weights(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.05
    # Outliers and an all-zero output row exercise the amax and zero-scale paths.
    w.view(-1, shape[-1])[1, 3] = 0.9
    w.view(-1, shape[-1])[2].zero_()
    return w.to(dtype)


def _codes_from_packed(name: str, packed: dict) -> torch.Tensor:
    """Codes [..., out, in] read back from the stored layout (the inverse of each layout)."""
    if name == "int8":
        return packed["weight"].to(torch.int64).transpose(-1, -2)
    if name == "int4":
        return unpack_int4(packed["weight"], dim=-1).to(torch.int64).transpose(-1, -2)
    return unpack_int4(packed["weight"], dim=-2).to(torch.int64)


# ---------------------------------------------------------------------------------------------
# pack / unpack


def test_pack_int4_known_bytes():
    packed = pack_int4(torch.tensor([1, -2, 3, -8], dtype=torch.int8), dim=0)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [0xE1, 0x83]
    assert unpack_int4(packed, dim=0).tolist() == [1, -2, 3, -8]


@pytest.mark.parametrize("shape,dim", [((6, 8), 0), ((6, 8), 1), ((3, 4, 10), -1), ((3, 4, 10), 1),
                                       ((2, 16, 6), -2)])
def test_pack_unpack_round_trip_all_values(shape, dim):
    g = torch.Generator().manual_seed(1)
    v = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    packed = pack_int4(v, dim)
    expect = list(shape)
    expect[dim] //= 2
    assert list(packed.shape) == expect
    assert torch.equal(unpack_int4(packed, dim), v)
    # Every byte value decodes and re-encodes to itself.
    allbytes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.int8)
    assert torch.equal(pack_int4(unpack_int4(allbytes, 0), 0), allbytes)


def test_pack_int4_errors():
    with pytest.raises(InputError):
        pack_int4(torch.tensor([8, 0]), 0)
    with pytest.raises(InputError):
        pack_int4(torch.tensor([0.5, 1.0]), 0)
    with pytest.raises(UnsupportedError, match="odd"):
        pack_int4(torch.zeros(3, dtype=torch.int8), 0)
    with pytest.raises(InputError):
        unpack_int4(torch.zeros(2, dtype=torch.int32), 0)


# ---------------------------------------------------------------------------------------------
# hand-built layouts, byte for byte


def test_int8_layout_and_half_away_rounding():
    # Row amax 128 → scale exactly 1; 128 clamps to 127; -2.5 and 0.5 are ties (away from zero,
    # as trtllm-build's C++ quantizer rounds).
    w = torch.tensor([[128.0, -64.0, 1.0], [-2.5, 0.5, -128.0]])
    p = FORMATS["int8"].quantize(w, dtype=torch.float32)
    assert p["weight"].dtype == torch.int8
    assert p["weight"].tolist() == [[127, -3], [-64, 1], [1, -128]]  # [in, out]
    assert p["per_channel_scale"].tolist() == [1.0, 1.0]
    assert p["per_channel_scale"].dtype == torch.float32


def test_int4_per_channel_layout():
    # out=4, in=2; every row has amax 8 → scale 1. Column 0 carries [1, -2, 3, -8] across out.
    w = torch.tensor([[1.0, -8.0], [-2.0, -8.0], [3.0, -8.0], [-8.0, 4.0]])
    p = FORMATS["int4"].quantize(w, dtype=torch.float16)
    assert p["weight"].shape == (2, 2)  # [in, out/2]
    assert p["weight"].view(torch.uint8).tolist() == [[0xE1, 0x83], [0x88, 0x48]]
    assert p["per_channel_scale"].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert p["per_channel_scale"].dtype == torch.float16
    # Ties round away from zero: amax 8 → scale 1, 0.5 → 1, 1.5 → 2, -2.5 → -3.
    w2 = torch.tensor([[0.5, 8.0], [1.5, -8.0], [-2.5, 8.0], [0.0, -8.0]])
    q = unpack_int4(FORMATS["int4"].quantize(w2, dtype=torch.float32)["weight"], -1)
    assert q[0].tolist() == [1, 2, -3, 0]


def test_int4_g128_layout():
    # out=4, in=128; rows have amax 7 → scale exactly 1. Column 0 = [1, -2, 3, -7], column 1 = 7.
    w = torch.zeros(4, 128)
    w[:, 0] = torch.tensor([1.0, -2.0, 3.0, -7.0])
    w[:, 1] = 7.0
    w[0, 2] = 2.5  # a tie: half to even → 2
    p = FORMATS["int4_g128"].quantize(w, dtype=torch.bfloat16)
    wt = p["weight"]
    assert wt.shape == (2, 128) and wt.dtype == torch.int8  # [out/2, in]
    b = wt.view(torch.uint8)
    assert b[:, 0].tolist() == [0xE1, 0x93]  # rows (0,1) and (2,3) share a byte, row 2j low
    assert b[:, 1].tolist() == [0x77, 0x77]
    assert b[:, 2].tolist() == [0x02, 0x00]
    assert int(b[:, 3:].count_nonzero()) == 0
    assert p["weights_scaling_factor"].shape == (4, 1)
    assert p["weights_scaling_factor"].dtype == torch.bfloat16
    assert p["weights_scaling_factor"].flatten().tolist() == [1.0] * 4
    assert p["prequant_scaling_factor"].shape == (1, 128)
    assert p["prequant_scaling_factor"].dtype == torch.bfloat16
    assert bool((p["prequant_scaling_factor"] == 1).all())


def test_int4_g64_layout():
    # out=4, in=128: every row has amax 7 in columns 0..63 (scale 1) and 14 in 64..127 (scale 2).
    w = torch.zeros(4, 128)
    w[:, 0] = torch.tensor([1.0, -2.0, 3.0, -7.0])
    w[:, 1] = 7.0
    w[:, 64] = torch.tensor([2.0, -4.0, 6.0, -14.0])
    w[:, 65] = 14.0
    w[0, 66] = 5.0  # 5 / 2 = 2.5, a tie: half to even → 2
    p = FORMATS["int4_g64"].quantize(w, dtype=torch.bfloat16)
    b = p["weight"].view(torch.uint8)
    assert p["weight"].shape == (2, 128) and p["weight"].dtype == torch.int8  # [out/2, in]
    assert b[:, 0].tolist() == [0xE1, 0x93]  # rows (0,1) and (2,3) share a byte, row 2j low
    assert b[:, 1].tolist() == [0x77, 0x77]
    assert b[:, 64].tolist() == [0xE1, 0x93]  # same codes: the second group has its own scale
    assert b[:, 65].tolist() == [0x77, 0x77]
    assert b[:, 66].tolist() == [0x02, 0x00]
    nonzero = {0, 1, 64, 65, 66}
    assert all(int(b[:, j].count_nonzero()) == 0 for j in range(128) if j not in nonzero)
    s = p["weights_scaling_factor"]
    assert s.shape == (4, 2) and s.dtype == torch.bfloat16  # [out, in/64]
    assert s.tolist() == [[1.0, 2.0]] * 4
    assert p["prequant_scaling_factor"].shape == (1, 128)
    # One 128-wide group shares the scale 2 and loses column 0's odd codes: g64 is really finer.
    b128 = FORMATS["int4_g128"].quantize(w, dtype=torch.bfloat16)["weight"].view(torch.uint8)
    assert b128[:, 0].tolist() == [0xF0, 0xC2]  # [0.5, -1, 1.5, -3.5] → [0, -1, 2, -4] half to even
    assert b128[:, 1].tolist() == [0x44, 0x44]  # 3.5 → 4


@pytest.mark.parametrize("name", QUANT_NAMES)
def test_stacked_experts_equal_per_expert_quantization(name):
    fmt = FORMATS[name]
    w = _weights((3, 64, 256), seed=5)
    stacked = fmt.quantize(w, dtype=torch.bfloat16)
    for e in range(3):
        single = fmt.quantize(w[e], dtype=torch.bfloat16)
        sliced = fmt.expert(stacked, e)
        assert sliced.keys() == single.keys()
        for k in single:
            assert torch.equal(sliced[k], single[k]), (name, e, k)


# ---------------------------------------------------------------------------------------------
# numerics against the float64 reference


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
@pytest.mark.parametrize("name,bits", [("int8", 8), ("int4", 4)])
def test_per_channel_matches_reference(name, bits, dtype):
    fmt = FORMATS[name]
    w = _weights((2, 48, 320), seed=2)
    p = fmt.quantize(w, dtype=dtype)
    codes, scale, quot = ref_per_channel(w, bits, dtype)
    got = _codes_from_packed(name, p)
    assert got.shape == codes.shape
    diff = got != codes
    # fp16/bf16 inputs: float32 and float64 quotients round alike; fp32 inputs may differ only
    # within a hair of a .5 tie.
    if dtype == torch.float32:
        assert not bool((diff & ~_near_tie(quot)).any())
        assert int((got - codes).abs().max()) <= 1
    else:
        assert not bool(diff.any())
    assert p["per_channel_scale"].dtype == dtype
    assert torch.equal(p["per_channel_scale"], scale.to(dtype))
    assert bool((p["per_channel_scale"][0, 2] == 0).all())  # the all-zero row
    assert bool((got[0, 2] == 0).all())


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
@pytest.mark.parametrize("name,group", GROUP_FORMATS)
def test_group_int4_matches_reference(name, group, dtype):
    fmt = FORMATS[name]
    assert fmt.group_size == group
    w = _weights((2, 32, 384), seed=3)
    p = fmt.quantize(w, dtype=dtype)
    codes, scale, quot = ref_group_int4(w, dtype, group)
    got = _codes_from_packed(name, p)
    diff = got != codes
    # amax/7 is inexact in float32, so a code may differ only where 7·w/amax is exactly k + 1/2
    # (14·w == (2k+1)·amax, checked in exact float64 arithmetic); it then goes either way.
    w64 = w.to(dtype).double()
    n_groups = 384 // group
    amax = w64.reshape(2, 32, n_groups, group).abs().amax(dim=-1).repeat_interleave(group, dim=-1)
    exact_tie = (14.0 * w64 - (2.0 * torch.floor(quot) + 1.0) * amax) == 0
    assert not bool((diff & ~exact_tie).any())
    assert int((got - codes).abs().max()) <= 1
    assert p["weights_scaling_factor"].shape == (2, 32, n_groups)
    ref_scale = scale.to(dtype)
    assert torch.allclose(p["weights_scaling_factor"].double(), ref_scale.double(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
@pytest.mark.parametrize("name", QUANT_NAMES)
def test_dequant_error_within_half_step(name, dtype):
    fmt = FORMATS[name]
    w = _weights((2, 40, 256), seed=4)
    wd = w.to(dtype).double()
    p = fmt.quantize(w, dtype=dtype)
    deq = fmt.dequantize(p, dtype=torch.float64)
    assert deq.shape == w.shape
    if isinstance(fmt, GroupInt4Format):
        g = fmt.group_size
        codes, s64, _ = ref_group_int4(w, dtype, g)
        s64 = s64.repeat_interleave(g, dim=-1)
        stored = p["weights_scaling_factor"].double().repeat_interleave(g, dim=-1)
        clamped = torch.zeros_like(wd, dtype=torch.bool)  # |w| <= amax = 7·scale: never clamps
    else:
        bits = 8 if name == "int8" else 4
        codes, s64, quot = ref_per_channel(w, bits, dtype)
        s64 = s64[..., None].expand_as(wd)
        stored = p["per_channel_scale"].double()[..., None].expand_as(wd)
        clamped = quot > (2 ** (bits - 1) - 1) + 0.5
    q = _codes_from_packed(name, p).double()
    err = (deq - wd).abs()
    # Half a step of the exact scale, plus what storing the scale in the model dtype moved it,
    # plus float32 rounding of the product q·scale.
    moved = q.abs() * (stored - s64).abs() + 1e-6 * wd.abs() + 1e-12
    assert bool((err[~clamped] <= (s64 / 2 + moved)[~clamped]).all())
    # The positive amax code clamps (amax/128·128 → 127): error is one full step there.
    assert bool((err[clamped] <= (s64 + moved)[clamped]).all())
    if not isinstance(fmt, GroupInt4Format):
        assert bool(clamped.any())


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32"])
def test_float_formats_round_trip(name):
    fmt = FORMATS[name]
    w = _weights((2, 16, 24), seed=6)
    p = fmt.quantize(w, dtype=torch.float32)
    assert set(p) == {"weight"}
    assert p["weight"].dtype == fmt.dtype and p["weight"].shape == w.shape
    assert torch.equal(fmt.dequantize(p, dtype=torch.float32), w.to(fmt.dtype).float())


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantize_leaves_its_input_alone(name):
    w = _weights((2, 8, 128), seed=14)
    before = w.clone()
    FORMATS[name].quantize(w, dtype=torch.float32, input_amax=1.0)
    assert torch.equal(w, before)


def test_format_registry():
    assert {n: f.trtllm_quant_algo for n, f in FORMATS.items()} == {
        "fp16": None, "bf16": None, "fp32": None,
        "int8": "W8A16", "int4": "W4A16", "int4_g128": "W4A16_AWQ", "int4_g64": "W4A16_AWQ",
        "fp8": "FP8", "fp8_block": "FP8_BLOCK_SCALES", "fp8_block_wo": "FP8_BLOCK_SCALES", "nvfp4": "NVFP4",
        "nvfp4_w4a16": "W4A16_NVFP4", "mxfp4": "W4A16_MXFP4", "w4a8_awq": "W4A8_AWQ"}
    # The per-layer TensorRT-LLM config carries each group format's own group size.
    for name, group in GROUP_FORMATS:
        assert FORMATS[name].trtllm_layer_config() == {
            "quant_algo": "W4A16_AWQ", "group_size": group, "has_zero_point": False, "pre_quant_scale": True}
    assert FORMATS["int8"].trtllm_layer_config() == {"quant_algo": "W8A16"}
    # The fpA_intB fine-grained kernels run groups of 64 and 128 only.
    with pytest.raises(UnsupportedError, match="group size 32"):
        GroupInt4Format("int4_g32", "W4A16_AWQ", group_size=32)
    assert get_format("int8") is FORMATS["int8"]
    assert float_format_for(torch.bfloat16).name == "bf16"
    assert float_format_for(torch.float16).name == "fp16"
    with pytest.raises(UnsupportedError):
        float_format_for(torch.float64)


def test_input_is_cast_to_model_dtype_first():
    w = _weights((16, 256), seed=7)
    for name in QUANT_NAMES:
        a = FORMATS[name].quantize(w, dtype=torch.bfloat16)
        b = FORMATS[name].quantize(w.to(torch.bfloat16), dtype=torch.bfloat16)
        assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------
# matmul from the packed bytes


def _scale_dtype(p: dict) -> torch.dtype:
    for k in ("per_channel_scale", "weights_scaling_factor", "weight"):
        if k in p and p[k].is_floating_point() and p[k].dtype.itemsize > 1:
            return p[k].dtype
    return torch.float32  # the fused-MoE formats dequantize in float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.activation is None])  # weight-only
def test_linear_matches_dequantized_matmul(name, dtype):
    fmt = FORMATS[name]
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(8))
    # 2-D weight
    w2 = _weights((96, 256), seed=9)
    p2 = fmt.quantize(w2, dtype=dtype)
    ref2 = x @ fmt.dequantize(p2, dtype=_scale_dtype(p2)).float().T
    y2 = fmt.linear(x, p2)
    assert y2.shape == (37, 96) and y2.dtype == torch.float32
    torch.testing.assert_close(y2, ref2, rtol=1e-5, atol=1e-5)
    # one expert slice of a 3-D stack
    w3 = _weights((4, 96, 256), seed=10)
    p3 = fmt.quantize(w3, dtype=dtype)
    e = fmt.expert(p3, 2)
    ref3 = x @ fmt.dequantize(e, dtype=_scale_dtype(e)).float().T
    torch.testing.assert_close(fmt.linear(x, e), ref3, rtol=1e-5, atol=1e-5)
    # and it is close to the unquantized product
    rel = (fmt.linear(x, e) - x @ w3[2].T).norm() / (x @ w3[2].T).norm()
    assert float(rel) < {"int4": 0.2, "int4_g128": 0.2, "int4_g64": 0.2, "nvfp4_w4a16": 0.2,
                         "mxfp4": 0.2}.get(name, 0.04)


@pytest.mark.parametrize("name", ["int4_g128", "int4_g64"])
def test_linear_reads_the_packed_bytes(name):
    fmt = FORMATS[name]
    x = torch.randn(5, 128)
    p = fmt.quantize(_weights((8, 128), seed=11), dtype=torch.float16)
    zeroed = dict(p, weight=torch.zeros_like(p["weight"]))
    assert bool((fmt.linear(x, zeroed) == 0).all())
    # the pre-quant scale is applied to activations, and dequantize folds it into the weight
    pq = torch.rand(1, 128, generator=torch.Generator().manual_seed(12)).to(torch.float16) + 0.5
    scaled = dict(p, prequant_scaling_factor=pq)
    ref = x @ fmt.dequantize(scaled, dtype=torch.float32).T
    torch.testing.assert_close(fmt.linear(x, scaled), ref, rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# storage accounting


def test_bits_per_weight_and_bytes():
    o, i = 4096, 14336
    assert FORMATS["fp16"].bits_per_weight(o, i) == 16
    assert FORMATS["bf16"].bits_per_weight(o, i) == 16
    assert FORMATS["fp32"].bits_per_weight(o, i) == 32
    assert FORMATS["int8"].bits_per_weight(o, i) == pytest.approx(8 + 16 / i, abs=1e-12)
    assert FORMATS["int8"].bits_per_weight(i, o) == pytest.approx(8 + 16 / o, abs=1e-12)
    assert FORMATS["int8"].bits_per_weight(o, i, scale_dtype_bytes=4) == pytest.approx(8 + 32 / i)
    assert FORMATS["int4"].bits_per_weight(o, i) == pytest.approx(4 + 16 / i, abs=1e-12)
    # group scales: 16 bits per 128 weights; the [1, in] pre-quant scale is shared per stack
    g = FORMATS["int4_g128"]
    assert g.bits_per_weight(o, i) == pytest.approx(4 + 16 / 128 + 16 / o, abs=1e-12)
    assert g.bits_per_weight(o, i, n=8) == pytest.approx(4.125 + 16 / (8 * o), abs=1e-12)
    assert FORMATS["int8"].weight_bytes(o, i, n=8) == 8 * (o * i + 2 * o)
    assert FORMATS["int4"].weight_bytes(o, i) == o * i // 2 + 2 * o
    assert g.weight_bytes(o, i, n=2) == 2 * (o * i // 2 + o * (i // 128) * 2) + 2 * i
    # group 64: twice the scales, 16 bits per 64 weights
    g64 = FORMATS["int4_g64"]
    assert g64.bits_per_weight(o, i) == pytest.approx(4 + 16 / 64 + 16 / o, abs=1e-12)
    assert g64.weight_bytes(o, i, n=2) == 2 * (o * i // 2 + o * (i // 64) * 2) + 2 * i


@pytest.mark.parametrize("name", list(FORMATS))
def test_weight_bytes_equal_the_tensors(name):
    fmt = FORMATS[name]
    w = _weights((3, 64, 256), seed=13)
    p = fmt.quantize(w, dtype=torch.float16, input_amax=1.0)
    stored = sum(t.numel() * t.element_size() for t in p.values())
    assert fmt.weight_bytes(64, 256, n=3, scale_dtype_bytes=2) == stored


# ---------------------------------------------------------------------------------------------
# errors


def test_error_cases():
    with pytest.raises(UnsupportedError, match="int4_g128"):
        get_format("int3")
    g = FORMATS["int4_g128"]
    with pytest.raises(UnsupportedError, match=r"in_features.*200"):
        g.quantize(torch.randn(8, 200), dtype=torch.float16)
    with pytest.raises(UnsupportedError, match="in_features"):
        g.weight_bytes(8, 200)
    with pytest.raises(UnsupportedError, match="odd"):
        g.quantize(torch.randn(7, 128), dtype=torch.float16)
    # 192 columns: three groups of 64, but not a multiple of 128.
    g64 = FORMATS["int4_g64"]
    assert g64.quantize(torch.randn(8, 192), dtype=torch.float16)["weights_scaling_factor"].shape == (8, 3)
    with pytest.raises(UnsupportedError, match=r"in_features.*192.*group size 128"):
        g.quantize(torch.randn(8, 192), dtype=torch.float16)
    with pytest.raises(UnsupportedError, match=r"in_features.*96.*group size 64"):
        g64.quantize(torch.randn(8, 96), dtype=torch.float16)
    with pytest.raises(UnsupportedError, match="in_features"):
        g64.weight_bytes(8, 96)
    assert g64.shape_problem(8, 192) is None and g.shape_problem(8, 192) is not None
    with pytest.raises(UnsupportedError, match="odd"):
        FORMATS["int4"].quantize(torch.randn(7, 16), dtype=torch.float16)
    with pytest.raises(InputError, match=r"\[\.\.\., out, in\]"):
        FORMATS["int8"].quantize(torch.randn(16), dtype=torch.float16)
    with pytest.raises(InputError, match="floating"):
        FORMATS["int8"].quantize(torch.ones(4, 4, dtype=torch.int32), dtype=torch.float16)
    bad = torch.randn(4, 4)
    bad[1, 1] = float("nan")
    for name in QUANT_NAMES:
        with pytest.raises(InputError, match="nan"):
            FORMATS[name].quantize(bad.repeat(1, 32), dtype=torch.float16)
    with pytest.raises(InputError, match="inf"):  # 1e6 overflows float16
        FORMATS["int8"].quantize(torch.full((2, 4), 1e6), dtype=torch.float16)
    with pytest.raises(UnsupportedError, match="dtype"):
        FORMATS["int8"].quantize(torch.randn(4, 4), dtype=torch.float64)
    p = FORMATS["int8"].quantize(torch.randn(4, 8), dtype=torch.float16)
    with pytest.raises(InputError, match="input features"):
        FORMATS["int8"].linear(torch.randn(2, 5), p)
    with pytest.raises(InputError, match="per_channel_scale"):
        FORMATS["int8"].dequantize({"weight": p["weight"]}, dtype=torch.float16)
    with pytest.raises(InputError, match="positive"):
        FORMATS["int8"].weight_bytes(0, 8)


def test_format_names_without_torch_match_the_format_objects():
    from trtmoe.quant import QUANTIZED_NAMES
    from trtmoe.quant.formats import BY_BITS, FORMATS, QUANTIZED

    assert QUANTIZED == QUANTIZED_NAMES
    assert sorted(BY_BITS) == sorted(QUANTIZED)
    bits = [FORMATS[n].bits_per_weight(256, 256) for n in BY_BITS]
    assert bits == sorted(bits, reverse=True)
    for n in QUANTIZED:  # everything shown about a format comes from the format
        f = FORMATS[n]
        assert f.label and f.short and f.color.startswith("#") and f.trtllm_label
