"""Quantized expert matrices run by PyTorch's CPU weight-only integer kernels.

A quantized format's reference ``linear`` (``trtmoe.quant.formats``) rebuilds the float weight from
the packed bytes on every call and multiplies float32 activations by it. That is the numerics'
definition, and calibration and the checks run it, but on a CPU it costs far more than the product:
on a Qwen3-30B-A3B-width expert matrix (2048 x 1536, one AVX-512 core) one row took about 2 ms as
INT8 and 14 ms as INT4 g128, against 0.16 ms for the float32 product.

PyTorch ships CPU kernels that multiply 16-bit float activations by weights held as integers:
``_weight_int8pack_mm`` (INT8 codes, one scale per output channel) and ``_weight_int4pack_mm_for_cpu``
(INT4 codes in its own packed layout, a scale and a zero per group of 32, 64, 128 or 256 inputs).
On the same matrix they took 80-90 µs for one row and about 38 µs per row from 8 rows up (INT8 and
INT4 alike), faster than the float32 product at every row count measured (1 to 512).

A serving engine (``EmbeddedEngine(..., pack_experts=True)``, the default, on CPU with
``cpu_matmul="auto"``) therefore holds each INT8 / INT4 expert matrix of a bfloat16 or float16 model
in the kernel's layout, converted once at load from the checkpoint's bytes, and *only* there (the
checkpoint layout is dropped, so the memory stays that of the quantized weights; INT4 group scales
gain a zero beside them). Its numerics are a GPU weight-only kernel's: activations enter in the model
dtype, the weight is dequantized in the kernel, the sum is accumulated in float32 and the output is
rounded to the model dtype. They differ from the reference ``linear`` (float32 activations in and
out) by about one 16-bit rounding of the inputs and of the output. An expert stored unquantized
inside a quantized bank (a graded checkpoint's 16-bit experts) is held once in float32, as the
engine's float experts are (in bfloat16 under ``cpu_activations="model"``), instead of being
converted on every call. In a bfloat16 engine an INT8 matrix's blocks of ``INT8_DEQUANT_ROWS`` rows
and more (a prefill) run as its dequantized bfloat16 weight through oneDNN, which is faster there.

The kernels check few of their preconditions (an INT8 weight whose input width is not a multiple of
16 crashed the process or returned garbage), so ``kernel_for`` admits only the shapes measured to
work; any other matrix keeps the reference path. ``pack_experts=False`` keeps every matrix in the
checkpoint's layout on the reference path (calibration and the numerics checks load that way).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..matmul import Packed, mm_t, onednn_bf16_available, onednn_linear, packs, uses_onednn
from ..quant.formats import unpack_int4

# Model dtypes whose activations the kernels take (a float32 model's quantized experts keep the
# reference path: the kernels' float32 variants were slower than it).
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# The INT4 kernel's group sizes, and the multiple that input widths (INT8) and output widths (INT4)
# must be.
INT4_GROUPS = (256, 128, 64, 32)
_WIDTH_MULTIPLE = 16
# Rows from which an INT8 matrix multiplies bfloat16 activations faster as its dequantized bfloat16
# weight through oneDNN than in the integer kernel (whose cost grows with every row): the two met at
# 32-48 rows at Qwen3-30B-A3B's widths and at the fixture's; at 512 rows the dequantized product was
# 2.6-4.8x faster.
INT8_DEQUANT_ROWS = 64


def _int8_ok(out_features: int, in_features: int) -> bool:
    return in_features % _WIDTH_MULTIPLE == 0 and out_features > 0


def _int4_group(out_features: int, in_features: int, group: int | None) -> int | None:
    """The kernel group size for an INT4 matrix (``group`` None: one scale per output channel, any
    group that divides the input width), or None when the kernel cannot hold it."""
    if out_features % _WIDTH_MULTIPLE or in_features % 2:
        return None
    if group is not None:
        return group if group in INT4_GROUPS and in_features % group == 0 else None
    return next((g for g in INT4_GROUPS if in_features % g == 0), None)


class IntKernel:
    """One quantized ``[out, in]`` matrix in a kernel's layout: ``k(x)`` is ``x @ W.T`` for ``x``
    [M, in] (any float dtype; returned in it)."""

    __slots__ = ("bits", "weight", "scales", "group", "pre_scale", "dtype", "out_features", "in_features")

    def __init__(self, bits: int, weight: Tensor, scales: Tensor, group: int, pre_scale: Tensor | None,
                 dtype: torch.dtype, out_features: int, in_features: int):
        self.bits, self.weight, self.scales, self.group = bits, weight, scales, group
        self.pre_scale, self.dtype = pre_scale, dtype
        self.out_features, self.in_features = out_features, in_features

    def __call__(self, x: Tensor) -> Tensor:
        xs = x if self.pre_scale is None else x * self.pre_scale
        xs = xs.to(self.dtype).contiguous()
        if self.bits == 8 and x.dtype == self.dtype == torch.bfloat16 and xs.shape[0] >= INT8_DEQUANT_ROWS \
                and onednn_bf16_available():
            # A block of rows in a bfloat16 engine (a prefill): the weight dequantized as the format
            # defines it (codes times scale, rounded to bfloat16) and one oneDNN product.
            y = onednn_linear(xs, self.weight.to(self.dtype).mul_(self.scales[:, None]))
        elif self.bits == 8:
            y = torch._weight_int8pack_mm(xs, self.weight, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(xs, self.weight, self.group, self.scales)
        return y.to(x.dtype)


class FloatKernel:
    """An unquantized matrix of a quantized bank, held once in the engine's compute dtype (float32, or
    bfloat16 under ``cpu_activations="model"``): packed for oneDNN where the engine's float experts
    would be (``trtmoe.matmul``), else transposed for MKL."""

    __slots__ = ("op", "dtype", "onednn")

    def __init__(self, w: Tensor, compute_dtype: torch.dtype = torch.float32):
        self.dtype = compute_dtype
        w = w.to(compute_dtype)
        self.onednn = uses_onednn("auto", w)  # oneDNN runs this dtype on this CPU (else MKL / torch.mm)
        self.op = Packed(w) if packs("auto", w) else w.t().contiguous()

    def __call__(self, x: Tensor) -> Tensor:
        xc = x.to(self.dtype)
        y = self.op(xc) if isinstance(self.op, Packed) else mm_t(xc, self.op, self.onednn)
        return y.to(x.dtype)


def _int4_kernel(codes_out_in: Tensor, scales_groups_out: Tensor, group: int, pre_scale: Tensor | None,
                 dtype: torch.dtype) -> IntKernel:
    N, K = codes_out_in.shape
    w = torch._convert_weight_to_int4pack_for_cpu((codes_out_in.to(torch.int32) + 8).contiguous(), 1)
    s = scales_groups_out.to(dtype)
    sz = torch.stack((s, torch.zeros_like(s)), -1).contiguous()  # [K / group, N, 2]: w = (u - 8) * s + 0
    return IntKernel(4, w, sz, group, pre_scale, dtype, N, K)


def _float_kernel(fmt, packed: dict[str, Tensor], dtype: torch.dtype, compute_dtype: torch.dtype):
    return FloatKernel(packed["weight"], compute_dtype)


def _per_channel_kernel(fmt, packed: dict[str, Tensor], dtype: torch.dtype, compute_dtype: torch.dtype):
    wq, scale = packed["weight"], packed["per_channel_scale"]
    if wq.dim() != 2 or wq.dtype != torch.int8 or scale.dtype != dtype:
        return None
    if fmt.bits == 8:
        K, N = wq.shape
        if not _int8_ok(N, K):
            return None
        return IntKernel(8, wq.t().contiguous(), scale.contiguous(), 0, None, dtype, N, K)
    codes = unpack_int4(wq, dim=-1).t()  # [out, in]
    N, K = codes.shape
    g = _int4_group(N, K, None)
    if g is None:
        return None
    return _int4_kernel(codes, scale[None].expand(K // g, N), g, None, dtype)


def _group_int4_kernel(fmt, packed: dict[str, Tensor], dtype: torch.dtype, compute_dtype: torch.dtype):
    wq, s, pq = packed["weight"], packed["weights_scaling_factor"], packed["prequant_scaling_factor"]
    if wq.dim() != 2 or s.dtype != dtype:
        return None
    codes = unpack_int4(wq, dim=-2)  # [out, in]
    N, K = codes.shape
    if _int4_group(N, K, fmt.group_size) is None or s.shape != (N, K // fmt.group_size):
        return None
    pre = pq.reshape(-1)
    pre = None if bool((pre == 1).all()) else pre.float()  # the reference multiplies in float32 too
    return _int4_kernel(codes, s.t(), fmt.group_size, pre, dtype)


# The kernel builders by the layout a format names (``QuantFormat.engine_kernel``).
KERNELS = {"float": _float_kernel, "per_channel_int": _per_channel_kernel, "group_int4": _group_int4_kernel}


def kernel_for(fmt, packed: dict[str, Tensor], dtype: torch.dtype, compute_dtype: torch.dtype = torch.float32):
    """The matrix ``packed`` (one expert's, in ``fmt``, for a model of ``dtype`` computed in
    ``compute_dtype``) in a kernel's layout, or None when no kernel runs it (the caller keeps the
    reference path)."""
    build = KERNELS.get(fmt.engine_kernel)
    if build is None or dtype not in KERNEL_DTYPES or not available():
        return None
    return build(fmt, packed, dtype, compute_dtype)


@functools.cache
def available() -> bool:
    """Whether this PyTorch build has both kernels and they agree with a float product on a small
    matrix (checked once)."""
    try:
        g = torch.Generator().manual_seed(0)
        N, K = 32, 64
        codes = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
        scale = (torch.rand(N, generator=g) / 64 + 1 / 256).to(torch.bfloat16)
        x = torch.randn(3, K, generator=g).to(torch.bfloat16).float()
        want = x @ (codes.float() * scale.float()[:, None]).t()
        k8 = IntKernel(8, codes.contiguous(), scale, 0, None, torch.bfloat16, N, K)
        k4 = _int4_kernel(codes, scale[None].expand(K // 32, N), 32, None, torch.bfloat16)
        tol = 1e-2 * float(want.abs().max())
        return all(float((k(x) - want).abs().max()) <= tol for k in (k8, k4))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
