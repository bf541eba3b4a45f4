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


def upcast_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., in] @ ``w`` [out, in] ``.T`` in ``x``'s dtype, ``w`` converted a block of rows at a
    time; into ``out`` [M, out] when given (``x`` then 2-D)."""
    rows = max(1, BLOCK_ELEMS // max(1, w.shape[-1]))
    n = w.shape[0]
    if n <= rows:
        y = F.linear(x, w.to(x.dtype))
        return y if out is None else out.copy_(y)
    if out is None:
        return torch.cat([F.linear(x, w[a:a + rows].to(x.dtype)) for a in range(0, n, rows)], -1)
    for a in range(0, n, rows):
        out[:, a:a + rows] = F.linear(x, w[a:a + rows].to(x.dtype))
    return out


class Upcast:
    """A weight ``w`` [out, in] kept in its own dtype: ``self(x)`` is ``x @ w.T`` in ``x``'s dtype.
    ``packed`` is None (the ``trtmoe.matmul.Dense`` interface: nothing is held twice)."""

    __slots__ = ("w", "packed")

    def __init__(self, w: torch.Tensor):
        self.w = w
        self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w) if x.dtype == self.w.dtype else upcast_linear(x, self.w)
