"""Weights held in the checkpoint's dtype, multiplied by activations of a wider one.

An engine that computes in float32 on CPU would otherwise hold every 16-bit weight converted to
float32 (and its dense weights once more, packed for oneDNN: ``trtmoe.matmul``), about twice to three
times the checkpoint's bytes. Held as stored, a product converts its weight a block of rows at a time
(``BLOCK_ELEMS`` elements, a few MiB of float32 that stay in cache) and multiplies the block: the
values are the float32 weight's exactly (a 16-bit float widens without rounding), so the outputs are
those of the float32 product, up to the last bits in which two GEMM blockings may differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Weight elements converted per block: 1M (4 MiB of float32).
BLOCK_ELEMS = 1 << 20


class Upcast:
    """A weight ``w`` [out, in] kept in its own dtype: ``self(x)`` is ``x @ w.T`` in ``x``'s dtype.
    ``packed`` is None (the ``trtmoe.matmul.Dense`` interface: nothing is held twice)."""

    __slots__ = ("w", "packed", "_rows")

    def __init__(self, w: torch.Tensor):
        self.w = w
        self.packed = None
        self._rows = max(1, BLOCK_ELEMS // max(1, w.shape[-1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        if x.dtype == w.dtype:
            return F.linear(x, w)
        n = w.shape[0]
        if n <= self._rows:
            return F.linear(x, w.to(x.dtype))
        return torch.cat([F.linear(x, w[a:a + self._rows].to(x.dtype)) for a in range(0, n, self._rows)], -1)


def upcast_mm(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] @ ``w_t`` [K, N] (a routed expert's transposed weight, held in a narrower dtype),
    into ``out`` when given, converting ``w_t`` a block of columns at a time."""
    K, N = w_t.shape
    cols = max(1, BLOCK_ELEMS // max(1, K))
    if cols >= N:
        return torch.mm(x, w_t.to(x.dtype)) if out is None else torch.mm(x, w_t.to(x.dtype), out=out)
    if out is None:
        return torch.cat([torch.mm(x, w_t[:, a:a + cols].to(x.dtype)) for a in range(0, N, cols)], -1)
    for a in range(0, N, cols):
        out[:, a:a + cols] = torch.mm(x, w_t[:, a:a + cols].to(x.dtype))
    return out
