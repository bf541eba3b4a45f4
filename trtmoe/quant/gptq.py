"""Error-feedback rounding of INT4 codes (``--rounding gptq`` and ``awq_gptq``).

Round-to-nearest picks each code on its own. Here the codes of one matrix are chosen a column at a
time, and the output error each column's rounding leaves on the calibration inputs is pushed onto the
columns not yet rounded, through the inverse of the input Gram matrix ``H = Xᵀ X`` (X: the routed
tokens' inputs of that expert matrix, as the kernel sees them). This is the optimal-brain-surgeon
update GPTQ uses; columns are visited in decreasing ``diag(H)`` (the most active input channels first).

Only the codes change. The scales are fixed before the first column is rounded, to exactly what the
format computes from the (optionally pre-scaled and clipped) weight — amax / 7 per (row, group) for the
group formats, amax / 8 per row for per-channel INT4 — so ``weights_scaling_factor`` /
``per_channel_scale``, the packed byte layout and TensorRT-LLM's dequantization (code × scale in the
model dtype) are those of round-to-nearest. Codes may use the whole signed range [-8, 7].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

DAMP = 0.01  # relative dampening of diag(H): λ = DAMP · mean(diag H)
BLOCK = 128  # columns per lazy-update block


def gram(x: Tensor) -> Tensor:
    """``Xᵀ X`` (float32, accumulated in float64) of the rows ``x`` [n, in]."""
    xd = x.double()
    return (xd.t() @ xd).float()


def gram_chunked(x: Tensor, rows: int, transform=None) -> Tensor:
    """``gram(transform(x))`` accumulated ``rows`` rows of ``x`` at a time in float64 (``transform``
    maps rows to rows, e.g. an expert's hidden states to its proj inputs; None: the rows themselves), so
    neither the transformed rows nor a float64 copy exist for more than ``rows`` rows at once. With
    ``x`` no longer than ``rows`` exactly ``gram(transform(x))``."""
    f = transform or (lambda t: t)
    if x.shape[0] <= rows:
        return gram(f(x))
    acc = None
    for part in x.split(rows):
        xd = f(part).double()
        if acc is None:
            acc = torch.zeros(xd.shape[-1], xd.shape[-1], dtype=torch.float64, device=xd.device)
        acc.addmm_(xd.t(), xd)
    return acc.float()


@dataclass(frozen=True)
class Factor:
    """What error feedback needs of one Gram matrix, whatever weight it rounds: the column order
    (largest diagonal first), its inverse, and the upper Cholesky factor of the dampened, permuted
    ``h⁻¹``. Candidates of one matrix that share ``h`` share it (``factor``)."""

    perm: Tensor
    inv: Tensor
    hinv: Tensor


# Error feedback fits the codes to the rows the Gram matrix sums; an expert matrix sees only its routed
# tokens, often fewer than it has inputs (Qwen3-30B-A3B: 8 of 128 experts per token, 2,048 inputs, so
# 256 routed rows per expert at 4,096 calibration tokens), where a fixed 1 % dampening lets the codes
# fit those rows' noise. The dampening grows as the rows per input shrink: λ / mean diag(H) =
# max(base, DAMP_PER_INPUT_ROW · inputs / rows), base the format's own (0.01 for the 4-bit formats).
# Uniform int4_g128 under awq_gptq, held-out KL on 64 × 128 windows (64 × 128 calibration windows are
# 16 routed rows per fc input on the trained Mixtral fixture, 8 on the trained Qwen3-MoE fixture):
#
#   calibration   Mixtral: fixed 0.01   scaled 0.5   awq   rtn   |  Qwen3-MoE: fixed 0.01   scaled 0.5   awq   rtn
#   4 × 64                 0.00655      0.00407   0.00442 0.00463 |            0.00376      0.00237   0.00240 0.00263
#   16 × 128               0.00390      0.00280      -    0.00463 |            0.00194      0.00160   0.00212 0.00263
#   64 × 128               0.00271      0.00273      -    0.00463 |
#
# (a factor of 0.25 or 1 instead of 0.5 was within 6 % of it on each row; 2 worse). The float formats'
# error feedback takes the same rule on their own base: NVFP4 0.00660 → 0.00631, MXFP4 0.00361 → 0.00300
# on trained Mixtral at 16 × 128 (scripts/bench_formats.py).
DAMP_PER_INPUT_ROW = 0.5


def damping(base: float, inputs: int, rows: int) -> float:
    """The relative dampening of a Gram matrix over ``rows`` rows of ``inputs`` inputs (``DAMP_PER_INPUT_ROW``)."""
    return max(base, DAMP_PER_INPUT_ROW * inputs / max(rows, 1))


def factor(h: Tensor, damp: float = DAMP) -> Factor:
    """The ``Factor`` of ``h`` = Xᵀ X [in, in]."""
    h = h.float().clone()
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    inv = torch.argsort(perm)
    h = h[perm][:, perm]
    lam = damp * float(torch.diagonal(h).mean())
    idx = torch.arange(h.shape[0], device=h.device)
    h[idx, idx] += lam
    return Factor(perm, inv, _upper_inverse_factor(h))


def codes(w: Tensor, q_scale: Tensor, deq_scale: Tensor, h: Tensor | Factor, dtype: torch.dtype, *,
          damp: float = DAMP, block: int = BLOCK) -> Tensor:
    """int8 codes [out, in] in [-8, 7] of ``w`` [out, in] (float32 holding model-dtype values) under
    per-element scales: ``q_scale`` [out, in] (float32; what codes are rounded against) and
    ``deq_scale`` [out, in] (the stored model-dtype scale: what a code dequantizes with, ``code ×
    scale`` computed in ``dtype``), minimizing ``‖X (W − Ŵ)ᵀ‖²`` greedily with error feedback
    through ``h`` = Xᵀ X [in, in] (or its ``factor``, computed with ``damp``)."""
    f = h if isinstance(h, Factor) else factor(h, damp)
    perm, inv, hinv = f.perm, f.inv, f.hinv
    w = w.float()
    out_f, in_f = w.shape
    # Worked on transposed ([in, out]): each input column of W is a contiguous row, so the per-column
    # steps below read and write contiguous memory (2.0× faster at 1536 × 2048, the same codes).
    wt = w[:, perm].t().contiguous()
    q_scale, deq_scale = q_scale.float()[:, perm].t().contiguous(), deq_scale.to(dtype)[:, perm].t().contiguous()
    # The codes are kept as float32 integers and converted once at the end; each column's steps write
    # into preallocated rows (the loop is bound by per-operation overhead at these widths, not by
    # arithmetic). Element by element the same float operations as a plain ``(col / s).round()...``.
    qf = torch.empty(in_f, out_f, device=w.device)
    upd = torch.empty(block, out_f, device=w.device)
    for a in range(0, in_f, block):
        b = min(a + block, in_f)
        w1 = wt[a:b].clone()
        err1 = torch.empty_like(w1)
        hb = hinv[a:b, a:b]
        hcol = hb.unsqueeze(2)  # hcol[i, j:] = hb[i, j:] as a column
        diag = torch.diagonal(hb).tolist()  # float32 values: dividing by them is dividing by hb[i, i]
        for i in range(b - a):
            col = w1[i]
            c = torch.div(col, q_scale[a + i], out=qf[a + i]).round_().clamp_(-8, 7)
            deq = (c.to(dtype) * deq_scale[a + i]).float()
            e = torch.sub(col, deq, out=err1[i]).div_(diag[i])
            if i + 1 < b - a:  # row i itself is not read again
                w1[i + 1:].sub_(torch.mul(hcol[i, i + 1:], e, out=upd[:b - a - i - 1]))
        if b < in_f:
            wt[b:] -= hinv[a:b, b:].t() @ err1
    return qf.to(torch.int8).t()[:, inv].contiguous()


def _upper_inverse_factor(h: Tensor) -> Tensor:
    """Upper Cholesky factor ``U`` of ``h⁻¹`` (``h⁻¹ = Uᵀ U``), float32, with more dampening when ``h``
    is numerically not positive definite. With ``J`` the reversal of the index order and
    ``J h J = L Lᵀ`` (Cholesky), ``h⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J)`` and ``J L⁻¹ J`` is upper triangular with
    a positive diagonal: one Cholesky factorization and one triangular inverse instead of a
    factorization, an inverse and a second factorization. float32 suffices: ``h`` carries a dampening
    of ``DAMP`` × its mean diagonal (measured against float64 on 40-4,096 rows of 768-2,048 uneven
    inputs: the factor within 1e-3 relative, the codes' error on the Gram matrix within 0.3 %)."""
    hf = h.float()
    n = hf.shape[0]
    eye = torch.eye(n, dtype=hf.dtype, device=hf.device)
    mean = float(torch.diagonal(hf).mean())
    extra = 0.0
    for _ in range(6):
        hh = hf if extra == 0.0 else hf + (extra * mean) * eye
        lo, info = torch.linalg.cholesky_ex(hh.flip(0, 1))
        if int(info) == 0:
            up = torch.linalg.solve_triangular(lo, eye, upper=False).flip(0, 1)
            if bool(torch.isfinite(up).all()):
                return up
        extra = 0.1 if extra == 0.0 else extra * 10
    raise torch.linalg.LinAlgError("input Gram matrix is not positive definite even with dampening")
