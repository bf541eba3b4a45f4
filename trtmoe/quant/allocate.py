"""Exact bit allocation: a multiple-choice knapsack over quantization units.

Each unit (an expert, or a whole MoE layer when the target is TensorRT-LLM, where one layer
has one format) picks one candidate format. Cost is the unit's stored bits in that format
(scales counted), value is its measured sensitivity ΔKL (lower is better, assumed additive).
We minimise total ΔKL subject to total bits ≤ budget, exactly, on the integer bit costs
themselves (no cost discretisation):

1. Drop choices that are dominated inside a unit (costlier and not strictly better).
2. Solve the LP relaxation greedily on each unit's convex hull; its multiplier λ gives the
   Lagrangian lower bound ``LB`` and reduced costs ``r_ij = v_ij + λ c_ij - min_j(v_ij + λ c_ij)``.
3. Any plan ``x`` satisfies ``ΔKL(x) >= LB + Σ r(x)``, so with an incumbent of value ``UB`` a
   better plan has ``Σ r(x) <= UB - LB``. Choices with a larger reduced cost are removed, which
   fixes most units.
4. The remaining units are enumerated by a sparse dynamic programme over (bits, ΔKL) states
   with Pareto dominance, pruned by the same reduced-cost bound and by the budget; the
   incumbent is improved on the way. What survives contains an optimal plan.

The worst case is exponential (the problem is NP-hard), but the bound leaves only units whose
choices are nearly tied at the LP multiplier free, and the Pareto step merges states of equal
cost, so realistic instances with thousands of units take well under a second. When many units
are *exactly* tied (e.g. ΔKL proportional to bits saved) the search turns into subset-sum; past
a state limit the best plan found is returned with ``extra["exact"] = False`` and a certified
``extra["gap_bound"]`` (its ΔKL minus the LP lower bound), and a warning is logged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable, Sequence

import numpy as np

from trtmoe.errors import InputError
from trtmoe.quant.formats import get_format

__all__ = ["Unit", "Plan", "allocate", "feasible_bpw_range", "unit_cost_bits"]

log = logging.getLogger(__name__)

# Fronts this large only arise when many units are exactly tied at the LP multiplier (e.g. ΔKL
# proportional to bits saved), which makes the problem subset-sum-like; see ``Plan.extra``.
_MAX_FRONT = 200_000
_MAX_WORK = 20_000_000


@dataclass
class Unit:
    """One allocation unit.

    ``key`` identifies it (e.g. ``(layer, expert)``); ``n_weights`` counts its weights;
    ``costs_bits[fmt]`` is its stored size in bits in format ``fmt`` (scales included) and
    ``delta_kl[fmt]`` the measured ΔKL of quantizing it alone to ``fmt``.
    """

    key: tuple
    n_weights: int
    costs_bits: dict[str, int]
    delta_kl: dict[str, float]


@dataclass
class Plan:
    """The chosen format per unit and its totals (bits include scales).

    ``extra`` reports the search: ``binding`` (the budget constrained the plan), ``exact``
    (proven optimal), and when binding ``lambda`` (ΔKL per bit at the LP optimum),
    ``lower_bound`` (LP bound on ΔKL), ``gap_bound``, ``free_units`` and ``max_front``.
    """

    assignment: dict[tuple, str]
    total_bits: int
    avg_bits_per_weight: float
    predicted_delta_kl: float
    budget_bits: int = 0
    n_weights: int = 0
    extra: dict = field(default_factory=dict)


def unit_cost_bits(format_names: Iterable[str], matrices: Sequence[tuple[int, int]], *,
                   n: int = 1, scale_dtype_bytes: int = 2) -> dict[str, int]:
    """Stored bits per format of a unit made of ``[n, out, in]`` stacks, one per
    ``(out, in)`` in ``matrices`` (scales and shared pre-quant scales counted)."""

    out: dict[str, int] = {}
    for name in format_names:
        fmt = get_format(name)
        out[name] = 8 * sum(fmt.weight_bytes(o, i, n, scale_dtype_bytes) for o, i in matrices)
    return out


def _validate(units: Sequence[Unit]) -> None:
    if not units:
        raise InputError("no units to allocate")
    seen: set = set()
    for u in units:
        if u.key in seen:
            raise InputError(f"duplicate unit key {u.key!r}")
        seen.add(u.key)
        if not isinstance(u.n_weights, (int, np.integer)) or u.n_weights <= 0:
            raise InputError(f"unit {u.key!r}: n_weights must be a positive int, got {u.n_weights!r}")
        if not u.costs_bits:
            raise InputError(f"unit {u.key!r}: no candidate formats")
        if set(u.costs_bits) != set(u.delta_kl):
            raise InputError(
                f"unit {u.key!r}: costs_bits formats {sorted(u.costs_bits)} differ from "
                f"delta_kl formats {sorted(u.delta_kl)}")
        for fmt, c in u.costs_bits.items():
            if not isinstance(c, (int, np.integer)) or c <= 0:
                raise InputError(f"unit {u.key!r}: cost of {fmt!r} must be a positive int, got {c!r}")
        for fmt, v in u.delta_kl.items():
            if not math.isfinite(float(v)):
                raise InputError(f"unit {u.key!r}: delta_kl of {fmt!r} is not finite ({v!r})")


def feasible_bpw_range(units: Sequence[Unit]) -> tuple[float, float]:
    """(cheapest, most expensive) average bits per weight any plan can have."""
    _validate(units)
    w = sum(int(u.n_weights) for u in units)
    lo = sum(min(int(c) for c in u.costs_bits.values()) for u in units)
    hi = sum(max(int(c) for c in u.costs_bits.values()) for u in units)
    return lo / w, hi / w


def _budget_bits(budget_bpw: float, n_weights: int) -> int:
    # The decimal the caller wrote (shortest repr), times the weight count, floored; a relative
    # 1e-12 slack absorbs float noise in bpw values computed as bits / weights.
    try:
        b = Fraction(repr(float(budget_bpw)))  # nan / inf fail here
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"budget must be a finite number of bits per weight, got {budget_bpw!r}") from None
    return math.floor(b * n_weights * (1 + Fraction(1, 10**12)))


def allocate(units: Sequence[Unit], budget_bpw: float) -> Plan:
    """Minimise total ΔKL subject to total bits <= ``budget_bpw`` × total weights, exactly.

    Raises :class:`InputError` on malformed units or a budget outside the feasible range
    (cheapest plan … most expensive plan, in bits per weight).
    """
    lo_bpw, hi_bpw = feasible_bpw_range(units)  # validates the units
    n_w = sum(int(u.n_weights) for u in units)
    budget = _budget_bits(budget_bpw, n_w)
    lo_bits = sum(min(int(c) for c in u.costs_bits.values()) for u in units)
    hi_bits = sum(max(int(c) for c in u.costs_bits.values()) for u in units)
    if budget < lo_bits or budget_bpw > hi_bpw * (1 + 1e-12):
        raise InputError(
            f"budget {budget_bpw} bits/weight is outside the feasible range "
            f"[{lo_bpw:.4f}, {hi_bpw:.4f}] bits/weight for these units")
    if hi_bits >= 2**62:
        raise InputError("total cost does not fit in 62 bits; express costs in coarser units")

    solver = _Solver(units, budget)
    choice_idx = solver.solve()
    assignment = {}
    total = 0
    value = 0.0
    for i, u in enumerate(units):
        name = solver.names[i][choice_idx[i]]
        assignment[u.key] = name
        total += int(u.costs_bits[name])
        value += float(u.delta_kl[name])
    assert total <= budget
    return Plan(assignment=assignment, total_bits=total, avg_bits_per_weight=total / n_w,
                predicted_delta_kl=value, budget_bits=budget, n_weights=n_w,
                extra=solver.stats)


class _Solver:
    """The exact method described in the module docstring, on padded numpy arrays."""

    def __init__(self, units: Sequence[Unit], budget: int):
        self.budget = budget
        self.names: list[list[str]] = []
        costs: list[list[int]] = []
        vals: list[list[float]] = []
        for u in units:
            # Sort by (cost, value, name); keep a choice only if strictly better than all cheaper.
            items = sorted(((int(u.costs_bits[f]), float(u.delta_kl[f]), f) for f in u.costs_bits))
            kept: list[tuple[int, float, str]] = []
            for c, v, f in items:
                if not kept or v < kept[-1][1]:
                    kept.append((c, v, f))
            self.names.append([f for _, _, f in kept])
            costs.append([c for c, _, _ in kept])
            vals.append([v for _, v, _ in kept])
        n = len(units)
        k = max(len(c) for c in costs)
        self.n, self.k = n, k
        self.nchoice = np.array([len(c) for c in costs])
        self.valid = np.arange(k)[None, :] < self.nchoice[:, None]
        # Pad invalid slots with an impossible cost / infinite value.
        self.c = np.full((n, k), np.iinfo(np.int64).max // 4, dtype=np.int64)
        self.v = np.full((n, k), np.inf)
        for i in range(n):
            self.c[i, : len(costs[i])] = costs[i]
            self.v[i, : len(vals[i])] = vals[i]
        self.stats: dict = {}

    # -- helpers -----------------------------------------------------------------------------

    def _value(self, choice: np.ndarray) -> float:
        return float(self.v[np.arange(self.n), choice].sum())

    def _cost(self, choice: np.ndarray) -> int:
        return int(self.c[np.arange(self.n), choice].sum())

    def _lp(self):
        """Greedy LP relaxation on the per-unit convex hulls.

        Returns the LP multiplier λ (ΔKL per bit of the fractional hull segment) and an integer
        incumbent: the LP solution without its fractional segment, topped up greedily.
        """
        segs_u, segs_from, segs_to, segs_dc, segs_eff = [], [], [], [], []
        for i in range(self.n):
            m = int(self.nchoice[i])
            c, v = self.c[i, :m], self.v[i, :m]
            hull = [0]
            for j in range(1, m):
                # Pop the last hull point while it lies on or above the chord (not convex).
                while len(hull) >= 2:
                    a, b = hull[-2], hull[-1]
                    # slope(a→b) <= slope(a→j) in value-per-bit means b is not below the chord.
                    if (v[b] - v[a]) * (c[j] - c[a]) >= (v[j] - v[a]) * (c[b] - c[a]):
                        hull.pop()
                    else:
                        break
                hull.append(j)
            for a, b in zip(hull, hull[1:]):
                dc = int(c[b] - c[a])
                segs_u.append(i)
                segs_from.append(a)
                segs_to.append(b)
                segs_dc.append(dc)
                segs_eff.append((v[a] - v[b]) / dc)
        segs_u = np.array(segs_u, dtype=np.int64)
        segs_from = np.array(segs_from, dtype=np.int64)
        segs_to = np.array(segs_to, dtype=np.int64)
        segs_dc = np.array(segs_dc, dtype=np.int64)
        segs_eff = np.array(segs_eff)
        # Best value-per-bit first; a stable sort keeps each unit's hull segments in order.
        order = np.argsort(-segs_eff, kind="stable")
        choice = np.zeros(self.n, dtype=np.int64)
        cap = self.budget - self._cost(choice)
        lam = 0.0
        stop = len(order)
        csum = np.cumsum(segs_dc[order])
        # First segment that no longer fits whole: it is the fractional one.
        brk = int(np.searchsorted(csum, cap, side="right"))
        applied = order[:brk]
        for s in applied:  # hull segments of one unit come in order, so the last one wins
            choice[segs_u[s]] = segs_to[s]
        if brk < len(order):
            lam = float(segs_eff[order[brk]])
            stop = brk
        cap -= int(csum[brk - 1]) if brk > 0 else 0
        # Fill what is left with later segments that still fit (a cheap incumbent).
        for s in order[stop + 1:]:
            u = segs_u[s]
            if choice[u] == segs_from[s] and segs_dc[s] <= cap:
                choice[u] = segs_to[s]
                cap -= int(segs_dc[s])
        return lam, choice

    # -- main --------------------------------------------------------------------------------

    def solve(self) -> np.ndarray:
        n, budget = self.n, self.budget
        rows = np.arange(n)
        last = self.nchoice - 1  # the min-ΔKL choice (costliest kept) of each unit
        if self._cost(last) <= budget:
            self.stats = {"binding": False, "exact": True}
            return last

        lam, incumbent = self._lp()
        ub = self._value(incumbent)
        score = self.v + lam * self.c.astype(np.float64)
        score[~self.valid] = np.inf
        m = score.min(axis=1)
        lb = float(m.sum()) - lam * budget
        r = score - m[:, None]
        vscale = float(np.abs(np.where(self.valid, self.v, 0.0)).max(axis=1).sum())
        tol = 1e-9 * max(vscale, 1e-300)

        # Lagrangian choice per unit: r == 0, cheapest on ties; used to complete partial states.
        lag = np.where(r <= tol, np.arange(self.k)[None, :], self.k).min(axis=1)

        allowed = self.valid & (r <= (ub - lb) + tol)
        n_allowed = allowed.sum(axis=1)
        fixed = n_allowed == 1
        free = np.flatnonzero(~fixed)
        fixed_choice = np.where(fixed, allowed.argmax(axis=1), lag)
        # Least flexible units first: their alternatives are pruned soonest.
        second_r = np.sort(np.where(allowed, r, np.inf), axis=1)[:, 1] if self.k > 1 else np.zeros(n)
        free = free[np.argsort(-second_r[free], kind="stable")]

        base_cost = int(self.c[rows[fixed], fixed_choice[fixed]].sum())
        base_val = float(self.v[rows[fixed], fixed_choice[fixed]].sum())
        cmin_allowed = np.where(allowed, self.c, np.iinfo(np.int64).max // 4).min(axis=1)
        cmax_allowed = np.where(allowed, self.c, 0).max(axis=1)
        nf = len(free)
        # Suffix sums over the free units in processing order.
        suf_min_cost = np.zeros(nf + 1, dtype=np.int64)
        suf_max_cost = np.zeros(nf + 1, dtype=np.int64)
        suf_lag_cost = np.zeros(nf + 1, dtype=np.int64)
        suf_lag_val = np.zeros(nf + 1)
        for t in range(nf - 1, -1, -1):
            u = free[t]
            suf_min_cost[t] = suf_min_cost[t + 1] + cmin_allowed[u]
            suf_max_cost[t] = suf_max_cost[t + 1] + cmax_allowed[u]
            suf_lag_cost[t] = suf_lag_cost[t + 1] + self.c[u, lag[u]]
            suf_lag_val[t] = suf_lag_val[t + 1] + self.v[u, lag[u]]

        best_val = ub
        best_sol = ("incumbent", incumbent)

        s_cost = np.array([base_cost], dtype=np.int64)
        s_val = np.array([base_val])
        s_r = np.array([0.0])
        parents: list[np.ndarray] = []
        picks: list[np.ndarray] = []
        max_front = 1
        work = 0
        exact = True

        def try_complete(level: int) -> None:
            nonlocal best_val, best_sol
            cc = s_cost + suf_lag_cost[level]
            vv = s_val + suf_lag_val[level]
            ok = cc <= budget
            if ok.any():
                j = int(np.argmin(np.where(ok, vv, np.inf)))
                if vv[j] < best_val - 1e-15 * abs(best_val):
                    best_val = float(vv[j])
                    best_sol = ("complete", level, j)

        try_complete(0)
        for t in range(nf):
            u = free[t]
            js = np.flatnonzero(allowed[u])
            gap = best_val - lb
            nc = (s_cost[None, :] + self.c[u, js][:, None]).ravel()
            nv = (s_val[None, :] + self.v[u, js][:, None]).ravel()
            nr = (s_r[None, :] + r[u, js][:, None]).ravel()
            par = np.tile(np.arange(len(s_cost)), len(js))
            pick = np.repeat(js, len(s_cost))
            # A plan better than the incumbent has ΔKL = LB + Σr + λ·(budget - bits) <= UB, so it
            # needs Σr <= gap and leaves at most (gap - Σr) / λ bits of the budget unused.
            reach = (nc + suf_max_cost[t + 1]).astype(np.float64)
            keep = ((nr <= gap + tol) & (nc + suf_min_cost[t + 1] <= budget)
                    & (reach >= budget - (gap + tol - nr) / lam - 1.0))
            nc, nv, nr, par, pick = nc[keep], nv[keep], nr[keep], par[keep], pick[keep]
            # Pareto filter: sorted by (cost, value), keep strictly better than everything cheaper.
            o = np.lexsort((nv, nc))
            nc, nv, nr, par, pick = nc[o], nv[o], nr[o], par[o], pick[o]
            prev_min = np.concatenate(([np.inf], np.minimum.accumulate(nv)[:-1]))
            keep = nv < prev_min
            s_cost, s_val, s_r = nc[keep], nv[keep], nr[keep]
            parents.append(par[keep].astype(np.int32))
            picks.append(pick[keep].astype(np.int8))
            max_front = max(max_front, len(s_cost))
            work += len(s_cost)
            try_complete(t + 1)
            if len(s_cost) > _MAX_FRONT or work > _MAX_WORK:
                exact = False
                break

        def backtrack(level: int, j: int) -> np.ndarray:
            choice = fixed_choice.copy()
            for t in range(nf - 1, level - 1, -1):
                choice[free[t]] = lag[free[t]]
            for t in range(level - 1, -1, -1):
                choice[free[t]] = picks[t][j]
                j = int(parents[t][j])
            return choice

        # At the last level every state is a complete feasible plan; completion above already
        # compared the cheapest-best of them against the incumbent.
        if best_sol[0] == "complete":
            sol = backtrack(best_sol[1], best_sol[2])
        else:
            sol = best_sol[1]
        # ΔKL(plan) - LB bounds how far any plan could improve on this one.
        self.stats = {"binding": True, "exact": exact, "lambda": lam, "lower_bound": lb,
                      "gap_bound": best_val - lb, "free_units": nf, "max_front": max_front}
        if not exact:
            log.warning(
                "allocation: %d near-tied units make the exact search subset-sum-like; "
                "returning the best plan found, at most %.3g ΔKL above the optimum", nf,
                best_val - lb)
        assert self._cost(sol) <= budget
        return sol
