"""transformers 5's experts seam: what an ``*Experts`` module holds, read the same way everywhere."""

from __future__ import annotations

import torch


def expert_input_weight(mod: torch.nn.Module) -> tuple[torch.Tensor | None, bool]:
    """An experts module's 3-D input projection at the seam and whether it is gated: ``gate_up_proj``
    (gated), else ``up_proj`` (experts without a gate, Nemotron-H: act(x @ up) @ down); (None, False)
    when the module has neither as a 3-D tensor."""
    gu = getattr(mod, "gate_up_proj", None)
    if isinstance(gu, torch.Tensor) and gu.dim() == 3:
        return gu, True
    up = getattr(mod, "up_proj", None)
    return (up, False) if isinstance(up, torch.Tensor) and up.dim() == 3 else (None, False)
