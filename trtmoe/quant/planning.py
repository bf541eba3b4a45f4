"""The quantization plan a resolved config asks for: what ``trtmoe convert`` writes.

``plan_from_config`` turns the merged options (CLI > YAML > defaults) into a ``QuantPlan``: the
policy and granularity the target can run, the calibration it needs (recorded by path and hash),
the candidate formats the TensorRT-LLM support table allows, the INT4 rounding and the expert
placement."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

from ..errors import InputError, UnsupportedError
from ..hf.reader import HFCheckpoint, parse_dtype
from ..parallel.mapping import Mapping
from ..targets import Target, target_for
from . import awq
from .awq import attach as attach_rounding
from .calib_schema import stacked_view
from .calibrate import load_calib
from .formats import FORMATS
from .plan import QuantPlan, uniform_plan
from .policies import make_plan, make_target_plan, placement


_BUDGETED = ("graded", "frequency-bytes", "random-bytes")


def plan_from_config(model, cfg: dict):
    """The QuantPlan for a resolved config (CLI > YAML > defaults), or None for a float checkpoint."""
    q, cv, target = cfg["quantize"], cfg["convert"], target_for(cfg["build"]["backend"])
    policy = q["policy"]
    if policy == "none" and (q["budget_bpw"] is not None or q["budget_gb"] is not None):
        policy = "graded"
    if policy == "none" and q["placement"] == "identity":
        q["rounding"] = q["rounding"] or "awq"
        return None
    granularity = target.plan_granularity(q["granularity"], policy, policy in _BUDGETED)
    with HFCheckpoint(model) as src:
        m = src.model
    dname = cv["dtype"] if cv["dtype"] != "auto" else m.source_dtype
    dtype = parse_dtype(dname if dname in ("float32", "float16", "bfloat16") else "float32")
    mapping = Mapping.create(cv["tp"], cv["pp"], cv["moe_tp"], cv["moe_ep"])
    calib, calib_identity = _calibration(q, policy, m)
    # Unless asked otherwise, INT4 is rounded as the sensitivities were measured (the resolved config
    # the manifest keeps says which).
    measured = calib if calib is not None else (load_calib(q["calib"]) if q["calib"] else None)
    named = q["rounding"] is not None
    asked = named or q["calib"] is not None  # by name, or as the calibration measured
    q["rounding"] = q["rounding"] or (measured or {}).get("rounding") or "awq"
    budget = _budget_bpw(q, m, mapping)
    I_loc = mapping.expert_ffn_per_rank(m.expert_intermediate_size)
    formats, lost_note = q["formats"], None
    if policy in _BUDGETED and granularity == "layer" and calib is not None:
        formats, lost_note = _target_candidates(calib, q["formats"])
    if policy == "uniform":
        if not q["format"]:
            raise InputError("policy 'uniform' needs --format int8, int4, int4_g128 or int4_g64")
        granularity, note = _uniform_codes(q, granularity, target, named)
        plan = uniform_plan(m, q["format"], granularity)
        if note:
            plan = replace(plan, meta={**plan.meta, "notes": [note]})
    elif policy == "none":
        # Placement only: experts stay stacked float tensors (layer form), which every target loads.
        plan = QuantPlan({}, granularity="layer", meta={"policy": "none"})
    elif policy in _BUDGETED and (opts := target.support_options(cv["trtllm_version"], m.family)) is not None:
        # Candidates are what the support table lets this architecture build on the target release.
        if budget is None:
            raise InputError(f"policy {policy!r} needs a budget (--budget BPW or --budget-gb)")
        # Plan on the ΔKL of the weights this layout writes (a layer-shared pre-quant scale), when the
        # calibration measured them with the rounding the checkpoint uses.
        stacked = q["rounding"] == calib.get("rounding") and bool(calib["sensitivity"].get("stacked"))
        if stacked:
            calib = stacked_view(calib)
        plan = make_target_plan(calib, policy, budget_bpw=budget, uniform=opts.uniform, mixed=opts.mixed,
                                dtype=dtype, formats=formats, seed=q["seed"], I_loc=I_loc,
                                target=target.plan_label(m.family, opts))
        if not stacked and any(awq.shares_prequant(FORMATS[f], q["rounding"]) for f in calib["formats"]):
            note = ("group-wise int4 ΔKL were measured with each expert matrix's own pre-quant scale, while this "
                    f"layout shares one per MoE layer; `trtmoe calibrate --target {target.name}` measures those weights")
            plan = replace(plan, meta={**plan.meta, "notes": [*plan.meta.get("notes", []), note]})
    else:
        plan = make_plan(calib, policy, budget_bpw=budget, granularity=granularity, formats=formats,
                         dtype=dtype, seed=q["seed"], I_loc=I_loc)
    if lost_note:
        plan = replace(plan, meta={**plan.meta, "notes": [*plan.meta.get("notes", []), lost_note]})
    if calib is not None:
        plan = replace(plan, meta={**plan.meta, "calib": calib_identity})
    if q["placement"] == "balanced":
        plan = plan.placed(*placement(calib, mapping))
    plan = _with_input_amax(plan, measured)
    return attach_rounding(plan, q["rounding"], q["calib"], measured, asked=asked)


def _with_input_amax(plan: QuantPlan, calib: dict | None) -> QuantPlan:
    """``plan`` carrying the calibration's per-layer input amax (``meta["input_amax"]``) when one of its
    formats quantizes activations with a static scale (the checkpoint layout makes the scales from it)."""
    needs = sorted(f for f in plan.used_formats() if f in FORMATS and FORMATS[f].needs_input_amax)
    if not needs:
        return plan
    amax = (calib or {}).get("input_amax")
    if not amax:
        raise InputError(f"{', '.join(needs)} quantize activations with a static input scale made from the calibrated "
                         "input amax of each MoE layer", hint="pass --calib with a calibration made by this trtmoe")
    # One value per layer and matrix kind (the scale is per tensor), except for a format with a searched
    # pre-quant scale (W4A8 AWQ): its input scale is the amax of the pre-scaled inputs, made from the
    # per-channel maxima calib.json keeps.
    per_channel = any(awq.applies(FORMATS[f]) for f in needs)
    per_layer = {l: {m: (list(v) if per_channel else max(v)) if isinstance(v, list) else v for m, v in d.items()}
                 for l, d in amax.items()}
    return replace(plan, meta={**plan.meta, "input_amax": per_layer})


def _target_candidates(calib: dict, asked: list[str] | None) -> tuple[list[str] | None, str | None]:
    """The candidate formats of a budgeted plan in the layer layout, scored as the engine will run them.
    Per-channel int4 is stored there as float weights the engine builder rounds to nearest (after awq's
    clip), so a calibration that measured it with error-feedback codes measured something the engine
    never computes: such a format is left out of the candidates (a note says what it would lose), and
    refused when named in --formats. Returns (formats for the policy, note or None)."""
    measured = calib.get("rounding") or "awq"
    lost = [f for f in calib["formats"] if awq.loses_codes(FORMATS[f], measured)]
    if not lost:
        return asked, None
    named = [f for f in asked or [] if f in lost]
    why = (f"the layer layout stores per-channel {', '.join(lost)} as float weights that the engine builder "
           f"rounds to nearest, which loses the {measured} error-feedback codes calibration measured "
           f"{'it' if len(lost) == 1 else 'them'} with (only awq's clip reaches the engine)")
    if named:
        raise UnsupportedError(f"--formats {', '.join(named)}: {why}, so its predicted ΔKL would not be what "
                               "the engine computes",
                               hint="drop it from --formats, calibrate with --rounding awq to plan with it, or "
                                    "plan per matrix on the embedded target (--granularity matrix)")
    keep = [f for f in (asked or ["fp16", *calib["formats"]]) if f not in lost]
    return keep, f"{', '.join(lost)} left out of the candidates: {why}"


def _uniform_codes(q: dict, granularity: str, target: Target, named: bool) -> tuple[str, str | None]:
    """The granularity a uniform plan is written at so that its rounding is the one applied. The layer
    layout stores per-channel int4 as float weights that the engine builder (or the embedded engine at
    load) rounds to nearest, which drops gptq's codes: the embedded target then writes every expert
    packed (granularity expert) unless the layer layout was asked for, which is refused; TensorRT-LLM
    builds only the layer layout, so a rounding asked for by name is refused, and the calibration's
    default becomes what reaches the engine (``q["rounding"]`` is set to it, and the note says so)."""
    fmt = FORMATS[q["format"]]
    if not awq.loses_codes(fmt, q["rounding"]):
        return granularity, None
    r, kept = q["rounding"], awq.kept_in_float(q["rounding"])
    why = (f"per-channel int4 in the layer layout is stored as float weights that the "
           f"{target.rounder} rounds to nearest, so {r}'s "
           "error-feedback codes cannot be kept")
    if target.layer_only:
        if named:
            raise UnsupportedError(f"--rounding {r} with --format int4 on --target {target.name}: {why}",
                                   hint=f"use --rounding {kept}, a group-wise format (--format int4_g128), "
                                        "or --target embedded")
        q["rounding"] = kept
        return granularity, (f"the calibration measured {r}; TensorRT-LLM builds per-channel int4 from float "
                             f"weights, which keep {kept} of it: the checkpoint is rounded with {kept}")
    if q["granularity"] != "auto":
        raise UnsupportedError(f"--rounding {r} with --format int4 --granularity layer: {why}",
                               hint=f"use --granularity expert (packed per expert, codes kept), or --rounding {kept}")
    return "expert", None


def _calibration(q: dict, policy: str, m) -> tuple[dict | None, dict | None]:
    """The calibration the policy or placement needs, checked against the model, and its identity
    (resolved path and content hash) for the manifest. ``q["calib"]`` becomes the resolved path:
    the manifest records which calibration this is, not the path as typed."""
    needs = policy in ("graded", "frequency", *_BUDGETED) or q["placement"] == "balanced"
    if not needs:
        return None, None
    if not q["calib"]:
        raise InputError(f"policy {policy!r}" + (" / balanced placement" if q["placement"] == "balanced" else "")
                         + " needs calibration data", hint="run `trtmoe calibrate MODEL --data ... -o calib/` "
                                                           "and pass --calib calib/")
    calib = load_calib(q["calib"])
    if calib["num_experts"] != m.num_experts or calib["num_layers"] != m.num_layers:
        raise InputError("calibration was measured on a different model", where=q["calib"])
    cpath = Path(q["calib"])
    cfile = cpath / "calib.json" if cpath.is_dir() else cpath
    q["calib"] = str(cpath.resolve())
    return calib, {"path": q["calib"], "sha256": hashlib.sha256(cfile.read_bytes()).hexdigest()}


def _budget_bpw(q: dict, m, mapping: Mapping) -> float | None:
    """The budget in bits per routed-expert weight: --budget as given, or --budget-gb (expert bytes per
    GPU) spread over every routed-expert weight of the model."""
    if q["budget_gb"] is None:
        return q["budget_bpw"]
    if q["budget_bpw"] is not None:
        raise InputError("give either --budget or --budget-gb, not both")
    total_weights = m.num_moe_layers * m.num_experts * 3 * m.expert_intermediate_size * m.hidden_size
    return q["budget_gb"] * 1e9 * 8 * mapping.world_size / total_weights
