"""``trtmoe inspect``: what a model costs and activates, and what a layout puts on each rank."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..checkpoint.layout import DTYPE_STR, rank_specs
from ..errors import LayoutError
from ..hf.reader import HFCheckpoint, parse_dtype
from ..model.params import count_params
from ..parallel.mapping import Mapping


def inspect_model(model: str, *, tp: int = 1, pp: int = 1, moe_tp: int | None = None, moe_ep: int | None = None,
                  dtype: str = "auto") -> dict:
    """Parameter accounting and per-rank weight bytes; layout problems are reported, not raised."""
    with HFCheckpoint(model) as src:
        m = src.model
        pc = count_params(m)
        tdtype = parse_dtype(m.source_dtype if dtype == "auto" and m.source_dtype in DTYPE_STR.values()
                             else ("float32" if dtype == "auto" else dtype))
        report = {
            "model": str(src.path), "architecture": m.hf_architecture, "family": m.family,
            "config": {k: v for k, v in m.to_dict().items() if k not in ("extra", "moe_layers")},
            "moe_layers": [l for l, x in enumerate(m.moe_layers) if x],
            "dense_layers": [l for l, x in enumerate(m.moe_layers) if not x],
            "parameters": {"total": pc.total, "active_per_token": pc.active, "active_share": pc.active_share,
                           "components": {k: {"total": t, "active_per_token": a} for k, (t, a) in
                                          pc.components.items()}},
            "source_bytes": src.total_bytes(),
            "dtype": DTYPE_STR[tdtype],
        }
        problems: list[str] = []
        try:
            mapping = Mapping.create(tp, pp, moe_tp, moe_ep)
            mapping.validate(m)
        except LayoutError as e:
            problems.append(e.render())
            mapping = None
        report["layout"] = {"tp": tp, "pp": pp, "moe_tp": moe_tp, "moe_ep": moe_ep, "ok": not problems,
                            "problems": problems}
        if mapping is not None:
            report["layout"].update(moe_tp=mapping.moe_tp_size, moe_ep=mapping.moe_ep_size,
                                    world_size=mapping.world_size)
            ranks = []
            for r in mapping.ranks():
                by_role: dict[str, int] = defaultdict(int)
                for s in rank_specs(m, mapping, r, tdtype):
                    by_role[s.role] += s.nbytes
                ranks.append({"rank": r, "tp_rank": mapping.tp_rank(r), "pp_rank": mapping.pp_rank(r),
                              "moe_ep_rank": mapping.moe_ep_rank(r), "moe_tp_rank": mapping.moe_tp_rank(r),
                              "experts": [mapping.ep_experts(m.num_experts, r).start,
                                          mapping.ep_experts(m.num_experts, r).stop - 1],
                              "layers": mapping.pp_layers(m.num_layers, mapping.pp_rank(r)),
                              "bytes": sum(by_role.values()), "bytes_by_role": dict(sorted(by_role.items()))})
            report["ranks"] = ranks
        report["notes"] = _notes(m, torch.finfo(tdtype).bits)
        return report


def _notes(m, bits: int) -> list[str]:
    notes = []
    if not all(m.moe_layers) and m.family in ("qwen2_moe", "qwen3_moe"):
        notes.append("dense layers (mlp_only_layers/decoder_sparse_step) run on the embedded engine; "
                     "TensorRT-LLM 1.2's QWen model treats every layer as MoE")
    if m.family == "deepseek_v1" and list(m.moe_layers) != [l > 0 for l in range(m.num_layers)]:
        notes.append("TensorRT-LLM's DeepSeek-V1 model hard-codes layer 0 as the only dense layer")
    return notes
