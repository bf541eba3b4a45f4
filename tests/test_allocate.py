"""Exact bit allocator: optimality against brute force, budget, monotonicity, errors, scale."""

from __future__ import annotations

import itertools
import json
import math
import time

import numpy as np
import pytest

from trtmoe.errors import InputError
from trtmoe.quant.allocate import Unit, allocate, feasible_bpw_range, unit_cost_bits

FMTS = ("fp16", "int8", "int4_g128")


def brute_force(units, budget_bits):
    """Minimum total ΔKL over every assignment within ``budget_bits`` (None if none fits)."""
    best = None
    for combo in itertools.product(*[sorted(u.costs_bits) for u in units]):
        cost = sum(u.costs_bits[f] for u, f in zip(units, combo))
        if cost <= budget_bits:
            val = math.fsum(u.delta_kl[f] for u, f in zip(units, combo))
            if best is None or val < best:
                best = val
    return best


def random_units(rng, n, kind):
    units = []
    for i in range(n):
        nw = int(rng.integers(50, 2000))
        if kind == "tiny_costs":  # many equal costs and exact cost ties across units
            costs = {f: int(rng.integers(1, 12)) for f in FMTS}
        else:  # format-like: fp16 > int8 > int4 plus scale noise
            costs = {"fp16": 16 * nw, "int8": 8 * nw + int(rng.integers(0, 64)),
                     "int4_g128": 4 * nw + int(rng.integers(0, 64))}
        if kind == "ties":  # small integer ΔKL: many exact value ties
            dkl = {f: float(rng.integers(0, 4)) for f in FMTS}
        elif kind == "nonmonotone":  # a "cheaper" format may even be better
            dkl = {f: float(rng.normal()) for f in FMTS}
        else:
            s = float(rng.lognormal(0, 1.5))
            dkl = {"fp16": float(rng.random()) * 1e-4, "int8": s * float(rng.random()) * 1e-2,
                   "int4_g128": s * float(rng.random() + 0.2)}
        units.append(Unit(key=("layer", i), n_weights=nw, costs_bits=costs, delta_kl=dkl))
    return units


@pytest.mark.parametrize("kind", ["realistic", "tiny_costs", "ties", "nonmonotone"])
def test_matches_brute_force(kind):
    rng = np.random.default_rng({"realistic": 1, "tiny_costs": 2, "ties": 3, "nonmonotone": 4}[kind])
    for _ in range(60):
        units = random_units(rng, int(rng.integers(1, 9)), kind)
        lo, hi = feasible_bpw_range(units)
        for budget in (lo, float(rng.uniform(lo, hi)), float(rng.uniform(lo, hi)), hi):
            plan = allocate(units, budget)
            assert plan.extra["exact"]
            ref = brute_force(units, plan.budget_bits)
            assert plan.predicted_delta_kl == pytest.approx(ref, rel=1e-12, abs=1e-12)
            # the plan's own totals are what its assignment says
            assert plan.total_bits == sum(u.costs_bits[plan.assignment[u.key]] for u in units)
            assert plan.total_bits <= plan.budget_bits
            assert plan.predicted_delta_kl == pytest.approx(
                sum(u.delta_kl[plan.assignment[u.key]] for u in units), rel=1e-12, abs=1e-15)
            assert plan.avg_bits_per_weight == plan.total_bits / sum(u.n_weights for u in units)


def test_collinear_hulls_keep_their_segments_in_order():
    """ΔKL exactly proportional to the bits saved puts each unit's formats on one line: dividing
    can then round a later hull segment's efficiency above an earlier one's. The relaxation must
    still take each unit's segments in order (before, its incumbent went over budget and the solver
    failed its own budget assertion on this instance); the plan matches brute force."""
    import random

    rng = random.Random(30)
    units = []
    for i in range(10):
        nw = rng.choice([64, 128, 4096, 1000 + rng.randrange(100)])
        bits = sorted(rng.sample(range(1, 17), 5))
        units.append(Unit((i,), nw, {f"f{b}": b * nw for b in bits}, {f"f{b}": (16 - b) * nw * 1e-3 for b in bits}))
    lo, hi = feasible_bpw_range(units)
    plan = allocate(units, lo + 0.3 * (hi - lo))
    assert plan.total_bits <= plan.budget_bits
    assert plan.predicted_delta_kl == pytest.approx(brute_force(units, plan.budget_bits), rel=1e-9)


def test_budget_respected_and_monotone():
    rng = np.random.default_rng(7)
    units = random_units(rng, 40, "realistic")
    lo, hi = feasible_bpw_range(units)
    prev = math.inf
    for budget in np.linspace(lo, hi, 60):
        plan = allocate(units, float(budget))
        assert plan.total_bits <= math.floor(budget * plan.n_weights) + 1
        assert plan.avg_bits_per_weight <= budget + 1e-9
        assert plan.predicted_delta_kl <= prev + 1e-12
        prev = plan.predicted_delta_kl


def test_budget_is_the_whole_bits_at_or_below_bpw_times_weights():
    """A plan never exceeds the bits per weight asked for: 3.5 bits/weight over 3 weights is 10 bits,
    not 11; bpw values computed as bits / weights (11 / 3) still reach their whole bits."""
    units = [Unit(("a",), 3, {"hi": 11, "lo": 9}, {"hi": 0.0, "lo": 1.0})]
    plan = allocate(units, 3.5)
    assert plan.budget_bits == 10 and plan.assignment == {("a",): "lo"} and plan.avg_bits_per_weight <= 3.5
    plan = allocate(units, 11 / 3)
    assert plan.budget_bits == 11 and plan.assignment == {("a",): "hi"}


def test_not_greedy():
    # Greedy by ΔKL-saved-per-bit upgrades unit A first and then cannot afford B; the optimum
    # upgrades B only.
    a = Unit(("a",), 1, {"fp16": 10, "int4_g128": 4}, {"fp16": 0.0, "int4_g128": 1.2})
    b = Unit(("b",), 1, {"fp16": 12, "int4_g128": 4}, {"fp16": 0.0, "int4_g128": 1.5})
    plan = allocate([a, b], 16 / 2)  # 16 bits for both
    assert plan.assignment == {("a",): "int4_g128", ("b",): "fp16"}
    assert plan.predicted_delta_kl == pytest.approx(1.2)


def test_budget_not_binding_picks_best_everywhere():
    units = random_units(np.random.default_rng(8), 10, "realistic")
    _, hi = feasible_bpw_range(units)
    plan = allocate(units, hi)
    for u in units:
        best = min(u.delta_kl.values())
        assert u.delta_kl[plan.assignment[u.key]] == best
    assert not plan.extra["binding"]


def test_error_cases():
    units = random_units(np.random.default_rng(9), 5, "realistic")
    lo, hi = feasible_bpw_range(units)
    with pytest.raises(InputError, match=r"feasible range \[\d+\.\d+, \d+\.\d+\] bits/weight"):
        allocate(units, lo - 0.01)
    with pytest.raises(InputError, match="feasible range"):
        allocate(units, hi + 0.01)
    with pytest.raises(InputError):
        allocate(units, float("nan"))
    with pytest.raises(InputError, match="no units"):
        allocate([], 4.0)
    dup = units + [Unit(units[0].key, 10, {"fp16": 160}, {"fp16": 0.0})]
    with pytest.raises(InputError, match="duplicate"):
        allocate(dup, 8.0)
    with pytest.raises(InputError, match="differ"):
        allocate([Unit(("x",), 10, {"fp16": 160, "int8": 80}, {"fp16": 0.0})], 12.0)
    with pytest.raises(InputError, match="not finite"):
        allocate([Unit(("x",), 10, {"fp16": 160, "int8": 80}, {"fp16": 0.0, "int8": math.inf})], 12.0)
    with pytest.raises(InputError, match="positive int"):
        allocate([Unit(("x",), 10, {"fp16": 160, "int8": 80.5}, {"fp16": 0.0, "int8": 1.0})], 12.0)
    # the exact ends of the range are accepted
    assert allocate(units, lo).total_bits == sum(min(u.costs_bits.values()) for u in units)
    assert allocate(units, hi).predicted_delta_kl == pytest.approx(
        sum(min(u.delta_kl.values()) for u in units))


def test_unit_cost_bits_uses_the_formats():
    costs = unit_cost_bits(FMTS, [(768, 2048), (768, 2048), (2048, 768)])
    n = 3 * 768 * 2048
    assert costs["fp16"] == 16 * n
    assert costs["int8"] == 8 * n + 16 * (768 + 768 + 2048)
    assert costs["int4_g128"] == 4 * n + 16 * (n // 128) + 16 * (2048 + 2048 + 768)


def _model_like_units(n_layers=48, n_experts=64, seed=0):
    """A Qwen-MoE-like pool: 3,072 experts of one shape, ΔKL heavy-tailed and growing with depth."""
    rng = np.random.default_rng(seed)
    costs = unit_cost_bits(FMTS, [(768, 2048), (768, 2048), (2048, 768)])
    nw = 3 * 768 * 2048
    units = []
    for layer in range(n_layers):
        for e in range(n_experts):
            s = float(rng.lognormal(0, 1.5)) * (1 + layer / 10)
            units.append(Unit((layer, e), nw, dict(costs), {
                "fp16": 0.0,
                "int8": s * 1e-4 * float(rng.lognormal(0, 0.3)),
                "int4_g128": s * 2e-3 * float(rng.lognormal(0, 0.3))}))
    return units


@pytest.mark.parametrize("budget", [4.5, 6.0, 9.0])
def test_3072_units_solve(budget):
    units = _model_like_units()
    assert len(units) == 3072
    t0 = time.perf_counter()
    plan = allocate(units, budget)
    dt = time.perf_counter() - t0
    print(f"\n3072 units x 3 formats @ {budget} bpw: {dt * 1000:.0f} ms, "
          f"avg {plan.avg_bits_per_weight:.5f} bpw, free units {plan.extra['free_units']}, "
          f"largest front {plan.extra['max_front']}, exact {plan.extra['exact']}")
    assert plan.extra["exact"]
    assert budget - 0.02 <= plan.avg_bits_per_weight <= budget
    # the LP bound brackets the optimum
    assert plan.extra["lower_bound"] <= plan.predicted_delta_kl + 1e-12


def test_3072_units_with_distinct_costs_solve():
    rng = np.random.default_rng(11)
    units = []
    for i in range(3072):
        inter = int(rng.integers(1, 13)) * 128
        costs = unit_cost_bits(FMTS, [(inter, 2048), (inter, 2048), (2048, inter)])
        s = float(rng.lognormal(0, 2))
        units.append(Unit((i,), 3 * inter * 2048, costs, {
            "fp16": float(rng.random()) * 1e-6, "int8": s * 1e-4 * float(rng.random()),
            "int4_g128": s * 1e-3 * float(rng.random() + 0.1)}))
    t0 = time.perf_counter()
    plan = allocate(units, 5.0)
    print(f"\n3072 units, 12 shapes: {(time.perf_counter() - t0) * 1000:.0f} ms, "
          f"avg {plan.avg_bits_per_weight:.5f} bpw, exact {plan.extra['exact']}")
    assert plan.extra["exact"]
    assert 4.98 <= plan.avg_bits_per_weight <= 5.0


def test_subset_sum_like_instance_is_flagged_not_hidden():
    # ΔKL exactly proportional to bits saved ties every unit at the LP multiplier, so the exact
    # search degenerates to subset-sum; the plan says it is not proven optimal and bounds the gap.
    rng = np.random.default_rng(12)
    units = []
    for i in range(3072):
        nw = int(rng.integers(10**5, 10**7))
        c = {"fp16": 16 * nw, "int8": 8 * nw + int(rng.integers(0, 10**4)),
             "int4_g128": 4 * nw + int(rng.integers(0, 10**4))}
        units.append(Unit((i,), nw, c, {f: 1e-9 * (c["fp16"] - c[f]) for f in c}))
    t0 = time.perf_counter()
    plan = allocate(units, 6.0)
    print(f"\nsubset-sum-like 3072 units: {(time.perf_counter() - t0) * 1000:.0f} ms, "
          f"gap bound {plan.extra['gap_bound']:.3g} of ΔKL {plan.predicted_delta_kl:.6g}")
    assert plan.total_bits <= plan.budget_bits
    if not plan.extra["exact"]:
        assert plan.extra["gap_bound"] <= 1e-6 * plan.predicted_delta_kl
    assert plan.predicted_delta_kl >= plan.extra["lower_bound"] - 1e-9


# ---- matrix granularity: units from a calibration's per-matrix ΔKL -----------------------------------
def _matrix_calib(rng, layers=2, experts=2, I=256, H=128, proj_weight=3.0):
    """A calib.json-shaped dict (layout version 2) with random per-matrix ΔKL, proj ``proj_weight``×
    as sensitive per format as fc on average (int8 ~50× below int4_g128), and random routing shares."""
    from trtmoe.quant.calibrate import CALIB_VERSION

    fmts = ["int8", "int4_g128"]
    mats = {}
    for m, w in (("fc", 1.0), ("proj", proj_weight)):
        s = rng.lognormal(0, 1.0, size=(layers, experts)) * w
        mats[m] = {"delta_kl": {"int4_g128": (s * 1e-3).tolist(),
                                "int8": (s * 2e-5 * rng.lognormal(0, 0.3, size=s.shape)).tolist()}}
    share = rng.dirichlet(np.ones(experts), size=layers).tolist()
    expert = {f: (np.array(mats["fc"]["delta_kl"][f]) + np.array(mats["proj"]["delta_kl"][f])).tolist() for f in fmts}
    counts = [[round(1000 * x) for x in row] for row in share]
    return {"version": CALIB_VERSION, "num_layers": layers, "num_experts": experts, "top_k": 1,
            "moe_layers": list(range(layers)), "expert_intermediate_size": I, "hidden_size": H, "formats": fmts,
            "bits_per_weight": {"int8": 8.125, "int4_g128": 4.25},
            "routing": {"share": share, "tokens": 1000, "counts": counts},
            "sensitivity": {"delta_kl": expert, "matrices": mats}}


def test_matrix_units_cost_each_matrix_on_its_own():
    import torch

    from trtmoe.quant.policies import build_units

    I, H = 256, 128
    cal = _matrix_calib(np.random.default_rng(21), I=I, H=H)
    units = {u.key: u for u in build_units(cal, "matrix", torch.bfloat16)}
    assert len(units) == 2 * 2 * 2
    # Written out per format (bf16 scales: 16 bits); every matrix of the per-expert layout carries its
    # own [1, in] pre-quant scale in a group format.
    want = {"fc": {"float": 16 * 2 * I * H, "int8": 8 * 2 * I * H + 16 * 2 * I,
                   "int4_g128": 4 * 2 * I * H + 16 * 2 * I * (H // 128) + 16 * H},
            "proj": {"float": 16 * H * I, "int8": 8 * H * I + 16 * H,
                     "int4_g128": 4 * H * I + 16 * H * (I // 128) + 16 * I}}
    experts = {u.key: u for u in build_units(cal, "expert", torch.bfloat16)}
    for (l, e, m), u in units.items():
        assert u.n_weights == (2 * I * H if m == "fc" else H * I)
        assert u.costs_bits == want[m]
        for f in ("int8", "int4_g128"):
            assert u.delta_kl[f] == cal["sensitivity"]["matrices"][m]["delta_kl"][f][l][e]
        assert u.delta_kl["float"] == 0.0
    for (l, e), u in experts.items():
        fc, proj = units[(l, e, "fc")], units[(l, e, "proj")]
        assert u.n_weights == fc.n_weights + proj.n_weights
        assert u.costs_bits == {f: fc.costs_bits[f] + proj.costs_bits[f] for f in u.costs_bits}
        assert u.delta_kl == pytest.approx({f: fc.delta_kl[f] + proj.delta_kl[f] for f in u.delta_kl}, rel=1e-12)


def test_matrix_plan_matches_brute_force_and_beats_expert_plans():
    import torch

    from trtmoe.quant.policies import build_units, make_plan, plan_bpw, predicted_delta_kl

    rng = np.random.default_rng(22)
    strictly_better = 0
    for _ in range(6):
        cal = _matrix_calib(rng)
        units = build_units(cal, "matrix", torch.bfloat16)
        lo, hi = feasible_bpw_range(units)
        for budget in (lo, *sorted(rng.uniform(lo, hi, 4)), hi):
            budget = float(budget)
            plan = make_plan(cal, "graded", budget_bpw=budget, granularity="matrix", dtype=torch.bfloat16)
            assert plan.granularity == "matrix"
            ref = brute_force(units, allocate(units, budget).budget_bits)  # the budget in bits, as allocated
            assert predicted_delta_kl(plan, cal) == pytest.approx(ref, rel=1e-12, abs=1e-15)
            assert plan_bpw(plan, cal, torch.bfloat16) <= budget + 1e-12
            # Every expert plan is a matrix plan with fc = proj at the same cost, so the matrix
            # optimum can only be lower.
            ex = make_plan(cal, "graded", budget_bpw=budget, granularity="expert", dtype=torch.bfloat16)
            assert predicted_delta_kl(plan, cal) <= predicted_delta_kl(ex, cal) + 1e-15
            strictly_better += predicted_delta_kl(plan, cal) < predicted_delta_kl(ex, cal) * (1 - 1e-9)
    assert strictly_better > 0


def test_bytes_baselines_run_at_matrix_granularity():
    import torch

    from trtmoe.quant.policies import build_units, make_plan, plan_bpw

    cal = _matrix_calib(np.random.default_rng(23), layers=3, experts=4)
    units = build_units(cal, "matrix", torch.bfloat16)
    lo, hi = feasible_bpw_range(units)
    step = max(max(u.costs_bits.values()) - min(u.costs_bits.values()) for u in units) / sum(
        u.n_weights for u in units)
    share = cal["routing"]["share"]
    for budget in (lo + 0.3 * (hi - lo), lo + 0.6 * (hi - lo)):
        fr = make_plan(cal, "frequency-bytes", budget_bpw=budget, granularity="matrix", dtype=torch.bfloat16)
        seeds = [make_plan(cal, "random-bytes", budget_bpw=budget, granularity="matrix", dtype=torch.bfloat16,
                           seed=s) for s in range(3)]
        for p in (fr, *seeds):
            assert p.granularity == "matrix"
            # Equal bytes: within one unit's format step of the budget, never over it.
            assert budget - step <= plan_bpw(p, cal, torch.bfloat16) <= budget + 1e-12
        # The busiest expert's matrices are filled first: its fc gets the richest format.
        l, e = max(((l, e) for l in range(3) for e in range(4)), key=lambda le: share[le[0]][le[1]])
        assert fr.matrix_format(l, e, "fc") == "float"
        # Different seeds spend the bytes on different matrices.
        assert len({json.dumps(p.to_dict()["formats"]) + json.dumps(p.to_dict()["proj_formats"])
                    for p in seeds}) > 1
