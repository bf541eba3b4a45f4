"""Routed-expert weights as the engine holds them: one bank per MoE layer.

A bank computes ``expert_e(x) = proj_e(silu(gate_e x) * up_e x)`` for a block of tokens. Float
banks hold the reassembled [up; gate] / down matrices. Quantized banks hold each rank shard's packed
bytes, fc and proj each in its own format, and run from them through that format's own ``linear``
(see ``trtmoe.quant``): with moe_tp > 1 the expert output is the sum over its shards, exactly as the
ranks would compute it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..checkpoint.layout import packed_at_conversion
from ..errors import CheckpointError
from ..hf.adapters import expert_rules
from ..quant.plan import FLOAT, format_obj
from .checkpoint_reader import unshard


class ExpertBank:
    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def forward_grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every expert over its own block of rows: ``x`` [M, H] holds expert 0's ``counts[0]`` rows,
        then expert 1's, and so on; returns the [M, H] outputs in the same order. Experts with no
        rows cost nothing."""
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                ys.append(self.forward(e, x[start:start + n]))
                start += n
        if not ys:
            return x.clone()
        return ys[0] if len(ys) == 1 else torch.cat(ys)

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
    """Reassemble full per-expert fc/proj from the EP/TP rank shards (the registry's expert rules in
    reverse: EP blocks stacked, moe_tp shards joined role by role)."""
    mp = cfg.mapping
    out = []
    for rule in expert_rules().values():
        name, axis = pre + rule.name, rule.axis + 1  # dim 0 stacks the experts
        blocks = [unshard([files.get(name, mp.tp_rank_for(t, ep), pp_rank) for t in range(mp.moe_tp_size)],
                          len(rule.roles), axis) for ep in range(mp.moe_ep_size)]
        out.append(blocks[0] if len(blocks) == 1 else torch.cat(blocks))
    return tuple(out)


class PackedShard(NamedTuple):
    """One moe_tp shard of an expert: each matrix with its own format and packed tensors."""

    fc_fmt: object  # trtmoe.quant.formats.QuantFormat
    fc: dict[str, torch.Tensor]
    proj_fmt: object
    proj: dict[str, torch.Tensor]


class PackedExperts(ExpertBank):
    """Per expert: a list of moe_tp shards (``PackedShard``), fc and proj each in its own format.
    Runs from the packed bytes through each format's own ``linear``."""

    def __init__(self, shards: list[list[PackedShard]], fc_names: list[str], proj_names: list[str] | None = None):
        self.shards, self.fc_names = shards, fc_names
        self.proj_names = list(fc_names) if proj_names is None else proj_names

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        y = None
        for sh in self.shards[e]:
            h = sh.fc_fmt.linear(x, sh.fc)
            up, gate = h.chunk(2, dim=-1)
            part = sh.proj_fmt.linear(F.silu(gate) * up, sh.proj)
            y = part if y is None else y + part
        return y

    def formats_of(self, e: int) -> tuple[str, str]:
        """(fc format, proj format) of expert slot ``e``."""
        return self.fc_names[e], self.proj_names[e]

    def format_of(self, e: int) -> str:
        fc, proj = self.formats_of(e)
        return fc if fc == proj else f"fc:{fc},proj:{proj}"


def slot_formats(cfg, layer: int) -> tuple[str, list[str], list[str]]:
    """(granularity, fc format per expert slot, proj format per slot) as recorded by the writer.

    Layers without a recorded format are float: stacked for ``layer`` granularity (and for
    checkpoints without quantization), one tensor set per expert for ``expert`` / ``matrix``."""
    q = (cfg.raw.get("trtmoe") or {}).get("quantization") or {}
    gran = q.get("granularity", "layer")
    floats = ["float"] * cfg.num_experts
    if gran == "matrix":
        mf = q.get("matrix_formats") or {}
        fc, proj = ((mf.get(mod) or {}).get(str(layer)) for mod in ("fc", "proj"))
        if (fc is None) != (proj is None):
            raise CheckpointError(f"config.json records matrix formats of layer {layer} for "
                                  f"{'fc' if fc is not None else 'proj'} only")
        return gran, fc or floats, proj or floats
    if gran not in ("expert", "layer"):
        raise CheckpointError(f"config.json records an unknown quantization granularity {gran!r}",
                              hint="this checkpoint was written by a newer trtmoe")
    fs = (q.get("expert_formats") or {}).get(str(layer))
    if fs is None:
        return gran, floats, list(floats)
    return gran, fs, list(fs)


def load_expert_bank(files, cfg, layer: int, pre: str, pp_rank: int, device,
                     compute_dtype: torch.dtype | None = None) -> ExpertBank:
    gran, fc_names, proj_names = slot_formats(cfg, layer)
    dt = cfg.dtype
    if gran == "layer" and fc_names[0] == FLOAT:
        fc, proj = _float_fc_proj(files, cfg, pre, pp_rank)
        cdt = compute_dtype or dt
        return FloatExperts(fc.to(device, cdt), proj.to(device, cdt), str(dt).replace("torch.", ""))
    mp = cfg.mapping
    E_loc = cfg.num_experts // mp.moe_ep_size
    shards: list[list[PackedShard]] = [[] for _ in range(cfg.num_experts)]
    mv = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    for ep in range(mp.moe_ep_size):
        for t in range(mp.moe_tp_size):
            r = mp.tp_rank_for(t, ep)
            f = files.file(mp.rank(r, pp_rank))
            for i in range(E_loc):
                slot = ep * E_loc + i
                fmts = {"fc": format_obj(fc_names[slot], dt), "proj": format_obj(proj_names[slot], dt)}
                if gran in ("expert", "matrix"):
                    parts = {}
                    for mod in ("fc", "proj"):
                        prefix = f"{pre}mlp.experts.{slot}.{mod}."
                        parts[mod] = {n[len(prefix):]: f.read(n) for n in f.tensors if n.startswith(prefix)}
                elif packed_at_conversion(fc_names[slot]):
                    parts = {}
                    for mod in ("fc", "proj"):
                        prefix = f"{pre}mlp.{mod}."
                        stack = {n[len(prefix):]: f.read(n) for n in f.tensors if n.startswith(prefix)}
                        parts[mod] = fmts[mod].expert(stack, i)
                else:
                    # Float weights with a weight-only quant_algo: quantize each rank shard as
                    # trtllm-build would, then run from the packed bytes.
                    fc = f.read(f"{pre}mlp.fc.weight")[i]
                    proj = f.read(f"{pre}mlp.proj.weight")[i]
                    parts = {"fc": fmts["fc"].quantize(fc, dtype=dt), "proj": fmts["proj"].quantize(proj, dtype=dt)}
                shards[slot].append(PackedShard(fmts["fc"], mv(parts["fc"]), fmts["proj"], mv(parts["proj"])))
    return PackedExperts(shards, list(fc_names), list(proj_names))
