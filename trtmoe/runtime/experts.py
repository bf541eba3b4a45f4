"""Routed-expert weights as the engine holds them: one bank per MoE layer.

A bank computes ``expert_e(x) = proj_e(silu(gate_e x) * up_e x)`` for a block of tokens. Float
banks hold the reassembled [up; gate] / down matrices. Quantized banks hold each rank shard's packed
bytes and run from them through the format's own ``linear`` (see ``trtmoe.quant``): with moe_tp > 1
the expert output is the sum over its shards, exactly as the ranks would compute it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ExpertBank:
    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def format_of(self, e: int) -> str:  # pragma: no cover - interface
        raise NotImplementedError


class FloatExperts(ExpertBank):
    """fc [E, 2I, H] = per expert [up; gate]; proj [E, H, I]."""

    def __init__(self, fc: torch.Tensor, proj: torch.Tensor, fmt: str):
        self.fc, self.proj, self.fmt = fc, proj, fmt

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.fc[e].t()
        up, gate = h.chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.proj[e].t()

    def format_of(self, e: int) -> str:
        return self.fmt


def _float_fc_proj(files, cfg, pre: str, pp_rank: int):
    """Reassemble full per-expert fc/proj from the EP/TP rank shards."""
    mp = cfg.mapping
    E_loc = cfg.num_experts // mp.moe_ep_size
    fcs, projs = [], []
    for ep in range(mp.moe_ep_size):
        ups, gates, downs = [], [], []
        for t in range(mp.moe_tp_size):
            r = mp.tp_rank_for(t, ep)
            fc = files.get(pre + "mlp.fc.weight", r, pp_rank)  # [E_loc, 2 I_loc, H]
            half = fc.shape[1] // 2
            ups.append(fc[:, :half])
            gates.append(fc[:, half:])
            downs.append(files.get(pre + "mlp.proj.weight", r, pp_rank))  # [E_loc, H, I_loc]
        fcs.append(torch.cat([torch.cat(ups, 1), torch.cat(gates, 1)], 1))
        projs.append(torch.cat(downs, 2))
        assert fcs[-1].shape[0] == E_loc
    return torch.cat(fcs), torch.cat(projs)


def load_expert_bank(files, cfg, layer: int, pre: str, pp_rank: int, device) -> ExpertBank:
    fc, proj = _float_fc_proj(files, cfg, pre, pp_rank)
    return FloatExperts(fc.to(device), proj.to(device), str(cfg.dtype).replace("torch.", ""))
