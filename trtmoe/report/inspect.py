"""``trtmoe inspect``: what a model costs and activates, and what a layout puts on each rank.

It needs only ``config.json``: a directory holding nothing else (or a hub id whose config alone is in
the local cache) is planned from the config, before anyone downloads the weights."""

from __future__ import annotations

from collections import defaultdict

from .. import DEFAULT_TRTLLM_VERSION
from ..checkpoint import support
from ..checkpoint import unified_support as unified
from ..checkpoint.layout import DTYPE_STR, packed_at_conversion, rank_specs
from ..errors import CheckpointError, LayoutError
from ..hf.adapters import describe
from ..hf.reader import HFCheckpoint, parse_dtype, read_json, resolve_model_path
from ..hf.validate import validate_hf_config
from ..model.params import count_params
from ..parallel.mapping import Mapping
from ..quant.plan import FLOAT, expert_shape_problem
from ..quant.policies import expert_cost_bits
from ..targets import TARGETS
from .inspect_hf import describe_transformers_moe, layout_problem, outside_registry

EXPERT_ROLES = ("expert_fc", "expert_proj")


def _has_weights(path) -> bool:
    return any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists() or \
        any(p.suffix in (".bin", ".pt", ".pth", ".ckpt") for p in path.iterdir())


def _describe(model: str):
    """(path, model description, source bytes or None): from the weights when present, else config.json."""
    path = resolve_model_path(model, config_only=True)
    if _has_weights(path):
        with HFCheckpoint(path) as src:
            return src.path, src.model, src.total_bytes()
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError("no config.json", where=str(path))
    _, m = describe(validate_hf_config(read_json(cfg_path), cfg_path))
    return path, m, None


def unified_report(family: str, fmt: str | None, target: str | None, sm: int, engine: str | None = None) -> dict:
    """What the unified-HF support table says about an architecture: per engine release, the formats it
    takes on SM ``sm``; with a unified-HF ``target``, the cell of ``fmt`` (routed experts, uniform) there,
    a refusal naming the cell and what works (``support``, as the TensorRT-LLM engine-path check reports)."""
    out: dict = {"sm": sm, "engines": {e: unified.what_works(e, family, sm) for e in unified.ENGINES}}
    t = TARGETS.get(target)
    sup = t.support_report(family=family, fmt=fmt, sm=sm, engine=engine) if t is not None and t.unified else None
    if sup is not None:
        out["support"] = sup
    return out


def inspect_model(model: str, *, tp: int = 1, pp: int = 1, moe_tp: int | None = None, moe_ep: int | None = None,
                  dtype: str = "auto", fmt: str | None = None, target: str | None = None,
                  trtllm_version: str = "1.2", sm: int = 90, engine: str | None = None) -> dict:
    """Parameter accounting and per-rank weight bytes (routed experts in ``fmt`` when given: what the
    engine holds); with a ``target`` (a name of ``trtmoe.targets``) that target's support cell: for
    ``tensorrt-llm`` the support table's cell of that layout and format, for a unified-HF target
    (``trtllm-pytorch``, ``vllm``, ``sglang``) the unified support table's cell on SM ``sm`` (release
    ``engine``). Every report lists the unified-HF formats each engine takes.
    Layout and cell problems are reported, not raised."""
    if outside_registry(resolve_model_path(model, config_only=True)):
        return _inspect_transformers_moe(model, tp, pp, moe_tp, moe_ep, fmt, target, sm, engine)
    path, m, source_bytes = _describe(model)
    pc = count_params(m)
    tdtype = parse_dtype(m.source_dtype if dtype == "auto" and m.source_dtype in DTYPE_STR.values()
                         else ("float32" if dtype == "auto" else dtype))
    fmt = None if fmt in (None, FLOAT, "fp16", "bf16", "fp32") else fmt
    report = {
        "model": str(path), "architecture": m.hf_architecture, "family": m.family,
        "weights_present": source_bytes is not None,
        "config": {k: v for k, v in m.to_dict().items() if k not in ("extra", "moe_layers")},
        "moe_layers": [l for l, x in enumerate(m.moe_layers) if x],
        "dense_layers": [l for l, x in enumerate(m.moe_layers) if not x],
        "parameters": {"total": pc.total, "active_per_token": pc.active, "active_share": pc.active_share,
                       "activated": pc.activated,
                       "components": {k: {"total": t, "active_per_token": a} for k, (t, a) in
                                      pc.components.items()}},
        "source_bytes": source_bytes,
        "dtype": DTYPE_STR[tdtype],
        "expert_format": fmt or "float",
    }
    problems: list[str] = []
    try:
        mapping = Mapping.create(tp, pp, moe_tp, moe_ep)
        mapping.validate(m)
    except LayoutError as e:
        problems.append(e.render())
        mapping = None
    if mapping is not None and fmt is not None:
        I = m.expert_intermediate_size
        why = expert_shape_problem(fmt, m.hidden_size, mapping.expert_ffn_per_rank(I))
        if why and mapping.moe_tp_size > 1 and not expert_shape_problem(fmt, m.hidden_size, I):
            # The split made the shape: say so, and which moe_tp keep it whole enough.
            ok = [t for t in range(1, mapping.tp_size + 1) if mapping.tp_size % t == 0 and I % t == 0
                  and not expert_shape_problem(fmt, m.hidden_size, I // t)]
            why += (f" (caused by moe_tp={mapping.moe_tp_size}: the expert FFN {I} is {mapping.expert_ffn_per_rank(I)} "
                    f"per rank; moe_tp that fit {fmt}: {', '.join(map(str, ok))})")
        if why:
            problems.append(why)
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
            layers = mapping.pp_layers(m.num_layers, mapping.pp_rank(r))
            ep = mapping.ep_experts(m.num_experts, r)
            stored = sum(by_role.values())  # float experts: what the checkpoint file holds
            if fmt is not None and not problems:
                # The routed experts as the engine holds them: the format's packed bytes and scales.
                n_moe = sum(1 for l in layers if m.moe_layers[l])
                i_loc = mapping.expert_ffn_per_rank(m.expert_intermediate_size)
                for role in EXPERT_ROLES:
                    by_role.pop(role, None)
                by_role["experts"] = n_moe * expert_cost_bits(fmt, i_loc, m.hidden_size, tdtype,
                                                              ep.stop - ep.start) // 8
                if packed_at_conversion(fmt):
                    stored = sum(by_role.values())
            ranks.append({"rank": r, "tp_rank": mapping.tp_rank(r), "pp_rank": mapping.pp_rank(r),
                          "moe_ep_rank": mapping.moe_ep_rank(r), "moe_tp_rank": mapping.moe_tp_rank(r),
                          "experts": [ep.start, ep.stop - 1], "layers": layers,
                          "bytes": sum(by_role.values()), "bytes_by_role": dict(sorted(by_role.items())),
                          "checkpoint_bytes": stored})
        report["ranks"] = ranks
        # Weight-only per-channel formats (int8, int4) stay float in the checkpoint's layer layout: the
        # engine builder quantizes them. ``bytes`` is what the engine holds, ``checkpoint_bytes`` the file.
        report["bytes_meaning"] = {"bytes": "engine (routed experts in the format)",
                                   "checkpoint_bytes": "checkpoint rank file (layer layout)"}
    t = TARGETS.get(target)
    if t is not None and not t.unified:
        sup = t.support_report(model=m, mapping=mapping, fmt=fmt, trtllm_version=trtllm_version)
        if sup is not None:
            report["support"] = sup
    if m.family in unified.FAMILIES:
        u = unified_report(m.family, fmt, target, sm, engine)
        report["unified_hf"] = u
        if "support" in u:
            report["support"] = u["support"]
    report["notes"] = _notes(m)
    return report


def _inspect_transformers_moe(model: str, tp: int, pp: int, moe_tp: int | None, moe_ep: int | None, fmt: str | None,
                              target: str | None, sm: int, engine: str | None) -> dict:
    """A MoE outside the registry, counted from transformers' model built from its config (inspect_hf), with
    the unified-HF support table's cells when the exporter reads its tensors by name (DeepSeek-V3, gpt-oss,
    OLMoE)."""
    rep = describe_transformers_moe(resolve_model_path(model, config_only=True))
    if rep["family"] in unified.ARCH_LABEL:
        rep["unified_hf"] = unified_report(rep["family"], fmt, target, sm, engine)
        if "support" in rep["unified_hf"]:
            rep["support"] = rep["unified_hf"]["support"]
    why = layout_problem(rep, tp, pp, moe_tp, moe_ep)
    rep["layout"] = {"tp": tp, "pp": pp, "moe_tp": moe_tp, "moe_ep": moe_ep, "ok": why is None,
                     "problems": [why] if why else []}
    if rep["family"] in unified.ARCH_LABEL:
        export = ("exported as a unified-HF checkpoint (--target trtllm-pytorch, vllm, sglang), not by the "
                  "TensorRT-LLM 1.2 or embedded targets")
    else:  # no support row: the unified-HF export reads it by name when its experts are stored per expert
        export = ("exported as a unified-HF checkpoint (--target trtllm-pytorch, vllm, sglang; no support-table row, "
                  "so unlisted for every engine) when its routed experts are stored one linear per expert "
                  "(experts.E.gate_proj / up_proj / down_proj or w1 / w3 / w2), not by the TensorRT-LLM 1.2 or "
                  "embedded targets")
    rep["notes"] = ["outside trtmoe's registry: counted from transformers' model; calibrated layer-streamed "
                    f"(calibrate --runner stream) and {export}"]
    return rep


def _notes(m) -> list[str]:
    """What TensorRT-LLM's model class refuses about this model whatever its layout and format (the
    support table's dense-layer rules); the embedded engine runs it either way."""
    if m.family not in support.FAMILIES:
        return []
    v = support.check(DEFAULT_TRTLLM_VERSION, m.family, layer_formats=None, moe_layers=list(m.moe_layers),
                      shared_expert_size=m.shared_expert_intermediate_size)
    return [f"{r} (the embedded engine runs it)" for r in v.refusals]
