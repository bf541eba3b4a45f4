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
from typing import Callable, ClassVar, NamedTuple

import torch
from torch import Tensor

from trtmoe.errors import InputError, UnsupportedError

__all__ = [
    "QuantFormat",
    "PackedSpec",
    "FloatFormat",
    "PerChannelIntFormat",
    "GroupInt4Format",
    "FORMATS",
    "GROUP_SIZE",
    "TRTLLM_GROUP_SIZES",
    "get_format",
    "builder_format",
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


class PackedSpec(NamedTuple):
    """One tensor ``quantize`` returns for a single ``[out, in]`` matrix: its shape and dtype, and
    whether a stack of experts shares it (one tensor for all, not one per expert)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    shared: bool = False


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

    # What a deployment needs to know beyond the bytes (the fused-MoE formats override these):
    # ``activation`` names how the kernel quantizes its inputs (None: they stay in the model dtype);
    # formats with a static input scale need the calibrated input amax of their layer
    # (``needs_input_amax``) and take it as ``quantize(..., input_amax=...)``.
    activation = None
    needs_input_amax = False
    # True when trtmoe writes the packed bytes itself (the file holds this format's tensors); False
    # for the per-channel formats ``trtllm-build`` quantizes from float weights.
    packed_at_conversion = False
    # True for the weight-only formats ``trtllm-build`` applies itself to the float weights of a layer
    # whose ``quant_algo`` names it (the checkpoint holds float weights; a searched clip can only be
    # applied by clamping them).
    quantized_by_builder = False
    # A format TensorRT-LLM 1.2's engine path builds (trtllm-build); the fused-MoE formats are served by
    # the PyTorch backend from a ModelOpt unified-HF checkpoint instead.
    engine_path = True
    # The embedded engine's CPU kernel layout for this format's matrices (trtmoe.runtime.qkernels names
    # them); None: the format's reference ``linear`` runs it.
    engine_kernel = None
    # Rows of ``weight`` per scale block along the output dimension (None: scales never span rows), and
    # the axis of the packed ``weight`` that runs over output features (1: stored ``[in, out]``).
    out_block = None
    weight_out_axis = 0

    def quantize_input(self, x: Tensor, packed: dict[str, Tensor]) -> Tensor:
        """``x`` as this format's kernel sees its inputs: unchanged for the weight-only formats."""
        return x

    # Which activation-aware float rounding (``trtmoe.quant.fp_gptq``) chooses this format's codes and
    # block scales: "fp8" (E4M3, one per-tensor scale), "fp8_block" (E4M3, 128x128 block scales), "nvfp4"
    # (E2M1, E4M3 block scales of 16 under a global scale), "mxfp4" (E2M1, E8M0 block scales of 32), or None.
    fp_rounding: ClassVar[str | None] = None

    @property
    def int4_search(self) -> str | None:
        """Which activation-aware INT4 search (``trtmoe.quant.awq``) applies to this format: "group"
        (group-wise INT4 with a pre-quant scale and a per-(row, group) clip), "channel" (per-channel INT4:
        a per-row clip only), "w4a8" (group-wise INT4 under FP8 inputs: a pre-quant scale and a per-(row,
        group) clip, measured with the input quantization), or None (no INT4 weights, the search changes
        nothing)."""
        return None

    @property
    def modelopt_quant_algo(self) -> str | None:
        """The ``quant_algo`` ModelOpt's unified-HF ``hf_quant_config.json`` names this format by (None
        where ModelOpt has no name for it)."""
        return None

    @property
    def modelopt_group_size(self) -> int | None:
        """The ``group_size`` ModelOpt records beside ``modelopt_quant_algo`` (None: none recorded)."""
        return None

    def modelopt_layer_config(self) -> dict | None:
        """The ``hf_quant_config.json`` entry of a layer stored in this format (None: no ModelOpt name)."""
        if self.modelopt_quant_algo is None:
            return None
        cfg = {"quant_algo": self.modelopt_quant_algo}
        if self.modelopt_group_size is not None:
            cfg["group_size"] = self.modelopt_group_size
        return cfg

    def modelopt_tensors(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> dict[str, Tensor]:
        """One ``[out, in]`` matrix's packed tensors as ModelOpt's unified-HF export names and lays
        them out (suffixes ``weight``, ``weight_scale``, ...). The dequantized weight is unchanged."""
        raise UnsupportedError(f"{self.name}: ModelOpt has no export form for this format")

    def modelopt_tensor_specs(self, out_features: int, in_features: int, dtype: torch.dtype
                              ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(suffix, dtype, shape) of each tensor ModelOpt's unified-HF export writes for one ``[out, in]``
        matrix stored in this format, in its order (``dtype``: the model dtype)."""
        raise UnsupportedError(f"{self.name}: ModelOpt has no export form for this format")

    def modelopt_export(self, w: Tensor, *, dtype: torch.dtype, input_amax: Tensor | float | None = None,
                        weight_amax: Tensor | None = None) -> dict[str, Tensor]:
        """One ``[out, in]`` matrix as ModelOpt's unified-HF exporter computes it: the tensors of
        :meth:`modelopt_tensor_specs` (shapes as the file stores them). ``weight_amax`` replaces the
        matrix's own amax behind a per-tensor (global) weight scale: ModelOpt gives the linears an engine
        fuses (a routed expert's gate and up; q/k/v) one such scale, from their largest amax."""
        return self.modelopt_tensors(self.quantize(w, dtype=dtype, input_amax=input_amax), dtype=dtype)

    def modelopt_dequantize(self, tensors: dict[str, Tensor]) -> Tensor:
        """The effective float32 weight ``[out, in]`` of one matrix's unified-HF tensors."""
        raise UnsupportedError(f"{self.name}: ModelOpt has no export form for this format")

    def bits_per_weight(self, out_features: int, in_features: int,
                        scale_dtype_bytes: int = 2, *, n: int = 1) -> float:
        """Stored bits per weight of an ``[n, out, in]`` stack, scales counted."""
        return 8.0 * self.weight_bytes(out_features, in_features, n, scale_dtype_bytes) / (
            n * out_features * in_features)

    def weight_bytes(self, out_features: int, in_features: int, n: int = 1,
                     scale_dtype_bytes: int = 2) -> int:
        """Stored bytes of ``n`` stacked ``[out, in]`` matrices, scale tensors included."""
        raise NotImplementedError

    def quantize(self, w: Tensor, *, dtype: torch.dtype, input_amax: Tensor | float | None = None
                 ) -> dict[str, Tensor]:
        """Quantize ``w [..., out, in]`` for a model whose dtype is ``dtype``; returns the
        checkpoint tensors keyed by the format's tensor-name suffixes. ``input_amax`` (the calibrated
        absolute maximum of the matrix's inputs, a scalar or one per input channel) is required by
        formats with ``needs_input_amax`` and ignored by the others."""
        raise NotImplementedError

    def dequantize(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> Tensor:
        """The effective weight ``[..., out, in]`` in ``dtype``, from the packed tensors."""
        raise NotImplementedError

    def packed_specs(self, out_features: int, in_features: int, dtype: torch.dtype) -> dict[str, PackedSpec]:
        """What ``quantize`` returns for one ``[out, in]`` matrix of a ``dtype`` model, without
        quantizing: each tensor's shape and dtype, keyed and ordered as ``quantize`` keys them (the
        checkpoint layout plans file entries from it). A matrix this format cannot store raises
        :class:`UnsupportedError`, as ``quantize`` would."""
        _check_model_dtype(dtype)
        self._check_dims(out_features, in_features)
        problem = self.shape_problem(out_features, in_features)
        if problem:
            raise UnsupportedError(problem)
        shared = self._shared_keys()
        return {k: PackedSpec(tuple(shape), dt, k in shared)
                for k, (shape, dt) in self._tensor_shapes(out_features, in_features, dtype).items()}

    def _tensor_shapes(self, out_f: int, in_f: int, dtype: torch.dtype
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each tensor ``quantize`` returns for one valid ``[out_f, in_f]`` matrix."""
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
    engine_kernel = "float"

    def weight_bytes(self, out_features: int, in_features: int, n: int = 1,
                     scale_dtype_bytes: int = 2) -> int:
        self._check_dims(out_features, in_features, n)
        return n * out_features * in_features * _dtype_bytes(self.dtype)

    def quantize(self, w: Tensor, *, dtype: torch.dtype, input_amax=None) -> dict[str, Tensor]:
        _check_model_dtype(dtype)
        _check_weight(w, self.name)
        return {"weight": w.to(self.dtype).contiguous()}

    def dequantize(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> Tensor:
        _need(packed, ("weight",), self.name)
        return packed["weight"].to(dtype)

    def _tensor_shapes(self, out_f, in_f, dtype):
        return {"weight": ((out_f, in_f), self.dtype)}

    def modelopt_tensors(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> dict[str, Tensor]:
        _need(packed, ("weight",), self.name)
        return {"weight": packed["weight"]}

    def modelopt_tensor_specs(self, out_features: int, in_features: int, dtype: torch.dtype):
        return [("weight", dtype, (out_features, in_features))]

    def modelopt_export(self, w: Tensor, *, dtype: torch.dtype, input_amax=None, weight_amax=None
                        ) -> dict[str, Tensor]:
        """An unquantized linear keeps the model dtype in a unified-HF checkpoint."""
        _check_model_dtype(dtype)
        _check_weight(w, self.name)
        return {"weight": w.to(dtype).contiguous()}

    def modelopt_dequantize(self, tensors: dict[str, Tensor]) -> Tensor:
        _need(tensors, ("weight",), self.name)
        return tensors["weight"].float()

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
    quantized_by_builder = True
    engine_kernel = "per_channel_int"
    weight_out_axis = 1

    @property
    def int4_search(self) -> str | None:  # type: ignore[override]
        return "channel" if self.bits == 4 else None

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

    def quantize(self, w: Tensor, *, dtype: torch.dtype, input_amax=None) -> dict[str, Tensor]:
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

    def _tensor_shapes(self, out_f, in_f, dtype):
        return {"weight": ((in_f, out_f * self.bits // 8), torch.int8), "per_channel_scale": ((out_f,), dtype)}

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

    @property
    def modelopt_quant_algo(self) -> str | None:
        return "W8A16" if self.bits == 8 else None  # ModelOpt has no per-channel INT4 weight-only export

    def modelopt_tensors(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> dict[str, Tensor]:
        """W8A16 as ModelOpt's ``INT8_WEIGHT_ONLY_CFG`` export stores it: ``weight`` int8 ``[out, in]``,
        ``weight_scale`` float32 ``[out]``. The codes and scales are TensorRT-LLM's (amax / 128, ties
        away from zero, where ModelOpt's own quantizer takes amax / 127 and ties to even); the form
        carries them unchanged, so the dequantized weight is the same."""
        if self.bits != 8:
            return super().modelopt_tensors(packed, dtype=dtype)
        q = self._codes_in_out(packed)
        return {"weight": q.transpose(-1, -2).contiguous(),
                "weight_scale": packed["per_channel_scale"].float().contiguous()}

    def modelopt_tensor_specs(self, out_features: int, in_features: int, dtype: torch.dtype):
        if self.bits != 8:
            return super().modelopt_tensor_specs(out_features, in_features, dtype)
        return [("weight", torch.int8, (out_features, in_features)), ("weight_scale", torch.float32, (out_features,))]

    def modelopt_export(self, w: Tensor, *, dtype: torch.dtype, input_amax=None, weight_amax=None
                        ) -> dict[str, Tensor]:
        """W8A16 as ModelOpt's ``INT8_WEIGHT_ONLY_CFG`` export computes it (its own quantizer, not
        TensorRT-LLM's): ``weight_scale`` = row amax / 127 in float32, codes = the model-dtype weight over
        it rounded half to even, clamped to [-128, 127]."""
        if self.bits != 8:
            return super().modelopt_export(w, dtype=dtype)
        _check_model_dtype(dtype)
        _check_weight(w, self.name)
        wd = w.to(dtype)
        _check_amax(wd.abs().amax(), self.name, dtype)
        scale = wd.abs().amax(dim=-1).float() / 127.0
        q = (wd.float() / scale.unsqueeze(-1)).round().clamp(-128, 127).to(torch.int8)
        return {"weight": q.contiguous(), "weight_scale": scale.contiguous()}

    def modelopt_dequantize(self, tensors: dict[str, Tensor]) -> Tensor:
        if self.bits != 8:
            return super().modelopt_dequantize(tensors)
        _need(tensors, ("weight", "weight_scale"), self.name)
        return tensors["weight"].float() * tensors["weight_scale"].float().unsqueeze(-1)

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
    packed_at_conversion = True
    engine_kernel = "group_int4"
    int4_search = "group"

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

    def quantize(self, w: Tensor, *, dtype: torch.dtype, input_amax=None) -> dict[str, Tensor]:
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

    def _tensor_shapes(self, out_f, in_f, dtype):
        return {"weight": ((out_f // 2, in_f), torch.int8),
                "weights_scaling_factor": ((out_f, in_f // self.group_size), dtype),
                "prequant_scaling_factor": ((1, in_f), dtype)}

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


# ---------------------------------------------------------------------------------------------
# the fused-MoE formats: FP8, FP8 block scales, NVFP4, MXFP4, W4A8 AWQ
#
# Their tensors are keyed and laid out as ModelOpt's unified-HF export writes them (``weight``,
# ``weight_scale``, ``weight_scale_2``, ``input_scale``, ``pre_quant_scale``), one ``[out, in]`` matrix
# per expert (leading dims stack experts: per-matrix scales then have those leading dims). The rules
# below are restated from ModelOpt 0.47's quantizers and exporter and TensorRT-LLM's fused-MoE loaders:
#
# * E4M3 (``torch.float8_e4m3fn``): largest finite 448, round to nearest even; values are clamped to
#   ±448 before the cast (a saturating conversion, whatever the device's cast does out of range).
# * E2M1: the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (code = sign << 3 | index), two codes per byte
#   along the input dim, element 2j in the low nibble. NVFP4 rounds to nearest with ties to the even
#   code (0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4) and saturates at 6;
#   ModelOpt's MXFP4 packer rounds ties toward zero instead (0.75 → 0.5, 1.75 → 1.5, ...), and writes
#   an exact zero with the sign bit set. Each format keeps its own rule so its bytes are ModelOpt's.
# * E8M0 (MXFP4 block scales): a uint8 biased exponent, scale = 2**(u - 127); the block's exponent
#   is ceil(log2(amax / 6)) (at least -127), so the block's largest value lands in (3, 6].
# * Per-tensor scales are float32; an all-zero tensor or block gets scale 1 (codes 0).

E4M3_MAX = 448.0
E2M1_MAX = 6.0
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# The midpoints whose upper neighbour has the even code (1.0, 2.0, 4.0): ties there round up.
_E2M1_TIES_UP = (0.75, 1.75, 3.5)
_NVFP4_SCALE_MIN = 2.0 ** -9  # the smallest E4M3 subnormal: block scales never cast to zero
FP8_BLOCK = 128  # DeepSeek-V3's weight block (128 x 128) and activation group (1 x 128)


def _grid(device) -> Tensor:
    return torch.tensor(_E2M1_GRID, dtype=torch.float32, device=device)


def e4m3_round(x: Tensor) -> Tensor:
    """``x`` (float32) rounded to E4M3, saturating at ±448, as float32."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def e2m1_codes(x: Tensor, *, ties: str = "even") -> Tensor:
    """E2M1 codes (uint8, sign << 3 | magnitude index) of float32 ``x`` (already divided by its
    scale). ``ties`` "even" rounds halfway values to the even code (NVFP4, and the conversion the
    GPUs do); "down" rounds them toward zero and gives an exact zero the sign bit (ModelOpt's MXFP4
    packer)."""
    a = x.abs()
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    if ties == "even":
        idx = torch.searchsorted(mids, a.contiguous(), right=False).to(torch.uint8)
        up = torch.zeros_like(idx, dtype=torch.bool)
        for t in _E2M1_TIES_UP:
            up |= a == t
        idx = idx + up.to(torch.uint8)
        sign = x < 0
    elif ties == "down":
        idx = torch.searchsorted(mids, a.contiguous(), right=False).to(torch.uint8)
        sign = x <= 0
    else:
        raise ValueError(f"unknown tie rule {ties!r}")
    return (sign.to(torch.uint8) << 3) | idx


def e2m1_values(codes: Tensor) -> Tensor:
    """The float32 values of E2M1 ``codes`` (uint8 in [0, 15])."""
    c = codes.to(torch.long)
    mag = _grid(codes.device)[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def e2m1_round(x: Tensor) -> Tensor:
    """``x`` rounded to E2M1 (ties to even, saturating at ±6), as float32."""
    return e2m1_values(e2m1_codes(x))


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes in [0, 15] two per byte along the last dim: element 2j low, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise UnsupportedError(f"cannot pack 4-bit codes along a dimension of odd size {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 codes, last dim doubled."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)


def _blocks(x: Tensor, size: int) -> Tensor:
    """``x [..., n]`` as ``[..., n / size, size]`` (n a multiple of size)."""
    return x.unflatten(-1, (x.shape[-1] // size, size))


def _block_amax_2d(w: Tensor, bo: int, bi: int) -> Tensor:
    """amax of every ``bo x bi`` block of ``w [..., out, in]`` (partial blocks at the edges included):
    ``[..., ceil(out / bo), ceil(in / bi)]``."""
    out_f, in_f = w.shape[-2], w.shape[-1]
    po, pi = -out_f % bo, -in_f % bi
    a = w.abs()
    if po or pi:
        a = torch.nn.functional.pad(a, (0, pi, 0, po))
    a = a.unflatten(-1, (-1, bi)).unflatten(-3, (-1, bo))  # [..., O, bo, I, bi]
    return a.amax(dim=(-3, -1))


def _expand_2d(s: Tensor, bo: int, bi: int, out_f: int, in_f: int) -> Tensor:
    """Block values ``[..., O, I]`` repeated over their ``bo x bi`` blocks, cropped to ``out x in``."""
    return s.repeat_interleave(bo, dim=-2).repeat_interleave(bi, dim=-1)[..., :out_f, :in_f]


def _nonzero(scale: Tensor) -> Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _lead(t: Tensor, x_dims: int) -> Tensor:
    """A per-matrix tensor (shape = the weight's leading dims) shaped to broadcast against an
    ``x_dims``-dim ``[..., N, in]`` block (trailing 1s)."""
    return t.reshape(*t.shape, *([1] * (x_dims - t.dim() if t.dim() else x_dims)))


def _input_amax(input_amax, name: str, pre_quant_scale: Tensor | None = None) -> Tensor:
    """The scalar amax an input scale is made from: ``input_amax`` is a scalar or one value per input
    channel (then, with ``pre_quant_scale``, the amax of the pre-scaled inputs)."""
    if input_amax is None:
        raise InputError(f"{name} quantizes its activations with a static scale and needs the input amax "
                         "of its layer", hint="calibrate the model first; the calibration records it")
    a = torch.as_tensor(input_amax, dtype=torch.float32).detach().cpu()
    if not bool(torch.isfinite(a).all()) or bool((a < 0).any()) or a.numel() == 0:
        raise InputError(f"{name}: input amax must be finite and non-negative, got {a.flatten()[:4].tolist()}")
    if pre_quant_scale is not None and a.numel() > 1:
        a = a * pre_quant_scale.float().cpu().reshape(-1)
    return a.amax()


@dataclass(frozen=True)
class FusedMoEFormat(QuantFormat):
    """A format TensorRT-LLM's PyTorch-backend fused MoE runs (and ModelOpt exports), with the
    activation quantization its kernel does emulated on the way into ``linear``. Subclasses say how
    the weight is stored; ``activation`` names the input rule:

    * None: inputs stay in the model dtype (weight-only: W4A16 / W8A16);
    * ``"fp8"``: static per-tensor E4M3 with ``input_scale = amax / 448``: ``q = e4m3(x / s)``;
    * ``"fp8_1x128"``: dynamic per token, per group of 128 inputs, ``s = amax(group) / 448``;
    * ``"nvfp4"``: blocks of 16 inputs in E2M1 under an E4M3 block scale and the static global
      ``input_scale = amax / (6 * 448)``, the same rule as the weight.
    """

    modelopt_algo: str | None = None
    modelopt_group: int | None = None
    activation: str | None = None
    packed_at_conversion = True
    engine_path = False

    @property
    def needs_input_amax(self) -> bool:  # type: ignore[override]
        return self.activation in ("fp8", "nvfp4")

    @property
    def modelopt_quant_algo(self) -> str | None:
        return self.modelopt_algo

    @property
    def modelopt_group_size(self) -> int | None:
        return self.modelopt_group

    def trtllm_layer_config(self) -> dict:
        cfg = {"quant_algo": self.trtllm_quant_algo}
        if self.modelopt_group is not None:
            cfg["group_size"] = self.modelopt_group
        return cfg

    def modelopt_tensors(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> dict[str, Tensor]:
        return dict(packed)  # stored in ModelOpt's form already

    def modelopt_export(self, w: Tensor, *, dtype: torch.dtype, input_amax=None, weight_amax=None
                        ) -> dict[str, Tensor]:
        packed = self.quantize(w, dtype=dtype, input_amax=input_amax, weight_amax=weight_amax)
        return {s: packed[s].reshape(shape) for s, _, shape in self.modelopt_tensor_specs(*w.shape[-2:], dtype)}

    def modelopt_dequantize(self, tensors: dict[str, Tensor]) -> Tensor:
        return self.dequantize(tensors, dtype=torch.float32)

    def _input_scale_spec(self) -> list:
        return [("input_scale", torch.float32, ())] if self.needs_input_amax else []

    def _global_amax(self, wd: Tensor, weight_amax: Tensor | None) -> Tensor:
        """The amax behind the per-tensor weight scale: the matrix's own, or a fused group's."""
        if weight_amax is None:
            return wd.abs().amax(dim=(-2, -1))
        return torch.as_tensor(weight_amax, dtype=torch.float32).detach().cpu()

    def _shared_keys(self) -> frozenset[str]:
        return frozenset({"input_scale"})

    def _input_scale_bytes(self) -> int:
        return 4 if self.needs_input_amax else 0

    def _input_scale_shape(self) -> dict:
        """The ``input_scale`` entry of ``_tensor_shapes`` (a float32 scalar) when the format has one."""
        return {"input_scale": ((), torch.float32)} if self.needs_input_amax else {}

    # -- activations --------------------------------------------------------------------------------
    def quantize_input(self, x: Tensor, packed: dict[str, Tensor]) -> Tensor:
        """``x`` (float32 ``[..., N, in]``) as the kernel sees it: quantized by ``activation`` and
        dequantized back to float32 (``x`` itself for weight-only formats)."""
        if self.activation is None:
            return x
        if self.activation == "fp8_1x128":
            return fp8_groups_fake(x, FP8_BLOCK)
        _need(packed, ("input_scale",), self.name)
        s = _lead(packed["input_scale"].float(), x.dim())
        if self.activation == "fp8":
            return fp8_tensor_fake(x, s)
        return nvfp4_fake(x, s)

    def linear(self, x: Tensor, packed: dict[str, Tensor], matmul: Matmul = torch.matmul) -> Tensor:
        w = self._dequant_f32(packed)
        _check_x(x, w.shape[-1], self.name)
        xq = self.quantize_input(x.float(), packed)
        return matmul(xq, w.transpose(-1, -2)).to(x.dtype)

    def dequantize(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> Tensor:
        return self._dequant_f32(packed).to(dtype)

    def _dequant_f32(self, packed: dict[str, Tensor]) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def _input_scale(self, input_amax, divisor: float, dtype: torch.dtype, pre_quant_scale: Tensor | None = None
                     ) -> dict:
        if not self.needs_input_amax:
            return {}
        # The kernel's inputs are in the model dtype: their amax is the measured one rounded to it
        # (rounding is monotonic), which is also what a calibration run in that dtype measures.
        amax = _input_amax(input_amax, self.name, pre_quant_scale).to(dtype).float()
        return {"input_scale": _nonzero(amax / divisor).to(torch.float32)}

    def _prepare(self, w: Tensor, dtype: torch.dtype) -> Tensor:
        _check_model_dtype(dtype)
        _check_weight(w, self.name)
        problem = self.shape_problem(w.shape[-2], w.shape[-1])
        if problem:
            raise UnsupportedError(problem)
        wd = w.to(dtype).float()
        _check_amax(wd.abs().amax(), self.name, dtype)
        return wd


def fp8_tensor_fake(x: Tensor, scale: Tensor) -> Tensor:
    """Static per-tensor FP8: ``e4m3(x / scale) * scale`` (float32)."""
    return e4m3_round(x / scale) * scale


def fp8_groups_fake(x: Tensor, group: int) -> Tensor:
    """Dynamic FP8 per row and group of ``group`` inputs (the last group may be shorter):
    ``s = amax / 448``, ``e4m3(x / s) * s`` (float32)."""
    n = x.shape[-1]
    pad = -n % group
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    g = _blocks(xp, group)
    s = _nonzero(g.abs().amax(dim=-1, keepdim=True) / E4M3_MAX)
    y = (e4m3_round(g / s) * s).flatten(-2)
    return y[..., :n] if pad else y


def _nvfp4_block_scales(block_amax: Tensor, global_scale: Tensor) -> Tensor:
    """E4M3 block scales (as float32) of NVFP4 blocks whose amax is ``block_amax`` under
    ``global_scale``: ``amax / (6 * global)``, 1 for an all-zero block, kept within [2**-9, 448]."""
    s = block_amax / (E2M1_MAX * global_scale)
    s = torch.where(s == 0, torch.ones_like(s), s)
    return s.clamp(_NVFP4_SCALE_MIN, E4M3_MAX).to(torch.float8_e4m3fn).float()


def nvfp4_fake(x: Tensor, global_scale: Tensor, block: int = 16) -> Tensor:
    """NVFP4 activations: blocks of ``block`` inputs, each in E2M1 under its E4M3 block scale and the
    static ``global_scale``; returns the dequantized float32 values."""
    g = _blocks(x, block)
    gs = global_scale.unsqueeze(-1)
    bs = _nvfp4_block_scales(g.abs().amax(dim=-1, keepdim=True), gs)
    scale = bs * gs
    return (e2m1_round(g / scale) * scale).flatten(-2)


@dataclass(frozen=True)
class FP8Format(FusedMoEFormat):
    """FP8 E4M3 weights with one float32 scale per matrix (``weight_scale = amax / 448``), and with
    ``activation`` "fp8" a static per-tensor FP8 input scale (W8A8, ModelOpt ``FP8``)."""

    fp_rounding = "fp8"

    def weight_bytes(self, out_features: int, in_features: int, n: int = 1,
                     scale_dtype_bytes: int = 2) -> int:
        self._check_dims(out_features, in_features, n)
        return n * (out_features * in_features + 4) + self._input_scale_bytes()

    def modelopt_tensor_specs(self, out_features: int, in_features: int, dtype: torch.dtype):
        return [("weight", torch.float8_e4m3fn, (out_features, in_features)), ("weight_scale", torch.float32, ()),
                *self._input_scale_spec()]

    def quantize(self, w: Tensor, *, dtype: torch.dtype, input_amax=None, weight_amax=None) -> dict[str, Tensor]:
        wd = self._prepare(w, dtype)
        scale = _nonzero(self._global_amax(wd, weight_amax) / E4M3_MAX)
        # The quotient is rounded to the model dtype before E4M3, as ModelOpt's exporter computes it (a
        # model-dtype weight divided by a float32 scalar scale yields the model dtype).
        q = (wd / _lead(scale, wd.dim())).to(dtype).float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"weight": q.contiguous(), "weight_scale": scale.contiguous(),
                **self._input_scale(input_amax, E4M3_MAX, dtype)}

    def _tensor_shapes(self, out_f, in_f, dtype):
        return {"weight": ((out_f, in_f), torch.float8_e4m3fn), "weight_scale": ((), torch.float32),
                **self._input_scale_shape()}

    def _dequant_f32(self, packed: dict[str, Tensor]) -> Tensor:
        _need(packed, ("weight", "weight_scale"), self.name)
        q = packed["weight"]
        if q.dtype != torch.float8_e4m3fn:
            raise InputError(f"{self.name}: weight must be float8_e4m3fn, got {q.dtype}")
        return q.float() * _lead(packed["weight_scale"].float(), q.dim())


@dataclass(frozen=True)
class FP8BlockFormat(FusedMoEFormat):
    """FP8 E4M3 weights with one float32 scale per 128 x 128 block (``weight_scale`` ``[ceil(out/128),
    ceil(in/128)]``, amax / 448; DeepSeek-V3's ``weight_scale_inv``). With ``activation``
    "fp8_1x128" the inputs are quantized per token in groups of 128 (TensorRT-LLM
    ``FP8_BLOCK_SCALES``); without, weight-only (ModelOpt ``fp8_pb_wo``)."""

    fp_rounding = "fp8_block"

    block: int = FP8_BLOCK

    @property
    def out_block(self) -> int:
        return self.block

    def weight_bytes(self, out_features: int, in_features: int, n: int = 1,
                     scale_dtype_bytes: int = 2) -> int:
        self._check_dims(out_features, in_features, n)
        blocks = -(-out_features // self.block) * -(-in_features // self.block)
        return n * (out_features * in_features + 4 * blocks)

    def modelopt_tensor_specs(self, out_features: int, in_features: int, dtype: torch.dtype):
        # ModelOpt squeezes the block-scale grid: a grid dimension of one block is dropped.
        grid = tuple(d for d in (-(-out_features // self.block), -(-in_features // self.block)) if d != 1)
        return [("weight", torch.float8_e4m3fn, (out_features, in_features)), ("weight_scale", torch.float32, grid)]

    def modelopt_dequantize(self, tensors: dict[str, Tensor]) -> Tensor:
        _need(tensors, ("weight", "weight_scale"), self.name)
        q = tensors["weight"]
        grid = (-(-q.shape[-2] // self.block), -(-q.shape[-1] // self.block))
        return self._dequant_f32({**tensors, "weight_scale": tensors["weight_scale"].reshape(grid)})

    def quantize(self, w: Tensor, *, dtype: torch.dtype, input_amax=None, weight_amax=None) -> dict[str, Tensor]:
        """``weight_amax`` (a fused group's) sets the scale of a matrix that is a single block."""
        wd = self._prepare(w, dtype)
        b = self.block
        amax = _block_amax_2d(wd, b, b)
        if weight_amax is not None and amax.shape[-2:] == (1, 1):
            amax = self._global_amax(wd, weight_amax).reshape(amax.shape)
        scale = _nonzero(amax / E4M3_MAX)
        full = _expand_2d(scale, b, b, wd.shape[-2], wd.shape[-1])
        q = (wd / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"weight": q.contiguous(), "weight_scale": scale.contiguous()}

    def _tensor_shapes(self, out_f, in_f, dtype):
        b = self.block
        return {"weight": ((out_f, in_f), torch.float8_e4m3fn),
                "weight_scale": ((-(-out_f // b), -(-in_f // b)), torch.float32)}

    def _dequant_f32(self, packed: dict[str, Tensor]) -> Tensor:
        _need(packed, ("weight", "weight_scale"), self.name)
        q, s = packed["weight"], packed["weight_scale"].float()
        if q.dtype != torch.float8_e4m3fn:
            raise InputError(f"{self.name}: weight must be float8_e4m3fn, got {q.dtype}")
        b = self.block
        if s.shape[-2:] != (-(-q.shape[-2] // b), -(-q.shape[-1] // b)):
            raise InputError(f"{self.name}: weight {tuple(q.shape)} and weight_scale {tuple(s.shape)} disagree "
                             f"(blocks of {b} x {b})")
        return q.float() * _expand_2d(s, b, b, q.shape[-2], q.shape[-1])


@dataclass(frozen=True)
class _BlockFP4Format(FusedMoEFormat):
    """E2M1 weights two per byte with one 8-bit scale per ``block`` inputs (NVFP4, MXFP4); a format
    with a float32 global scale per matrix counts it in ``global_scale_bytes``."""

    block: int = 16
    global_scale_bytes: int = 0

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        if in_features % self.block:
            return (f"{self.name}: in_features (dim -1) = {in_features} is not a multiple of the block "
                    f"size {self.block}")
        return None

    def weight_bytes(self, out_features: int, in_features: int, n: int = 1,
                     scale_dtype_bytes: int = 2) -> int:
        self._check_dims(out_features, in_features, n)
        problem = self.shape_problem(out_features, in_features)
        if problem:
            raise UnsupportedError(problem)
        return n * (out_features * in_features // 2 + out_features * in_features // self.block
                    + self.global_scale_bytes) + self._input_scale_bytes()


@dataclass(frozen=True)
class NVFP4Format(_BlockFP4Format):
    """NVFP4: E2M1 weights in blocks of 16 inputs, an E4M3 scale per block (``weight_scale`` ``[out,
    in/16]``) and a float32 global ``weight_scale_2 = amax / (6 * 448)``; ``weight`` uint8 ``[out,
    in/2]``. With ``activation`` "nvfp4" the inputs are NVFP4 too under the static
    ``input_scale = amax / (6 * 448)`` (W4A4, ModelOpt ``NVFP4``); without, W4A16 (``W4A16_NVFP4``)."""

    fp_rounding = "nvfp4"

    block: int = 16
    global_scale_bytes: int = 4  # weight_scale_2

    def modelopt_tensor_specs(self, out_features: int, in_features: int, dtype: torch.dtype):
        return [("weight", torch.uint8, (out_features, in_features // 2)),
                ("weight_scale", torch.float8_e4m3fn, (out_features, in_features // self.block)),
                ("weight_scale_2", torch.float32, ()), *self._input_scale_spec()]

    def quantize(self, w: Tensor, *, dtype: torch.dtype, input_amax=None, weight_amax=None) -> dict[str, Tensor]:
        wd = self._prepare(w, dtype)
        gs = _nonzero(self._global_amax(wd, weight_amax) / (E2M1_MAX * E4M3_MAX))
        g = _blocks(wd, self.block)
        gsl = _lead(gs, g.dim())
        bs = _nvfp4_block_scales(g.abs().amax(dim=-1), gsl.squeeze(-1))
        codes = e2m1_codes(g / (bs.unsqueeze(-1) * gsl)).flatten(-2)
        return {"weight": pack_nibbles(codes), "weight_scale": bs.to(torch.float8_e4m3fn).contiguous(),
                "weight_scale_2": gs.contiguous(), **self._input_scale(input_amax, E2M1_MAX * E4M3_MAX, dtype)}

    def _tensor_shapes(self, out_f, in_f, dtype):
        return {"weight": ((out_f, in_f // 2), torch.uint8),
                "weight_scale": ((out_f, in_f // self.block), torch.float8_e4m3fn),
                "weight_scale_2": ((), torch.float32), **self._input_scale_shape()}

    def _dequant_f32(self, packed: dict[str, Tensor]) -> Tensor:
        _need(packed, ("weight", "weight_scale", "weight_scale_2"), self.name)
        wq, bs = packed["weight"], packed["weight_scale"]
        if wq.dtype != torch.uint8 or bs.dtype != torch.float8_e4m3fn:
            raise InputError(f"{self.name}: weight must be uint8 and weight_scale float8_e4m3fn, got "
                             f"{wq.dtype} / {bs.dtype}")
        v = _blocks(e2m1_values(unpack_nibbles(wq)), self.block)
        if bs.shape != v.shape[:-1]:
            raise InputError(f"{self.name}: weight {tuple(wq.shape)} and weight_scale {tuple(bs.shape)} disagree "
                             f"(blocks of {self.block})")
        gs = _lead(packed["weight_scale_2"].float(), v.dim())
        return (v * (bs.float().unsqueeze(-1) * gs)).flatten(-2)


@dataclass(frozen=True)
class MXFP4Format(_BlockFP4Format):
    """MXFP4 (OCP MX): E2M1 weights in blocks of 32 inputs with a power-of-two E8M0 scale per block
    (``weight_scale`` uint8 ``[out, in/32]``, biased by 127); ``weight`` uint8 ``[out, in/2]``.
    Weight-only (W4A16; ModelOpt ``mxfp4``, TensorRT-LLM ``W4A16_MXFP4``)."""

    fp_rounding = "mxfp4"

    block: int = 32

    def modelopt_tensor_specs(self, out_features: int, in_features: int, dtype: torch.dtype):
        return [("weight", torch.uint8, (out_features, in_features // 2)),
                ("weight_scale", torch.uint8, (out_features, in_features // self.block))]

    def quantize(self, w: Tensor, *, dtype: torch.dtype, input_amax=None, weight_amax=None) -> dict[str, Tensor]:
        """Every scale is per block: ``weight_amax`` has nothing to set."""
        wd = self._prepare(w, dtype)
        g = _blocks(wd, self.block)
        e = e8m0_exponents(g.abs().amax(dim=-1))
        codes = e2m1_codes(g / torch.exp2(e).unsqueeze(-1), ties="down").flatten(-2)
        return {"weight": pack_nibbles(codes), "weight_scale": (e + 127).to(torch.uint8).contiguous()}

    def _tensor_shapes(self, out_f, in_f, dtype):
        return {"weight": ((out_f, in_f // 2), torch.uint8), "weight_scale": ((out_f, in_f // self.block), torch.uint8)}

    def _dequant_f32(self, packed: dict[str, Tensor]) -> Tensor:
        _need(packed, ("weight", "weight_scale"), self.name)
        wq, s = packed["weight"], packed["weight_scale"]
        if wq.dtype != torch.uint8 or s.dtype != torch.uint8:
            raise InputError(f"{self.name}: weight and weight_scale must be uint8, got {wq.dtype} / {s.dtype}")
        v = _blocks(e2m1_values(unpack_nibbles(wq)), self.block)
        if s.shape != v.shape[:-1]:
            raise InputError(f"{self.name}: weight {tuple(wq.shape)} and weight_scale {tuple(s.shape)} disagree "
                             f"(blocks of {self.block})")
        return (v * torch.exp2(s.float() - 127).unsqueeze(-1)).flatten(-2)


def e8m0_exponents(block_amax: Tensor) -> Tensor:
    """The unbiased E8M0 exponent of MX blocks whose amax is ``block_amax`` (float32):
    ``ceil(log2(amax / 6))``, within [-127, 127]."""
    return torch.ceil(torch.log2(block_amax.float() / E2M1_MAX).clamp(min=-127.0)).clamp(max=127.0)


@dataclass(frozen=True)
class W4A8AwqFormat(FusedMoEFormat):
    """W4A8 AWQ: INT4 weights in groups of 128 inputs (``weight`` uint8 ``[out/2, in]``, adjacent
    output rows 2j / 2j+1 in the low / high nibble; ``weight_scale`` float32 ``[out, in/128]`` =
    group amax / 7), a per-matrix ``weight_scale_2 = amax / 448``, a ``pre_quant_scale`` ``[in]`` the
    inputs are multiplied by (AWQ smoothing; ones when none was searched) and FP8 inputs under the
    static ``input_scale``. The effective weight is ModelOpt's: the INT4-dequantized weight rounded
    to E4M3 under ``weight_scale_2`` (the kernel runs it as FP8)."""

    group_size: int = GROUP_SIZE
    # trtmoe.quant.awq searches its pre-quant scale and per-(row, group) clip as the kernel runs it
    # (inputs pre-scaled, then FP8 under the static input scale that follows the pre-quant scale).
    int4_search = "w4a8"

    def _shared_keys(self) -> frozenset[str]:
        return frozenset({"input_scale", "pre_quant_scale"})

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        if in_features % self.group_size:
            return (f"{self.name}: in_features (dim -1) = {in_features} is not a multiple of the "
                    f"group size {self.group_size}")
        if out_features % 2:
            return f"{self.name}: out_features (dim -2) = {out_features} is odd; int4 packs pairs of output rows"
        return None

    def weight_bytes(self, out_features: int, in_features: int, n: int = 1,
                     scale_dtype_bytes: int = 2) -> int:
        self._check_dims(out_features, in_features, n)
        problem = self.shape_problem(out_features, in_features)
        if problem:
            raise UnsupportedError(problem)
        per = out_features * in_features // 2 + 4 * out_features * (in_features // self.group_size) + 4
        return n * per + 4 + in_features * scale_dtype_bytes

    def modelopt_tensor_specs(self, out_features: int, in_features: int, dtype: torch.dtype):
        return [("weight", torch.uint8, (out_features // 2, in_features)),
                ("weight_scale", torch.float32, (out_features, in_features // self.group_size)),
                ("weight_scale_2", torch.float32, ()), ("pre_quant_scale", dtype, (in_features,)),
                *self._input_scale_spec()]

    def modelopt_layer_config(self) -> dict | None:
        # ModelOpt's hf_quant_config entry for W4A8_AWQ also says the INT4 is symmetric and pre-scaled.
        return {**super().modelopt_layer_config(), "has_zero_point": False, "pre_quant_scale": True}

    def quantize(self, w: Tensor, *, dtype: torch.dtype, input_amax=None, weight_amax=None,
                 pre_quant_scale: Tensor | None = None) -> dict[str, Tensor]:
        """``pre_quant_scale`` (``[in]``, AWQ's smoothing) divides the weight's input columns and
        multiplies the inputs; ``input_amax`` per input channel lets the input scale follow it.
        ``weight_amax`` (of the pre-scaled weight of a fused group) sets ``weight_scale_2``."""
        wd = self._prepare(w, dtype)
        in_f = wd.shape[-1]
        pq = torch.ones(in_f, dtype=dtype) if pre_quant_scale is None else pre_quant_scale.reshape(-1).to(dtype)
        if pq.numel() != in_f or not bool((pq.float() > 0).all()):
            raise InputError(f"{self.name}: pre_quant_scale must hold {in_f} positive values")
        wt = wd / pq.float()
        g = _blocks(wt, self.group_size)
        scale = _nonzero(g.abs().amax(dim=-1) / 7.0)
        codes = (g / scale.unsqueeze(-1)).round().clamp(-8, 7).to(torch.int8).flatten(-2)
        s2 = _nonzero(self._global_amax(wt, weight_amax) / E4M3_MAX)
        packed = pack_int4(codes, dim=-2).view(torch.uint8)
        return {"weight": packed, "weight_scale": scale.contiguous(), "weight_scale_2": s2.contiguous(),
                "pre_quant_scale": pq.contiguous(), **self._input_scale(input_amax, E4M3_MAX, dtype, pq)}

    def _tensor_shapes(self, out_f, in_f, dtype):
        return {"weight": ((out_f // 2, in_f), torch.uint8),
                "weight_scale": ((out_f, in_f // self.group_size), torch.float32),
                "weight_scale_2": ((), torch.float32), "pre_quant_scale": ((in_f,), dtype),
                **self._input_scale_shape()}

    def _dequant_f32(self, packed: dict[str, Tensor]) -> Tensor:
        """The effective weight on the pre-scaled inputs (without ``pre_quant_scale``)."""
        _need(packed, ("weight", "weight_scale", "weight_scale_2"), self.name)
        wq, s = packed["weight"], packed["weight_scale"].float()
        q = unpack_int4(wq, dim=-2).float()
        if s.shape[-2] != q.shape[-2] or s.shape[-1] * self.group_size != q.shape[-1]:
            raise InputError(f"{self.name}: weight {tuple(wq.shape)} and weight_scale {tuple(s.shape)} disagree "
                             f"(group size {self.group_size})")
        w4 = (_blocks(q, self.group_size) * s.unsqueeze(-1)).flatten(-2)
        s2 = _lead(packed["weight_scale_2"].float(), w4.dim())
        return e4m3_round(w4 / s2) * s2

    def dequantize(self, packed: dict[str, Tensor], *, dtype: torch.dtype) -> Tensor:
        w = self._dequant_f32(packed)
        pq = packed.get("pre_quant_scale")
        if pq is not None:  # y = (x * pq) @ W.T: the effective weight carries pq on its input columns
            w = w * pq.float().reshape(*pq.shape[:-1], 1, pq.shape[-1]) if pq.dim() > 1 else w * pq.float()
        return w.to(dtype)

    def quantize_input(self, x: Tensor, packed: dict[str, Tensor]) -> Tensor:
        pq = packed.get("pre_quant_scale")
        if pq is not None:
            pqf = pq.float()
            x = x * (pqf.reshape(*pqf.shape[:-1], *([1] * (x.dim() - pqf.dim())), pqf.shape[-1])
                     if pqf.dim() > 1 else pqf)
        return super().quantize_input(x, packed)


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
_W4A16 = dict(activation=None)
FORMATS.update({
    "fp8": FP8Format("fp8", "FP8", "FP8 W8A8 (per-tensor)", "F8", "#8172b3", "FP8",
                     modelopt_algo="FP8", activation="fp8"),
    "fp8_block": FP8BlockFormat("fp8_block", "FP8_BLOCK_SCALES", "FP8 128x128 blocks, 1x128 activations", "F8b",
                                "#64b5cd", "FP8_BLOCK_SCALES", activation="fp8_1x128"),
    "fp8_block_wo": FP8BlockFormat("fp8_block_wo", "FP8_BLOCK_SCALES", "FP8 128x128 blocks, weight-only", "F8w",
                                   "#4c9fb8", "FP8 block (weight-only)", modelopt_algo="fp8_pb_wo", **_W4A16),
    "nvfp4": NVFP4Format("nvfp4", "NVFP4", "NVFP4 W4A4", "NV4", "#937860", "NVFP4",
                         modelopt_algo="NVFP4", modelopt_group=16, activation="nvfp4"),
    "nvfp4_w4a16": NVFP4Format("nvfp4_w4a16", "W4A16_NVFP4", "NVFP4 weight-only (W4A16)", "NV4w", "#b39b84",
                               "W4A16_NVFP4", modelopt_algo="W4A16_NVFP4", modelopt_group=16, **_W4A16),
    "mxfp4": MXFP4Format("mxfp4", "W4A16_MXFP4", "MXFP4 weight-only (W4A16)", "MX4", "#da8bc3", "W4A16_MXFP4",
                         modelopt_algo="mxfp4", **_W4A16),
    "w4a8_awq": W4A8AwqFormat("w4a8_awq", "W4A8_AWQ", "INT4 g128, FP8 activations (W4A8 AWQ)", "W4A8", "#8c8c8c",
                              "W4A8_AWQ", modelopt_algo="W4A8_AWQ", modelopt_group=128, activation="fp8"),
})
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


def builder_format(quant_algo: str | None) -> QuantFormat | None:
    """The weight-only format ``trtllm-build`` applies to a float layer whose ``quant_algo`` is
    ``quant_algo`` (``W8A16`` -> int8, ``W4A16`` -> int4); None for any other algorithm."""
    return next((f for f in FORMATS.values() if f.quantized_by_builder and f.trtllm_quant_algo == quant_algo), None)


def float_format_for(dtype: torch.dtype) -> QuantFormat:
    """The unquantized format that stores weights in ``dtype``."""
    _check_model_dtype(dtype)
    return FORMATS[_MODEL_DTYPES[dtype]]

