"""Activation-aware rounding of the fused-MoE float formats (FP8, FP8 128x128 blocks, NVFP4, MXFP4).

The engines read only the stored tensors — E4M3 weights and their float32 scale(s); E2M1 codes, their
8-bit block scales and (NVFP4) the float32 global scale — never how the codes were chosen. Round to
nearest picks every code and block scale from the weight alone; here they are chosen to make the
matrix's output error small on the inputs it receives, ``‖X (W − Ŵ)ᵀ‖²`` with ``H = Xᵀ X`` the Gram
matrix of the routed tokens' inputs (the same statistics ``trtmoe.quant.gptq`` rounds INT4 from):

* **error feedback** (``feedback``): columns are rounded in order, and the error each leaves is pushed
  onto the columns not yet rounded through the upper Cholesky factor ``U`` of ``H⁻¹`` (dampened: ``DAMP``
  for the 4-bit formats as ``gptq``, ``DAMP_FP8`` for FP8), the optimal-brain-surgeon update GPTQ uses. Columns are visited in their natural order, a
  scale block at a time: a block's scale is fixed from the block's weights as they stand when its first
  column is reached (after the feedback of the blocks before it), then its columns are rounded on it;
* **scale search** (``search``): for each block, candidate scales — NVFP4: the block amax × (1.0, 1.1,
  1.05, 0.95, …, 0.7) under the format's own rule (``amax / (6 · global)`` rounded to E4M3);
  MXFP4: the E8M0 exponent and one below it; FP8 128x128: the block amax × (1.0, 0.95, 0.9, 0.85) over
  448 — and the one whose rounding adds the least output error is kept, per row (NVFP4, MXFP4) or per
  128-row block (FP8 blocks). With feedback the error of a candidate is the block's exact share of the
  greedy objective: Σ over its columns of (rounding error / Uᵢᵢ)², the columns after the block free to
  compensate; without, the block's own ``D_b H_bb D_bᵀ``. FP8 per-tensor has one scale and no search.

What stays as the format defines it: the global / per-tensor scales (ModelOpt's ``amax / (6 · 448)``
and ``amax / 448``, a fused gate/up group's shared amax included), the code grids and their tie rules,
the scale encodings (E4M3 block scales, E8M0 exponents, float32 FP8 block scales), the input scale and
every tensor's shape: the result is the format's ``quantize`` output with only ``weight`` and (where
searched) ``weight_scale`` replaced, so ``modelopt_tensors`` / ``modelopt_dequantize`` and the
engines' dequantization are those of round to nearest. No tensor is added: the NVFP4 / FP8 exports
have no pre-quant scale, so nothing AWQ-like that needs one is done.

With ``H`` = identity (no correlation between inputs), error feedback moves nothing and, without the
search, the codes are round to nearest's bit for bit. ``quantize`` keeps round to nearest whenever its
Gram-weighted error is not larger (``never_worse``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..errors import InputError
from . import gptq
from .formats import (E4M3_MAX, QuantFormat,
                      _nvfp4_block_scales, e2m1_codes, e2m1_values, e4m3_round, e8m0_exponents, pack_nibbles)

# Relative dampening of diag(H) (λ = DAMP · mean diag H), per format family. The 4-bit formats take
# gptq's 0.01; FP8's rounding error is small next to what error feedback fitted to the calibration rows
# adds elsewhere, so it is dampened much more: on the trained Mixtral fixture (16 x 128 calibration
# tokens, awq_gptq), uniform FP8's held-out KL is 0.00165 at 0.01, 0.00077 at 0.1 and 0.00074 at 1.0
# against round to nearest's 0.00092; uniform NVFP4's is 0.00722 / 0.00815 / 0.00825 (RTN 0.00968).
# These are the bases: where a matrix's Gram matrix sums few rows per input, ``gptq.damping`` raises them
# (the caller passes the rows to ``quantize``).
DAMP = 0.01
DAMP_FP8 = 1.0
NVFP4_RATIOS = (1.0, 1.1, 1.05, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # 1.0 first: ties keep round to nearest's scale
# FP8-block keeps each block's amax scale (no search): a 128 x 128 block's clipped outliers cost more on
# held-out tokens than the calibration rows show. Uniform FP8-block weight-only, awq_gptq, held-out KL
# through the unified loader: trained Mixtral 0.00112 with ratios (1.0, 0.95, 0.9, 0.85), 0.00033 without,
# round to nearest 0.00045; trained Qwen3-MoE 0.00029 / 0.00023 / 0.00029.
FP8_BLOCK_RATIOS = (1.0,)
MXFP4_EXPONENT_STEPS = (0, -1)


def applies(fmt: QuantFormat) -> bool:
    """Whether ``fmt`` is one of the float formats this module rounds."""
    return fmt.fp_rounding is not None


def inverse_factor(h: Tensor, damp: float = DAMP) -> Tensor:
    """Upper Cholesky factor ``U`` of ``(H + λI)⁻¹`` (``λ = damp · mean diag H``; inputs never seen get
    diagonal 1), float32, columns in their natural order; more dampening where ``H`` is numerically not
    positive definite."""
    hd = h.double().clone()
    idx = torch.arange(hd.shape[0])
    dead = torch.diagonal(hd) <= 0
    hd[idx[dead], idx[dead]] = 1.0
    mean = float(torch.diagonal(hd).mean())
    extra = damp
    for _ in range(8):
        lo, info = torch.linalg.cholesky_ex(hd + extra * mean * torch.eye(hd.shape[0], dtype=hd.dtype))
        if int(info) == 0:
            up, info2 = torch.linalg.cholesky_ex(torch.cholesky_inverse(lo), upper=True)
            if int(info2) == 0:
                return up.float()
        extra = max(extra, 0.01) * 10
    raise torch.linalg.LinAlgError("input Gram matrix is not positive definite even with dampening")


# ---- per-format rules: candidate scales of a block, and rounding onto the grid ----------------------

class _Rule:
    """How one format's block of columns is scaled and rounded. ``width``: columns per scale block;
    ``rows``: rows sharing a scale (1: a scale per row)."""

    width = 16
    rows = 1
    damp = DAMP

    def candidates(self, wb: Tensor, search: bool) -> tuple[Tensor, Tensor]:
        """(scales [C, out] float32 that the block's codes are rounded against, the stored form of each
        [C, out]) for the block ``wb`` [out, width] as it stands."""
        raise NotImplementedError

    def round(self, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        """(dequantized float32, uint8 code) of the values ``x`` [C, out] under the scales ``s`` [C, out]."""
        raise NotImplementedError

    def scales(self, a: int, wb: Tensor, search: bool) -> tuple[Tensor, Tensor]:
        """The candidates for the block of columns starting at ``a``."""
        return self.candidates(wb, search)


class _NVFP4(_Rule):
    def __init__(self, gs: Tensor):
        self.gs, self.width = gs.float(), 16

    def candidates(self, wb, search):
        amax = wb.abs().amax(-1)
        ratios = NVFP4_RATIOS if search else (1.0,)
        bs = torch.stack([_nvfp4_block_scales(amax * r if r != 1.0 else amax, self.gs) for r in ratios])
        return bs * self.gs, bs

    def round(self, x, s):
        c = e2m1_codes(x / s)
        return e2m1_values(c) * s, c


class _MXFP4(_Rule):
    width = 32

    def candidates(self, wb, search):
        e = e8m0_exponents(wb.abs().amax(-1))
        steps = MXFP4_EXPONENT_STEPS if search else (0,)
        es = torch.stack([(e + k).clamp(-127.0, 127.0) for k in steps])
        return torch.exp2(es), es

    def round(self, x, s):
        c = e2m1_codes(x / s, ties="down")
        return e2m1_values(c) * s, c


class _FP8Tensor(_Rule):
    width = 128
    damp = DAMP_FP8

    def __init__(self, scale: Tensor, dtype: torch.dtype):
        self.scale, self.dtype = scale.float(), dtype

    def candidates(self, wb, search):
        s = self.scale.expand(1, wb.shape[0]).contiguous()
        return s, s

    def round(self, x, s):
        # As FP8Format.quantize: the quotient is rounded to the model dtype before E4M3.
        q = (x / s).to(self.dtype).float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q.float() * s, q.view(torch.uint8)


class _FP8Block(_Rule):
    damp = DAMP_FP8

    def __init__(self, block: int, fixed: Tensor | None):
        self.width = self.rows = block
        self.fixed = fixed  # a single-block matrix's scale from its fused group's amax

    def candidates(self, wb, search):
        out_f, bo = wb.shape[0], self.rows
        if self.fixed is not None:
            s = self.fixed.float().expand(1, out_f).contiguous()
            return s, s
        a = wb.abs().amax(-1)
        pad = -out_f % bo
        g = torch.nn.functional.pad(a, (0, pad)).reshape(-1, bo).amax(-1)  # [G]
        ratios = FP8_BLOCK_RATIOS if search else (1.0,)
        sg = torch.stack([g * r if r != 1.0 else g for r in ratios]) / E4M3_MAX
        sg = torch.where(sg > 0, sg, torch.ones_like(sg))
        s = sg.repeat_interleave(bo, dim=-1)[:, :out_f].contiguous()
        return s, s

    def round(self, x, s):
        q = (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q.float() * s, q.view(torch.uint8)


class W4A8Rule(_Rule):
    """W4A8-AWQ's weight as the kernel runs it: INT4 codes in [-8, 7] against fixed per-(row, group)
    scales ``scale`` [out, in / width] (the ``weight_scale`` the format gives the recipe's weight, so
    that what is stored is the format's own), dequantized and rounded to E4M3 under the per-matrix
    ``weight_scale_2``. Codes are kept as ``code + 8`` (uint8). Used by ``trtmoe.quant.awq``'s W4A8
    error feedback; ``quantize`` here takes the float formats only."""

    def __init__(self, scale: Tensor, scale_2: Tensor, width: int):
        self.scale, self.s2, self.width = scale.float(), scale_2.float(), width

    def scales(self, a, wb, search):
        s = self.scale[:, a // self.width].unsqueeze(0)  # [1, out]: one candidate, the format's
        return s, s

    def round(self, x, s):
        c = (x / s).round().clamp(-8, 7)
        return e4m3_round(c * s / self.s2) * self.s2, (c + 8).to(torch.uint8)


# ---- the rounding -----------------------------------------------------------------------------------

def round_columns(w: Tensor, h: Tensor, rule: _Rule, *, feedback: bool = True, search: bool = True,
                  factor: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Codes [out, in] (uint8: E2M1 code or E4M3 bits) and each block's chosen stored scale [out, in /
    width] of ``w`` [out, in] (float32) under ``rule``, minimizing ``‖X (W − Ŵ)ᵀ‖²`` (``h`` = XᵀX [in,
    in]) greedily: a block at a time, with error feedback through ``factor`` (``inverse_factor(h,
    rule.damp)``, computed when not given) when ``feedback``, choosing among the rule's candidate scales when
    ``search``."""
    w = w.float().clone()
    out_f, in_f = w.shape
    u = (factor if factor is not None else inverse_factor(h, rule.damp)) if feedback else None
    hf = h.float() if not feedback else None
    codes = torch.zeros(out_f, in_f, dtype=torch.uint8)
    stored = []
    rows = torch.arange(out_f)
    for a in range(0, in_f, rule.width):
        b = min(a + rule.width, in_f)
        wb = w[:, a:b]
        scales, kept = rule.scales(a, wb, search)  # [C, out]
        C = scales.shape[0]
        if feedback:
            ub = u[a:b, a:b]
            w1 = wb.unsqueeze(0).expand(C, out_f, b - a).clone()
            err = torch.zeros_like(w1)
            cod = torch.zeros(C, out_f, b - a, dtype=torch.uint8)
            loss = torch.zeros(C, out_f, dtype=torch.float64)
            for i in range(b - a):
                x = w1[:, :, i]
                deq, c = rule.round(x, scales)
                cod[:, :, i] = c
                e = (x - deq) / ub[i, i]
                loss += e.double().pow(2)
                w1[:, :, i:] -= e.unsqueeze(-1) * ub[i, i:]
                err[:, :, i] = e
        else:
            deq_c = []
            cod = torch.zeros(C, out_f, b - a, dtype=torch.uint8)
            for i in range(b - a):
                deq, c = rule.round(wb[:, i].unsqueeze(0).expand(C, out_f), scales)
                deq_c.append(deq)
                cod[:, :, i] = c
            d = (wb.unsqueeze(0) - torch.stack(deq_c, -1)).double()  # [C, out, width]
            loss = ((d @ hf[a:b, a:b].double()) * d).sum(-1)
        if rule.rows > 1:  # one scale for a block of rows: their losses add up
            pad = -out_f % rule.rows
            g = torch.nn.functional.pad(loss, (0, pad)).reshape(C, -1, rule.rows).sum(-1)
            best = g.argmin(0).repeat_interleave(rule.rows)[:out_f]
        else:
            best = loss.argmin(0)
        codes[:, a:b] = cod[best, rows]
        stored.append(kept[best, rows])
        if feedback and b < in_f:
            w[:, b:] -= err[best, rows] @ u[a:b, b:]
    return codes, torch.stack(stored, -1)


def gram_error(h: Tensor, w: Tensor, deq: Tensor) -> float:
    """``tr((W − Ŵ) H (W − Ŵ)ᵀ)`` = ``‖X (W − Ŵ)ᵀ‖²`` summed over the rows X that ``h`` = XᵀX is made of."""
    d = (w.float() - deq.float())
    return float(((d @ h.float()).double() * d.double()).sum())


def quantize(fmt: QuantFormat, w: Tensor, h: Tensor, *, dtype: torch.dtype, input_amax=None, weight_amax=None,
             feedback: bool = True, search: bool = True, never_worse: bool = True,
             factor: Tensor | None = None, rows: int | None = None) -> dict[str, Tensor]:
    """``fmt.quantize(w, ...)`` (one ``[out, in]`` matrix) with its codes (and, with ``search``, its
    block scales) chosen against the input Gram matrix ``h`` [in, in]: the same tensors, shapes and
    dtypes, global and input scales untouched. ``never_worse``: round to nearest's tensors are returned
    when their Gram-weighted error is not larger. ``factor``: ``inverse_factor(h, damp)`` with the format's
    dampening when already known."""
    if not applies(fmt):
        raise InputError(f"{fmt.name}: activation-aware float rounding applies to FP8, FP8-block, NVFP4 and MXFP4 only")
    if w.dim() != 2:
        raise InputError(f"{fmt.name}: one [out, in] matrix at a time, got shape {tuple(w.shape)}")
    if tuple(h.shape) != (w.shape[-1], w.shape[-1]):
        raise InputError(f"{fmt.name}: Gram matrix {tuple(h.shape)} does not match the weight's {w.shape[-1]} inputs")
    base = fmt.quantize(w, dtype=dtype, input_amax=input_amax, weight_amax=weight_amax)
    wd = w.to(dtype).float()
    kind = fmt.fp_rounding
    if kind == "nvfp4":
        rule: _Rule = _NVFP4(base["weight_scale_2"])
    elif kind == "mxfp4":
        rule = _MXFP4()
    elif kind == "fp8":
        rule = _FP8Tensor(base["weight_scale"], dtype)
    else:
        single = base["weight_scale"].numel() == 1 and weight_amax is not None
        rule = _FP8Block(fmt.block, base["weight_scale"].reshape(()) if single else None)
    if factor is None and feedback and rows is not None:  # the format's dampening, scaled to the rows
        factor = inverse_factor(h, gptq.damping(rule.damp, h.shape[-1], rows))
    codes, kept = round_columns(wd, h, rule, feedback=feedback, search=search, factor=factor)
    out = dict(base)
    if kind == "nvfp4":
        out["weight"] = pack_nibbles(codes)
        out["weight_scale"] = kept.to(torch.float8_e4m3fn).contiguous()
    elif kind == "mxfp4":
        out["weight"] = pack_nibbles(codes)
        out["weight_scale"] = (kept + 127).to(torch.uint8).contiguous()
    elif kind == "fp8":
        out["weight"] = codes.view(torch.float8_e4m3fn).contiguous()
    else:
        bo = fmt.block
        grid = kept[::bo].contiguous()  # [ceil(out / 128), ceil(in / 128)]: one value per block
        out["weight"] = codes.view(torch.float8_e4m3fn).contiguous()
        out["weight_scale"] = grid.reshape(base["weight_scale"].shape).to(base["weight_scale"].dtype).contiguous()
    if never_worse:
        e_new = gram_error(h, wd, fmt.dequantize(out, dtype=torch.float32))
        e_rtn = gram_error(h, wd, fmt.dequantize(base, dtype=torch.float32))
        if not e_new < e_rtn:
            return base
    return out


def stats_gram(gram: Tensor | None, rows: Callable[[], Tensor], in_features: int, min_rows_per_input: int
               ) -> Tensor | None:
    """The Gram matrix to round against: ``gram`` when there is one, else ``XᵀX`` of the sampled rows
    when there are at least ``min_rows_per_input`` per input (fewer fit the sample's noise); None
    otherwise (round to nearest)."""
    if gram is not None:
        return gram
    x = rows()
    if x.shape[0] < min_rows_per_input * in_features:
        return None
    xd = x.double()
    return (xd.t() @ xd).float()
