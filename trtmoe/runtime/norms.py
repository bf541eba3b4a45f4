"""The decoder's norms: RMSNorm (a CPU fast path with the same arithmetic as ``F.rms_norm``) and
LayerNorm with bias, as the architecture says."""

from __future__ import annotations

import torch
import torch.nn.functional as F


_RMS_CONSTS: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    if dt == torch.float32 and w.dtype == torch.float32:
        if x.device.type != "cpu" or x.requires_grad:  # one fused op, the same arithmetic
            return F.rms_norm(x, w.shape, w, eps)
        # On CPU F.rms_norm runs these steps (x², its mean as sum / n, + eps, rsqrt, the two
        # products) plus two copies, one dispatch each: the same ops here give bit-identical
        # results in less time (0-d tensor constants: a Python scalar operand costs a wrapper).
        n = x.shape[-1]
        k = _RMS_CONSTS.get((n, eps))
        if k is None:
            k = _RMS_CONSTS[(n, eps)] = (torch.tensor(float(n)), torch.tensor(eps))
        return (x * (x * x).sum(-1, keepdim=True).div_(k[0]).add_(k[1]).rsqrt_()).mul_(w)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kind: str, eps: float) -> torch.Tensor:
    """``kind`` "layer": LayerNorm with weight ``w`` and bias ``b``; otherwise RMSNorm."""
    if kind == "layer":
        return F.layer_norm(x, w.shape, w, b, eps)
    return rms_norm(x, w, eps)
