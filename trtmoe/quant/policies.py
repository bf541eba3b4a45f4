"""Turn calibration measurements into a QuantPlan: the graded (exact knapsack) policy and the
baselines it is compared against (uniform, frequency tiers, frequency and random at equal bytes).

Three granularities (units of the knapsack): ``matrix`` — each expert's fc and proj apart (the
finest the embedded engine runs), ``expert`` — one format per expert, ``layer`` — one format per MoE
layer (what TensorRT-LLM's fused MoE plugin runs)."""

from __future__ import annotations

import random as _random
from dataclasses import replace

import torch

from ..errors import InputError
from ..parallel.mapping import Mapping
from .allocate import Unit, allocate, feasible_bpw_range
from .calib_schema import check_calib
from .formats import FORMATS
from .plan import (FLOAT, GRANULARITIES, MATRICES, QuantPlan, expert_shape_problem, format_obj, matrix_shape,
                   matrix_shape_problem)

POLICIES = ("graded", "uniform", "frequency", "frequency-bytes", "random-bytes")


def _scale_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def matrix_cost_bits(fmt: str, mod: str, I: int, H: int, dtype: torch.dtype) -> int:
    """Stored bits of one expert's ``mod`` matrix ("fc" [2I, H] or "proj" [H, I]) in ``fmt`` in the
    per-expert layout, scales counted (a group format's [1, in] pre-quant scale included: every
    matrix of that layout has its own)."""
    o, i = matrix_shape(mod, H, I)
    return 8 * format_obj(fmt, dtype).weight_bytes(o, i, 1, _scale_bytes(dtype))


def expert_cost_bits(fmt: str, I: int, H: int, dtype: torch.dtype, n: int = 1) -> int:
    """Stored bits of ``n`` stacked experts (fc [2I, H] + proj [H, I]) in ``fmt``, scales counted
    (a scale tensor shared by the stack, like AWQ's pre-quant scale, once)."""
    f = format_obj(fmt, dtype)
    scale = _scale_bytes(dtype)
    return 8 * (f.weight_bytes(2 * I, H, n, scale) + f.weight_bytes(H, I, n, scale))


def _check_calib(calib: dict) -> None:
    check_calib(calib)


def _candidates(calib: dict, formats: list[str] | None) -> list[str]:
    fs = [FLOAT] + [f for f in calib["formats"]]
    if formats:
        want = [FLOAT if f in ("fp16", "bf16", "fp32", "float") else f for f in formats]
        missing = [f for f in want if f != FLOAT and f not in calib["formats"]]
        if missing:
            raise InputError(f"format(s) {missing} were not measured in calibration",
                             hint="rerun `trtmoe calibrate --formats ...` including them")
        fs = [f for f in fs if f in want]
    return fs


def build_units(calib: dict, granularity: str, dtype: torch.dtype, formats: list[str] | None = None,
                I_loc: int | None = None) -> list[Unit]:
    """Allocation units for the knapsack, with costs in stored bits and values in ΔKL (nats/token).

    ``matrix``: one unit per (layer, expert, "fc" | "proj"), costed from that matrix's own bits
    (per-expert layout) and valued with its own measured ΔKL. ``expert``: one per (layer, expert),
    ΔKL = fc + proj. ``layer``: one per MoE layer (key ``(layer,)``), the sum over its experts, costed
    as a stack (shared pre-quant scale once). Formats whose packing the per-rank shapes (hidden size,
    FFN size ``I_loc``) do not allow drop out: per matrix at matrix granularity, else per expert."""
    _check_calib(calib)
    if granularity not in GRANULARITIES:
        raise InputError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    I, H, E = calib["expert_intermediate_size"], calib["hidden_size"], calib["num_experts"]
    cands = _candidates(calib, formats)
    units = []
    if granularity == "matrix":
        per = {}
        for m in MATRICES:
            fs = [f for f in cands if not matrix_shape_problem(f, m, H, I_loc or I)]
            o, i = matrix_shape(m, H, I)
            per[m] = (fs, o * i, {f: matrix_cost_bits(f, m, I, H, dtype) for f in fs},
                      calib["sensitivity"]["matrices"][m]["delta_kl"])
        for l in calib["moe_layers"]:
            for e in range(E):
                for m in MATRICES:
                    fs, n, cost, dkl = per[m]
                    units.append(Unit(key=(l, e, m), n_weights=n, costs_bits=dict(cost),
                                      delta_kl={f: 0.0 if f == FLOAT else float(dkl[f][l][e]) for f in fs}))
        return units
    fs = [f for f in cands if not expert_shape_problem(f, H, I_loc or I)]
    dkl = calib["sensitivity"]["delta_kl"]
    cost = {f: expert_cost_bits(f, I, H, dtype) for f in fs}
    for l in calib["moe_layers"]:
        if granularity == "expert":
            for e in range(E):
                units.append(Unit(key=(l, e), n_weights=3 * I * H, costs_bits=dict(cost),
                                  delta_kl={f: 0.0 if f == FLOAT else float(dkl[f][l][e]) for f in fs}))
        else:
            units.append(Unit(key=(l,), n_weights=E * 3 * I * H,
                              costs_bits={f: expert_cost_bits(f, I, H, dtype, E) for f in fs},
                              delta_kl={f: 0.0 if f == FLOAT else float(sum(dkl[f][l])) for f in fs}))
    return units


def _to_plan(calib: dict, assignment: dict, granularity: str, meta: dict) -> QuantPlan:
    E = calib["num_experts"]
    formats, proj = {}, None
    if granularity == "matrix":
        proj = {l: [assignment[(l, e, "proj")] for e in range(E)] for l in calib["moe_layers"]}
    for l in calib["moe_layers"]:
        if granularity == "matrix":
            formats[l] = [assignment[(l, e, "fc")] for e in range(E)]
        elif granularity == "expert":
            formats[l] = [assignment[(l, e)] for e in range(E)]
        else:
            formats[l] = [assignment[(l,)]] * E
    return QuantPlan(formats, granularity=granularity, meta=meta, proj_formats=proj)


def _fill_by_order(units: list[Unit], order: list[int], budget_bpw: float) -> dict:
    """Walk units in ``order`` giving each the richest format that still leaves room for the rest at
    their cheapest format: spends the budget on the units first in order, at (almost) equal bytes."""
    n = sum(u.n_weights for u in units)
    budget = budget_bpw * n
    cheapest = [min(u.costs_bits.values()) for u in units]
    spent = 0.0
    reserve = float(sum(cheapest))
    out = {}
    for i in order:
        u = units[i]
        reserve -= cheapest[i]
        for f, c in sorted(u.costs_bits.items(), key=lambda kv: -kv[1]):
            if spent + c + reserve <= budget + 1e-9:
                out[u.key] = f
                spent += c
                break
        else:
            raise InputError(f"budget {budget_bpw} bpw is below the cheapest plan")
    return out


def make_plan(calib: dict, policy: str, *, budget_bpw: float | None = None, granularity: str = "expert",
              fmt: str | None = None, formats: list[str] | None = None, dtype: torch.dtype = torch.float16,
              seed: int = 0, I_loc: int | None = None) -> QuantPlan:
    """A plan for ``policy`` (see POLICIES) at ``granularity`` ("matrix", "expert" or "layer"; the
    frequency-tier policy is per expert by definition). ``budget_bpw`` = average stored bits per
    routed-expert weight, scales counted; the bytes baselines spend it unit by unit at the same
    granularity, so they compare with the graded plan at equal bytes."""
    _check_calib(calib)
    E = calib["num_experts"]
    share = calib["routing"]["share"]
    if policy not in POLICIES:
        raise InputError(f"unknown policy {policy!r}", hint="choose from " + ", ".join(POLICIES))
    if policy == "uniform":
        if fmt is None or (fmt not in FORMATS):
            raise InputError("policy 'uniform' needs --format (" + ", ".join(FORMATS) + ")")
        f = FLOAT if fmt in ("fp16", "bf16", "fp32") else fmt
        return QuantPlan({l: [f] * E for l in calib["moe_layers"]}, granularity=granularity,
                         meta={"policy": f"uniform-{fmt}"})
    if policy == "frequency":
        # Fixed tiers by routed share, per layer: top 20% float, next 50% int8, the rest int4 g128
        # (a fixed recipe, so its low tier stays g128 even when g64 was measured).
        low = "int4_g128" if "int4_g128" in calib["formats"] else "int4"
        plan = {}
        for l in calib["moe_layers"]:
            order = sorted(range(E), key=lambda e: -share[l][e])
            n_hi, n_mid = round(0.2 * E), round(0.5 * E)
            fs = [low] * E
            for rank, e in enumerate(order):
                fs[e] = FLOAT if rank < n_hi else ("int8" if rank < n_hi + n_mid else low)
            plan[l] = fs
        return QuantPlan(plan, granularity="expert", meta={"policy": "frequency-tiers"})
    if budget_bpw is None:
        raise InputError(f"policy {policy!r} needs a budget (--budget BPW or --budget-gb)")
    units = build_units(calib, granularity, dtype, formats, I_loc)
    if policy == "graded":
        p = allocate(units, budget_bpw)
        return _to_plan(calib, p.assignment, granularity,
                        {"policy": "graded", "budget_bpw": budget_bpw, "avg_bpw": p.avg_bits_per_weight,
                         "predicted_delta_kl": p.predicted_delta_kl})
    if policy == "frequency-bytes":
        if granularity in ("expert", "matrix"):
            # Busiest experts first; a stable sort keeps an expert's fc before its proj (no
            # knowledge of which matrix is more sensitive: that is the graded policy's job).
            order = sorted(range(len(units)), key=lambda i: -share[units[i].key[0]][units[i].key[1]])
        else:
            order = list(range(len(units)))
    else:
        order = list(range(len(units)))
        _random.Random(seed).shuffle(order)
    assignment = _fill_by_order(units, order, budget_bpw)
    bits = sum(u.costs_bits[assignment[u.key]] for u in units)
    return _to_plan(calib, assignment, granularity,
                    {"policy": policy, "budget_bpw": budget_bpw, "avg_bpw": bits / sum(u.n_weights for u in units),
                     "seed": seed})


def _layer_units(calib: dict, dtype: torch.dtype, formats: list[str], I_loc: int | None,
                 layer_bits: dict[int, dict[str, int]] | None) -> list[Unit]:
    """Per-MoE-layer units; with ``layer_bits`` (layer -> format -> stored bits of that layer's routed
    experts in the checkpoint layout a target writes) their costs are those instead of trtmoe's stack's."""
    units = build_units(calib, "layer", dtype, formats, I_loc)
    if layer_bits:
        for u in units:
            own = layer_bits.get(u.key[0], {})
            u.costs_bits = {f: own.get(f, c) for f, c in u.costs_bits.items()}
    return units


def make_target_plan(calib: dict, policy: str, *, budget_bpw: float, uniform: tuple[str, ...],
                     mixed: tuple[str, ...], dtype: torch.dtype, formats: list[str] | None = None, seed: int = 0,
                     I_loc: int | None = None, target: str = "the target",
                     layer_bits: dict[int, dict[str, int]] | None = None) -> QuantPlan:
    """A plan of one format per MoE layer for a target that builds a checkpoint of one format from
    ``uniform`` for every layer, or a MIXED_PRECISION one whose layers each take a format from
    ``mixed`` (empty: the target has no MIXED_PRECISION). For TensorRT-LLM these come from the
    support table (``trtmoe.checkpoint.support.options``).

    Every candidate plan the target builds is considered: the exact allocation over ``mixed`` and
    each uniform format that fits ``budget_bpw``. ``graded`` keeps the one with the least predicted
    ΔKL; the bytes baselines spend the budget in their order over ``mixed``, or take the richest
    uniform format that fits. ``meta["notes"]`` says what was chosen instead of what was asked and
    why budget was left unspent (``meta["unspent_bpw"]``). ``layer_bits`` (MoE layer -> format -> stored
    bits of its routed experts) costs the layers in the checkpoint layout the target writes (a unified-HF
    W4A8 expert stores a pre-quant scale per linear, trtmoe's stack one per layer)."""
    _check_calib(calib)
    cands = _candidates(calib, formats)
    share = calib["routing"]["share"]
    options: list[tuple[float, int, str, QuantPlan]] = []  # (ΔKL, bits, kind, plan)
    n_w = None
    mixed_c = [f for f in cands if f in mixed]
    notes: list[str] = []
    if mixed_c:
        units = _layer_units(calib, dtype, mixed_c, I_loc, layer_bits)
        n_w = sum(u.n_weights for u in units)
        if all(u.costs_bits for u in units):
            lo, hi = feasible_bpw_range(units)
            if budget_bpw >= lo - 1e-12:
                b = min(budget_bpw, hi)
                if policy == "graded":
                    p = allocate(units, b)
                    assignment = p.assignment
                else:
                    order = list(range(len(units)))
                    if policy == "random-bytes":
                        _random.Random(seed).shuffle(order)
                    assignment = _fill_by_order(units, order, b)
                bits = sum(u.costs_bits[assignment[u.key]] for u in units)
                dkl = sum(u.delta_kl[assignment[u.key]] for u in units)
                options.append((dkl, bits, "mixed", _to_plan(calib, assignment, "layer", {})))
    for f in cands:
        if f not in uniform:
            continue
        units = _layer_units(calib, dtype, [f], I_loc, layer_bits)
        if not all(f in u.costs_bits for u in units):
            continue  # the shapes do not allow this format's packing
        n_w = sum(u.n_weights for u in units)
        bits = sum(u.costs_bits[f] for u in units)
        if bits <= budget_bpw * n_w * (1 + 1e-12):
            dkl = sum(u.delta_kl[f] for u in units)
            options.append((dkl, bits, "uniform", _to_plan(calib, {u.key: f for u in units}, "layer", {})))
    if not options:
        allowed = sorted(set(uniform) | set(mixed))
        raise InputError(f"budget {budget_bpw} bpw is below the cheapest plan {target} builds from the "
                         f"measured formats (allowed there: {', '.join(allowed) or 'none'})",
                         hint="raise --budget, or measure more formats in calibration")
    if policy == "graded":
        dkl, bits, kind, plan = min(options, key=lambda o: (o[0], o[1]))
    else:
        mixed_opts = [o for o in options if o[2] == "mixed"]
        dkl, bits, kind, plan = mixed_opts[0] if mixed_opts else max(options, key=lambda o: o[1])
    n_w = sum(len(fs) for fs in plan.formats.values()) * 3 * calib["expert_intermediate_size"] * calib["hidden_size"]
    avg = bits / n_w
    unspent = budget_bpw - avg
    if not mixed:
        notes.append(f"{target} builds one format for every MoE layer (no MIXED_PRECISION): "
                     f"{next(iter(plan.used_formats()))} is the best single format within {budget_bpw} bpw")
    if unspent > 0.02:
        notes.append(f"{unspent:.3f} bpw of the {budget_bpw} bpw budget is unspent: "
                     + _why_unspent(calib, plan, kind, mixed_c, uniform, cands, dtype, I_loc, unspent, layer_bits))
    return replace(plan, meta={"policy": policy, "budget_bpw": budget_bpw, "avg_bpw": avg, "predicted_delta_kl": dkl,
                               "target_layout": kind, "unspent_bpw": max(0.0, unspent), "notes": notes,
                               **({"seed": seed} if policy == "random-bytes" else {})})


def _why_unspent(calib, plan, kind, mixed_c, uniform, cands, dtype, I_loc, unspent, layer_bits=None) -> str:
    """Why ``plan`` leaves budget unspent: the cheapest change the target allows that would lower the
    predicted ΔKL, and its cost against what is left."""
    n_w = sum(len(fs) for fs in plan.formats.values()) * 3 * calib["expert_intermediate_size"] * calib["hidden_size"]
    units = _layer_units(calib, dtype, [f for f in cands if f in mixed_c or f in uniform], I_loc, layer_bits)
    cur = {u.key: plan.formats[u.key[0]][0] for u in units}
    steps = []  # (bits per weight, description)
    if kind == "mixed":
        for u in units:
            c = cur[u.key]
            steps += [((u.costs_bits[f] - u.costs_bits[c]) / n_w, f"layer {u.key[0]}: {c} → {f}")
                      for f in mixed_c if f in u.costs_bits and u.delta_kl[f] < u.delta_kl[c]
                      and u.costs_bits[f] > u.costs_bits[c]]
    shared = set.intersection(*(set(u.costs_bits) for u in units)) if units else set()
    c0 = set(cur.values())
    for f in sorted(shared & set(uniform)):
        bits = sum(u.costs_bits[f] for u in units) - sum(u.costs_bits[cur[u.key]] for u in units)
        dkl = sum(u.delta_kl[f] for u in units) - sum(u.delta_kl[cur[u.key]] for u in units)
        if bits > 0 and dkl < 0 and c0 != {f}:
            steps.append((bits / n_w, f"{f} for every MoE layer"))
    if not steps:
        return "no richer format the target allows lowers the predicted ΔKL"
    cost, what = min(steps)
    return f"the cheapest change that lowers the predicted ΔKL ({what}) costs {cost:.3f} bpw more, above what is left"


def plan_bpw(plan: QuantPlan, calib: dict, dtype: torch.dtype) -> float:
    """Average stored bits per routed-expert weight of ``plan`` in the per-expert layout (each
    matrix costed in its own format, scales counted)."""
    I, H = calib["expert_intermediate_size"], calib["hidden_size"]
    bits = sum(matrix_cost_bits(f, m, I, H, dtype) for m in MATRICES
               for fs in plan.matrix_formats(m).values() for f in fs)
    n = sum(len(fs) for fs in plan.formats.values()) * 3 * I * H
    return bits / n


def predicted_delta_kl(plan: QuantPlan, calib: dict) -> float:
    """The allocator's objective for ``plan``: the sum of the measured per-matrix ΔKL (nats/token) of
    every quantized expert matrix (for expert and layer plans, the sum of expert ΔKL = fc + proj)."""
    _check_calib(calib)
    mats = calib["sensitivity"]["matrices"]
    return sum(0.0 if f == FLOAT else mats[m]["delta_kl"][f][l][e]
               for m in MATRICES for l, fs in plan.matrix_formats(m).items() for e, f in enumerate(fs))


# ---- expert placement for EP ---------------------------------------------------------------------
def balanced_permutation(load: list[float], mapping: Mapping) -> list[int]:
    """A permutation (slot -> original expert) whose EP blocks (``mapping.ep_slot_range``) have
    loads as equal as possible: longest-processing-time assignment with equal group sizes, then
    pairwise swaps while they lower the maximum group load."""
    E, ep = len(load), mapping.moe_ep_size
    per = mapping.experts_per_rank(E)
    groups: list[list[int]] = [[] for _ in range(ep)]
    sums = [0.0] * ep
    for e in sorted(range(E), key=lambda e: -load[e]):
        g = min((g for g in range(ep) if len(groups[g]) < per), key=lambda g: sums[g])
        groups[g].append(e)
        sums[g] += load[e]
    improved = True
    while improved:
        improved = False
        hi = max(range(ep), key=lambda g: sums[g])
        for lo in range(ep):
            if lo == hi:
                continue
            for a in groups[hi]:
                for b in groups[lo]:
                    d = load[a] - load[b]
                    if d > 0 and max(sums[hi] - d, sums[lo] + d) < sums[hi] - 1e-12:
                        groups[hi][groups[hi].index(a)] = b
                        groups[lo][groups[lo].index(b)] = a
                        sums[hi] -= d
                        sums[lo] += d
                        improved = True
                        break
                if improved:
                    break
            if improved:
                break
    return [e for g in groups for e in g]


def rank_loads(load: list[float], perm: list[int], mapping: Mapping) -> list[float]:
    """The load each EP rank carries when slot ``s`` holds original expert ``perm[s]``."""
    return [sum(load[e] for e in group) for group in mapping.ep_groups(perm)]


def placement(calib: dict, mapping: Mapping) -> tuple[dict[int, list[int]], dict]:
    """Balanced per-layer permutations and the max/mean EP-rank load before and after."""
    E, ep = calib["num_experts"], mapping.moe_ep_size
    if E % ep:
        raise InputError(f"num_experts={E} is not divisible by moe_ep={ep}")
    counts = calib["routing"]["counts"]
    perms, report = {}, {}
    for l in calib["moe_layers"]:
        load = [float(x) for x in counts[l]]
        ident = list(range(E))
        perm = balanced_permutation(load, mapping)
        before, after = rank_loads(load, ident, mapping), rank_loads(load, perm, mapping)
        mean = sum(load) / ep if sum(load) else 1.0
        if max(after) >= max(before):
            perm, after = ident, before  # never make it worse
        perms[l] = perm
        report[l] = {"before_max_over_mean": max(before) / mean, "after_max_over_mean": max(after) / mean,
                     "rank_loads_before": before, "rank_loads_after": after}
    return perms, report
