"""Weight-only quantization formats with TensorRT-LLM's numerics and checkpoint layouts.

One object per format owns quantize / dequantize / pack / unpack and a matmul that runs from
the packed bytes, so the checkpoint writer and the embedded engine share the same code.

Weights use the Linear layout ``[..., out, in]``; leading dims are experts (``[E, out, in]``).
Packed tensors are keyed by the TensorRT-LLM tensor-name suffix (``weight``,
``per_channel_scale``, ``weights_scaling_factor``, ``prequant_scaling_factor``).

Numerics shared by the integer formats:

* The weight is first cast to the model dtype (the checkpoint stores that dtype and
  ``trtllm-build`` quantizes from it), then to float32; scales are computed and applied in
  float32 and *stored* in the model dtype, as TensorRT-LLM's ``symmetric_quantize`` does.
* Rounding follows whoever quantizes in the real pipeline: the per-channel formats (which
  ``trtllm-build`` quantizes itself) use C ``round``, half away from zero, as TensorRT-LLM's
  C++ ``symmetric_quantize`` does; the group-wise INT4 formats (packed at conversion, ModelOpt
  style) use ``torch.round``, half to even, as ModelOpt's packer does.
* Group-wise INT4 comes in the two group sizes TensorRT-LLM's fine-grained fpA_intB kernels run
  (64 and 128); both are ``W4A16_AWQ`` with the group size carried in the quantization config.
* Dequantization multiplies the integer by the stored (model-dtype) scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from trtmoe.errors import InputError, UnsupportedError

__all__ = [
    "QuantFormat",
    "FloatFormat",
    "PerChannelIntFormat",
    "GroupInt4Format",
    "FORMATS",
    "GROUP_SIZE",
    "TRTLLM_GROUP_SIZES",
    "get_format",
    "float_format_for",
    "pack_int4",
    "unpack_int4",
]

# ``matmul(x, w_t)``: float32 activations [..., N, in] times a dequantized weight [..., in, out].
Matmul = Callable[[Tensor, Tensor], Tensor]

GROUP_SIZE = 128  # ModelOpt's default AWQ block size
TRTLLM_GROUP_SIZES = (64, 128)  # the only group sizes the CUTLASS fpA_intB fine-grained kernels accept

_MODEL_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


# ---------------------------------------------------------------------------------------------
# int4 nibble packing


def pack_int4(values: Tensor, dim: int) -> Tensor:
    """Pack signed 4-bit integers two per byte along ``dim``.

    ``values`` holds integers in [-8, 7] (any integer dtype); its size along ``dim`` must be
    even. Element ``2j`` goes to the low nibble and ``2j+1`` to the high nibble of byte ``j``.
    Returns an int8 tensor whose size along ``dim`` is halved.
    """
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise InputError(f"pack_int4 needs an integer tensor, got {values.dtype}")
    if values.dim() == 0:
        raise InputError("pack_int4 needs at least one dimension")
    dim = dim % values.dim()
    if values.shape[dim] % 2:
        raise UnsupportedError(
            f"cannot pack int4 along dimension {dim}: its size {values.shape[dim]} is odd")
    v = values.to(torch.int16)
    if v.numel() and (int(v.min()) < -8 or int(v.max()) > 7):
        raise InputError("pack_int4 values must lie in [-8, 7]")
    v = v.movedim(dim, -1)
    low = v[..., 0::2] & 0x0F
    high = v[..., 1::2] & 0x0F
    packed = (low | (high << 4)).to(torch.uint8).view(torch.int8)
    return packed.movedim(-1, dim).contiguous()


def unpack_int4(packed: Tensor, dim: int) -> Tensor:
    """Inverse of :func:`pack_int4`: int8/uint8 bytes → int8 values in [-8, 7], ``dim`` doubled."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise InputError(f"unpack_int4 needs int8 or uint8 bytes, got {packed.dtype}")
    if packed.dim() == 0:
        raise InputError("unpack_int4 needs at least one dimension")
    dim = dim % packed.dim()
    b = packed.view(torch.int8)
    # Arithmetic shifts sign-extend a 4-bit two's-complement nibble: the high one is b >> 4, the
    # low one (b << 4) >> 4. Stacking them right after ``dim`` interleaves them along it in place
    # (a contiguous result, no transposed copy).
    return torch.stack(((b << 4) >> 4, b >> 4), dim=dim + 1).flatten(dim, dim + 1)


# ---------------------------------------------------------------------------------------------
# helpers


def _check_model_dtype(dtype: torch.dtype) -> None:
    if dtype not in _MODEL_DTYPES:
        raise UnsupportedError(
            f"model dtype {dtype} is not supported",
            hint="use torch.float16, torch.bfloat16 or torch.float32")


def _check_weight(w: Tensor, name: str) -> None:
    if not isinstance(w, Tensor):
        raise InputError(f"{name}: weight must be a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise InputError(f"{name}: weight must be floating point, got {w.dtype}")
    if w.dim() < 2:
        raise InputError(f"{name}: weight must be [..., out, in], got shape {tuple(w.shape)}")
    if w.numel() == 0:
        raise InputError(f"{name}: weight is empty, shape {tuple(w.shape)}")


def _check_amax(amax: Tensor, name: str, dtype: torch.dtype) -> None:
    # amax propagates nan and inf, so checking it is a cheap whole-tensor finiteness test.
    if not bool(torch.isfinite(amax).all()):
        raise InputError(f"{name}: weight contains inf or nan (after casting to {dtype})")


def _need(packed: dict[str, Tensor], keys: tuple[str, ...], name: str) -> None:
    missing = [k for k in keys if k not in packed]
    if missing:
        raise InputError(f"{name}: packed tensors lack {missing}; have {sorted(packed)}")


def _check_x(x: Tensor, in_features: int, name: str) -> None:
    if not x.is_floating_point() or x.dim() < 1:
        raise InputError(f"{name}: activations must be a floating tensor [..., in]")
    if x.shape[-1] != in_features:
        raise InputError(
            f"{name}: activations have {x.shape[-1]} input features, weight expects {in_features}")


# ---------------------------------------------------------------------------------------------
# formats


@dataclass(frozen=True)
class QuantFormat:
    """A weight storage format. Subclasses implement the numerics; this base fixes the API."""

    name: str
    trtllm_quant_algo: str | None
    # How people see it: report label, heatmap cell text and colour, TensorRT-LLM's name for it.
    label: str = ""
    short: str = ""
    color: str = "#888888"
    trtllm_label: str = ""

    def bits_per_weight(self, out_features: int, in_features: int,
                        scale_dtype_bytes: int = 2, *, n: int = 1) -> float:
        """Stored bits per weight of an ``[n, out, in]`` stack, scales counted."""
        return 8.0 * self.weight_bytes(out_features, in_features, n, scale_dtype_bytes) / (
            n * out_features * in_features)

    def weight_bytes(self, out_features: int, in_features: int, n: int = 1,
                     scale_dtype_bytes: int = 2) -> int:
        """Stored bytes of ``n`` stacked ``[out, in]`` matrices, scale tensors included."""
        raise NotImplementedError

    def quantize(self, w: Tensor, *, dtype: torch.dtype) -> dict[str, Tensor]:
        """Quantize ``w [..., out, in]`` for a model whose dtype is ``dtype``; returns the
        checkpoint tensors keyed by TensorRT-LLM suffix."""
        raise NotImplementedError

    def dequantize(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> Tensor:
        """The effective weight ``[..., out, in]`` in ``dtype``, from the packed tensors."""
        raise NotImplementedError

    def linear(self, x: Tensor, packed: dict[str, Tensor], matmul: Matmul = torch.matmul) -> Tensor:
        """``y = x @ W.T`` with ``W`` rebuilt from the packed bytes on each call.

        ``x [..., N, in]`` → ``[..., N, out]`` in ``x.dtype``; the weight is dequantized into
        the model dtype (as the fpA_intB mixed-GEMM kernels do) and the product is accumulated
        in float32. Stacked packed tensors broadcast against ``x`` like ``torch.matmul``.
        ``matmul`` multiplies the float32 activations by the dequantized ``W.T`` (the engine passes
        its CPU library choice, ``trtmoe.matmul``).
        """
        raise NotImplementedError

    def trtllm_layer_config(self) -> dict:
        """The TensorRT-LLM quantization keys of a layer stored in this format (a ``config.json``
        ``quantization`` block or a MIXED_PRECISION ``quant_cfg.json`` entry)."""
        return {"quant_algo": self.trtllm_quant_algo}

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        """Why an ``[out, in]`` matrix cannot be stored in this format, or None when it can."""
        return None

    def expert(self, packed: dict[str, Tensor], index: int) -> dict[str, Tensor]:
        """The packed tensors of expert ``index`` of an ``[E, ...]`` stack (shared tensors kept)."""
        return {k: (v if k in self._shared_keys() else v[index]) for k, v in packed.items()}

    def _shared_keys(self) -> frozenset[str]:
        return frozenset()

    def _check_dims(self, out_features: int, in_features: int, n: int = 1) -> None:
        for label, v in (("out_features", out_features), ("in_features", in_features), ("n", n)):
            if isinstance(v, bool) or not hasattr(v, "__index__") or v <= 0:
                raise InputError(f"{self.name}: {label} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class FloatFormat(QuantFormat):
    """Unquantized storage in a float dtype (the format's own dtype, whatever ``dtype`` says)."""

    dtype: torch.dtype = torch.float16

    def weight_bytes(self, out_features: int, in_features: int, n: int = 1,
                     scale_dtype_bytes: int = 2) -> int:
        self._check_dims(out_features, in_features, n)
        return n * out_features * in_features * _dtype_bytes(self.dtype)

    def quantize(self, w: Tensor, *, dtype: torch.dtype) -> dict[str, Tensor]:
        _check_model_dtype(dtype)
        _check_weight(w, self.name)
        return {"weight": w.to(self.dtype).contiguous()}

    def dequantize(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> Tensor:
        _need(packed, ("weight",), self.name)
        return packed["weight"].to(dtype)

    def linear(self, x: Tensor, packed: dict[str, Tensor], matmul: Matmul = torch.matmul) -> Tensor:
        _need(packed, ("weight",), self.name)
        w = packed["weight"]
        _check_x(x, w.shape[-1], self.name)
        return matmul(x.float(), w.float().transpose(-1, -2)).to(x.dtype)


@dataclass(frozen=True)
class PerChannelIntFormat(QuantFormat):
    """TensorRT-LLM W8A16 / W4A16: symmetric per-output-channel scale ``amax / 2**(bits-1)``.

    ``weight`` is the unpreprocessed TensorRT-LLM orientation ``[..., in, out]`` (int8) or
    ``[..., in, out/2]`` (int4, two adjacent output columns per byte, 2j in the low nibble);
    ``per_channel_scale`` is ``[..., out]`` in the model dtype.
    """

    bits: int = 8

    @property
    def _qrange(self) -> int:
        # TensorRT-LLM divides amax by 128 / 8, not 127 / 7 (cutlass_preprocessors.cpp).
        return 1 << (self.bits - 1)

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        if self.bits == 4 and out_features % 2:
            return f"{self.name}: out_features {out_features} must be even (int4 packs pairs of output channels)"
        return None

    def weight_bytes(self, out_features: int, in_features: int, n: int = 1,
                     scale_dtype_bytes: int = 2) -> int:
        self._check_dims(out_features, in_features, n)
        if self.bits == 4 and out_features % 2:
            raise UnsupportedError(f"{self.name}: out_features {out_features} must be even")
        packed = out_features * in_features * self.bits // 8
        return n * (packed + out_features * scale_dtype_bytes)

    def quantize(self, w: Tensor, *, dtype: torch.dtype) -> dict[str, Tensor]:
        _check_model_dtype(dtype)
        _check_weight(w, self.name)
        if self.bits == 4 and w.shape[-2] % 2:
            raise UnsupportedError(
                f"{self.name}: out dimension (dim -2) has odd size {w.shape[-2]}; int4 packs "
                "pairs of output channels")
        wf = w.to(dtype).to(torch.float32, copy=True)  # a private copy: it is divided in place
        qr = self._qrange
        amax = wf.abs().amax(dim=-1)
        _check_amax(amax, self.name, dtype)
        scale = amax / qr  # float32, exact division by a power of two
        # A zero scale means an all-zero channel: divide by 1 there so its codes are 0, as in TRT.
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = wf.div_(safe.unsqueeze(-1))
        q = (q.abs().add_(0.5).floor_() * q.sign()).clamp_(-qr, qr - 1)  # C round(): ties away from 0
        q = q.to(torch.int8).transpose(-1, -2)  # → [..., in, out]
        weight = q.contiguous() if self.bits == 8 else pack_int4(q, dim=-1)
        return {"weight": weight, "per_channel_scale": scale.to(dtype).contiguous()}

    def _codes_in_out(self, packed: dict[str, Tensor]) -> Tensor:
        """int8 codes ``[..., in, out]``."""
        _need(packed, ("weight", "per_channel_scale"), self.name)
        wq = packed["weight"]
        if wq.dtype != torch.int8:
            raise InputError(f"{self.name}: weight must be int8, got {wq.dtype}")
        q = wq if self.bits == 8 else unpack_int4(wq, dim=-1)
        if q.shape[-1] != packed["per_channel_scale"].shape[-1]:
            raise InputError(
                f"{self.name}: weight {tuple(wq.shape)} and per_channel_scale "
                f"{tuple(packed['per_channel_scale'].shape)} disagree on out_features")
        return q

    def dequantize(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> Tensor:
        q = self._codes_in_out(packed)
        s = packed["per_channel_scale"].float()
        # int8 × a 16-bit-float scale is exact in float32; the single rounding is into dtype.
        return (q.float() * s.unsqueeze(-2)).transpose(-1, -2).to(dtype)

    def linear(self, x: Tensor, packed: dict[str, Tensor], matmul: Matmul = torch.matmul) -> Tensor:
        q = self._codes_in_out(packed)  # [..., in, out]
        _check_x(x, q.shape[-2], self.name)
        s = packed["per_channel_scale"]
        # Codes are exact in the model dtype; the product rounds once into it, like the kernel.
        w_t = (q.to(s.dtype) * s.unsqueeze(-2)).float()
        return matmul(x.float(), w_t).to(x.dtype)


@dataclass(frozen=True)
class GroupInt4Format(QuantFormat):
    """W4A16_AWQ-style group-wise INT4 in the ModelOpt / TensorRT-LLM checkpoint layout.

    ``weight`` ``[..., out/2, in]`` int8 (adjacent output rows 2j / 2j+1 in low / high nibble),
    ``weights_scaling_factor`` ``[..., out, in/group_size]`` and ``prequant_scaling_factor``
    ``[1, in]`` in the model dtype. No activation smoothing is done, so the pre-quant scale is all
    ones; ``linear`` still applies whatever it holds.
    """

    group_size: int = GROUP_SIZE

    def __post_init__(self):
        if self.group_size not in TRTLLM_GROUP_SIZES:
            raise UnsupportedError(
                f"{self.name}: group size {self.group_size} is not one TensorRT-LLM's fine-grained "
                f"weight-only kernels run", hint=f"use one of {TRTLLM_GROUP_SIZES}")

    def _shared_keys(self) -> frozenset[str]:
        return frozenset({"prequant_scaling_factor"})

    def trtllm_layer_config(self) -> dict:
        return {"quant_algo": self.trtllm_quant_algo, "group_size": self.group_size, "has_zero_point": False,
                "pre_quant_scale": True}

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        if in_features % self.group_size:
            return (f"{self.name}: in_features (dim -1) = {in_features} is not a multiple of the "
                    f"group size {self.group_size}")
        if out_features % 2:
            return (f"{self.name}: out_features (dim -2) = {out_features} is odd; int4 packs pairs "
                    "of output rows")
        return None

    def weight_bytes(self, out_features: int, in_features: int, n: int = 1,
                     scale_dtype_bytes: int = 2) -> int:
        self._check_dims(out_features, in_features, n)
        self._check_shape(out_features, in_features)
        per_matrix = out_features * in_features // 2 + (
            out_features * (in_features // self.group_size) * scale_dtype_bytes)
        # The [1, in] pre-quant scale is shared by all experts of a stack.
        return n * per_matrix + in_features * scale_dtype_bytes

    def _check_shape(self, out_features: int, in_features: int) -> None:
        problem = self.shape_problem(out_features, in_features)
        if problem:
            raise UnsupportedError(problem)

    def quantize(self, w: Tensor, *, dtype: torch.dtype) -> dict[str, Tensor]:
        _check_model_dtype(dtype)
        _check_weight(w, self.name)
        out_f, in_f = w.shape[-2], w.shape[-1]
        self._check_shape(out_f, in_f)
        g = self.group_size
        wg = w.to(dtype).to(torch.float32, copy=True).reshape(*w.shape[:-1], in_f // g, g)
        amax = wg.abs().amax(dim=-1)
        _check_amax(amax, self.name, dtype)
        # ModelOpt's int4 block quantizer exports amax / maxbound with maxbound = 2**(4-1)-1 = 7
        # (quant_utils.get_scaling_factor(_from_weight)); codes are then clamped to [-8, 7].
        scale = amax / 7.0
        # ModelOpt replaces an all-zero group's scale by 1 to avoid dividing by zero.
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = wg.div_(scale.unsqueeze(-1)).round_().clamp_(-8, 7).to(torch.int8)
        q = q.reshape(*w.shape[:-1], in_f)
        return {
            "weight": pack_int4(q, dim=-2),
            "weights_scaling_factor": scale.to(dtype).contiguous(),
            "prequant_scaling_factor": torch.ones(1, in_f, dtype=dtype),
        }

    def _codes(self, packed: dict[str, Tensor]) -> Tensor:
        """int8 codes ``[..., out, in]``."""
        _need(packed, ("weight", "weights_scaling_factor", "prequant_scaling_factor"), self.name)
        wq = packed["weight"]
        if wq.dtype not in (torch.int8, torch.uint8):
            raise InputError(f"{self.name}: weight must be int8 (or uint8), got {wq.dtype}")
        q = unpack_int4(wq, dim=-2)
        s = packed["weights_scaling_factor"]
        if s.shape[-2] != q.shape[-2] or s.shape[-1] * self.group_size != q.shape[-1]:
            raise InputError(
                f"{self.name}: weight {tuple(wq.shape)} and weights_scaling_factor "
                f"{tuple(s.shape)} disagree (group size {self.group_size})")
        return q

    def _grouped_scale(self, packed: dict[str, Tensor]) -> Tensor:
        return packed["weights_scaling_factor"].float().repeat_interleave(self.group_size, dim=-1)

    def dequantize(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> Tensor:
        q = self._codes(packed)
        pq = packed["prequant_scaling_factor"].float().reshape(-1)
        # y = (x * pq) @ W.T, so the effective weight carries pq on its input columns.
        return (q.float() * self._grouped_scale(packed) * pq).to(dtype)

    def linear(self, x: Tensor, packed: dict[str, Tensor], matmul: Matmul = torch.matmul) -> Tensor:
        q = self._codes(packed)
        _check_x(x, q.shape[-1], self.name)
        s = packed["weights_scaling_factor"]
        # Each group's codes times its scale, broadcast (no repeated copy of the scales).
        g = q.to(s.dtype).unflatten(-1, (-1, self.group_size))
        w = (g * s.unsqueeze(-1)).flatten(-2).float()
        pq = packed["prequant_scaling_factor"]
        # [1, in] (shared), or [E, 1, in] stacked with the weights: each expert's rows get their own
        pq = pq.reshape(-1) if pq.dim() <= 2 else pq
        xs = (x * pq.to(x.dtype)).float()
        return matmul(xs, w.transpose(-1, -2)).to(x.dtype)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_FLOAT_LOOK = dict(label="FP16/BF16 (unquantized)", short="16", color="#4c72b0", trtllm_label="fp16/bf16")
FORMATS: dict[str, QuantFormat] = {
    "fp16": FloatFormat("fp16", None, dtype=torch.float16, **_FLOAT_LOOK),
    "bf16": FloatFormat("bf16", None, dtype=torch.bfloat16, **_FLOAT_LOOK),
    "fp32": FloatFormat("fp32", None, dtype=torch.float32, **_FLOAT_LOOK),
    "int8": PerChannelIntFormat("int8", "W8A16", "INT8 per-channel", "8", "#55a868", "W8A16", bits=8),
    "int4": PerChannelIntFormat("int4", "W4A16", "INT4 per-channel", "4", "#c44e52", "W4A16", bits=4),
    "int4_g128": GroupInt4Format("int4_g128", "W4A16_AWQ", "INT4 g128", "g128", "#dd8452", "W4A16_AWQ g128",
                                 group_size=128),
    "int4_g64": GroupInt4Format("int4_g64", "W4A16_AWQ", "INT4 g64", "g64", "#e5ae38", "W4A16_AWQ g64",
                                group_size=64),
}
# The quantized formats in declaration order, and from most to fewest stored bits (for plots).
QUANTIZED = tuple(n for n, f in FORMATS.items() if f.trtllm_quant_algo)
BY_BITS = tuple(sorted(QUANTIZED, key=lambda n: -FORMATS[n].bits_per_weight(256, 256)))


def get_format(name: str) -> QuantFormat:
    """The format called ``name``; unknown names raise :class:`UnsupportedError`."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise UnsupportedError(
            f"unknown quantization format {name!r}",
            hint=f"known formats: {', '.join(FORMATS)}") from None


def float_format_for(dtype: torch.dtype) -> QuantFormat:
    """The unquantized format that stores weights in ``dtype``."""
    _check_model_dtype(dtype)
    return FORMATS[_MODEL_DTYPES[dtype]]

