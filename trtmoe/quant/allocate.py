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
        """Step 1: each unit's choices without the dominated ones, as padded [unit, choice] arrays
        of bits ``c`` and ΔKL ``v`` (cheapest first)."""
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
        """Step 2, the relaxation: greedy LP on the per-unit convex hulls.

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
            prev = np.inf
            for a, b in zip(hull, hull[1:]):
                dc = int(c[b] - c[a])
                segs_u.append(i)
                segs_from.append(a)
                segs_to.append(b)
                segs_dc.append(dc)
                # A convex hull's efficiencies fall segment by segment; on (nearly) collinear points
                # the division can round a later one above an earlier one, and the greedy below would
                # then apply it first. Clamp to the unit's running minimum so they stay in order.
                prev = min(prev, (v[a] - v[b]) / dc)
                segs_eff.append(prev)
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

    def _lagrangian_bound(self, lam: float) -> _Bound:
        """Step 2, the bound: price every choice at the LP multiplier (``v + λ c``). The cheapest
        price per unit, summed, less ``λ · budget`` is the lower bound ``LB`` on any plan's ΔKL;
        each choice's excess over its unit's cheapest price is its reduced cost ``r``."""
        score = self.v + lam * self.c.astype(np.float64)
        score[~self.valid] = np.inf
        m = score.min(axis=1)
        lb = float(m.sum()) - lam * self.budget
        r = score - m[:, None]
        vscale = float(np.abs(np.where(self.valid, self.v, 0.0)).max(axis=1).sum())
        tol = 1e-9 * max(vscale, 1e-300)
        # Lagrangian choice per unit: r == 0, cheapest on ties; used to complete partial states.
        lag = np.where(r <= tol, np.arange(self.k)[None, :], self.k).min(axis=1)
        return _Bound(lam=lam, lb=lb, r=r, tol=tol, lag=lag)

    def _fix_units(self, b: _Bound, ub: float) -> _Reduced:
        """Step 3: keep only the choices whose reduced cost fits in the gap ``UB - LB``; a unit left
        with one choice is fixed to it. The free units are ordered least flexible first (largest
        second-smallest reduced cost), and per position the suffix sums the search prunes with are
        taken: the cheapest and costliest allowed bits, and the Lagrangian choices' bits and ΔKL."""
        n = self.n
        rows = np.arange(n)
        allowed = self.valid & (b.r <= (ub - b.lb) + b.tol)
        n_allowed = allowed.sum(axis=1)
        fixed = n_allowed == 1
        free = np.flatnonzero(~fixed)
        fixed_choice = np.where(fixed, allowed.argmax(axis=1), b.lag)
        # Least flexible units first: their alternatives are pruned soonest.
        second_r = np.sort(np.where(allowed, b.r, np.inf), axis=1)[:, 1] if self.k > 1 else np.zeros(n)
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
            suf_lag_cost[t] = suf_lag_cost[t + 1] + self.c[u, b.lag[u]]
            suf_lag_val[t] = suf_lag_val[t + 1] + self.v[u, b.lag[u]]
        return _Reduced(allowed=allowed, fixed_choice=fixed_choice, free=free, base_cost=base_cost,
                        base_val=base_val, suf_min_cost=suf_min_cost, suf_max_cost=suf_max_cost,
                        suf_lag_cost=suf_lag_cost, suf_lag_val=suf_lag_val)

    def _complete(self, search: _Search, red: _Reduced, front: _Front, level: int) -> None:
        """Complete every state of ``front`` (the first ``level`` free units chosen) with the
        remaining units' Lagrangian choices; the best feasible completion replaces the incumbent
        when it is better."""
        cc = front.cost + red.suf_lag_cost[level]
        vv = front.val + red.suf_lag_val[level]
        ok = cc <= self.budget
        if ok.any():
            j = int(np.argmin(np.where(ok, vv, np.inf)))
            if vv[j] < search.best_val - 1e-15 * abs(search.best_val):
                search.best_val = float(vv[j])
                search.best = ("complete", level, j)

    def _extend(self, b: _Bound, red: _Reduced, front: _Front, t: int, gap: float) -> _Front:
        """Every state of ``front`` times every allowed choice of the ``t``-th free unit, less the
        states that cannot lead to a plan better than the incumbent (``gap = UB - LB``) or within
        the budget. ``parent``/``pick`` record each new state's origin and choice."""
        budget = self.budget
        u = red.free[t]
        js = np.flatnonzero(red.allowed[u])
        nc = (front.cost[None, :] + self.c[u, js][:, None]).ravel()
        nv = (front.val[None, :] + self.v[u, js][:, None]).ravel()
        nr = (front.r[None, :] + b.r[u, js][:, None]).ravel()
        par = np.tile(np.arange(len(front.cost)), len(js))
        pick = np.repeat(js, len(front.cost))
        # A plan better than the incumbent has ΔKL = LB + Σr + λ·(budget - bits) <= UB, so it
        # needs Σr <= gap and leaves at most (gap - Σr) / λ bits of the budget unused.
        reach = (nc + red.suf_max_cost[t + 1]).astype(np.float64)
        keep = ((nr <= gap + b.tol) & (nc + red.suf_min_cost[t + 1] <= budget)
                & (reach >= budget - (gap + b.tol - nr) / b.lam - 1.0))
        return _Front(nc[keep], nv[keep], nr[keep], par[keep], pick[keep])

    @staticmethod
    def _pareto(front: _Front) -> _Front:
        """The states no other state dominates: sorted by (bits, ΔKL), each kept only if strictly
        better than every cheaper one."""
        o = np.lexsort((front.val, front.cost))
        nc, nv, nr, par, pick = front.cost[o], front.val[o], front.r[o], front.parent[o], front.pick[o]
        prev_min = np.concatenate(([np.inf], np.minimum.accumulate(nv)[:-1]))
        keep = nv < prev_min
        return _Front(nc[keep], nv[keep], nr[keep], par[keep], pick[keep])

    def _search(self, b: _Bound, red: _Reduced, ub: float, incumbent: np.ndarray) -> _Search:
        """Step 4: the sparse dynamic programme over the free units, in order, on (bits, ΔKL)
        states: extend, prune by the bound and the budget, keep the Pareto front, and try each
        front's completion against the incumbent. Stops, not exact, past the state limits."""
        search = _Search(best_val=ub, best=("incumbent", incumbent))
        front = _Front(cost=np.array([red.base_cost], dtype=np.int64), val=np.array([red.base_val]),
                       r=np.array([0.0]), parent=np.zeros(0, dtype=np.int64), pick=np.zeros(0, dtype=np.int64))
        work = 0
        self._complete(search, red, front, 0)
        for t in range(len(red.free)):
            front = self._pareto(self._extend(b, red, front, t, gap=search.best_val - b.lb))
            search.parents.append(front.parent.astype(np.int32))
            search.picks.append(front.pick.astype(np.int8))
            search.max_front = max(search.max_front, len(front.cost))
            work += len(front.cost)
            self._complete(search, red, front, t + 1)
            if len(front.cost) > _MAX_FRONT or work > _MAX_WORK:
                search.exact = False
                break
        return search

    def _plan(self, b: _Bound, red: _Reduced, search: _Search) -> np.ndarray:
        """Step 4, the answer: the best plan found. A completed state is rebuilt by walking its
        parents back through the levels (fixed units keep their choice, units after its level their
        Lagrangian one); otherwise the incumbent stands."""
        if search.best[0] != "complete":
            return search.best[1]
        _, level, j = search.best
        free = red.free
        choice = red.fixed_choice.copy()
        for t in range(len(free) - 1, level - 1, -1):
            choice[free[t]] = b.lag[free[t]]
        for t in range(level - 1, -1, -1):
            choice[free[t]] = search.picks[t][j]
            j = int(search.parents[t][j])
        return choice

    # -- main --------------------------------------------------------------------------------

    def solve(self) -> np.ndarray:
        """The choice index per unit of an optimal plan (or of the best found past the state
        limits), with ``self.stats`` describing the search; the steps of the module docstring."""
        last = self.nchoice - 1  # the min-ΔKL choice (costliest kept) of each unit
        if self._cost(last) <= self.budget:
            self.stats = {"binding": False, "exact": True}
            return last
        lam, incumbent = self._lp()
        ub = self._value(incumbent)
        bound = self._lagrangian_bound(lam)
        reduced = self._fix_units(bound, ub)
        search = self._search(bound, reduced, ub, incumbent)
        # At the last level every state is a complete feasible plan; completion already
        # compared the cheapest-best of them against the incumbent.
        sol = self._plan(bound, reduced, search)
        nf, gap = len(reduced.free), search.best_val - bound.lb
        # ΔKL(plan) - LB bounds how far any plan could improve on this one.
        self.stats = {"binding": True, "exact": search.exact, "lambda": lam, "lower_bound": bound.lb,
                      "gap_bound": gap, "free_units": nf, "max_front": search.max_front}
        if not search.exact:
            log.warning(
                "allocation: %d near-tied units make the exact search subset-sum-like; "
                "returning the best plan found, at most %.3g ΔKL above the optimum", nf, max(gap, 0.0))
        assert self._cost(sol) <= self.budget
        return sol


@dataclass
class _Bound:
    """The Lagrangian relaxation at the LP multiplier ``lam`` (ΔKL per bit)."""

    lam: float
    lb: float  # lower bound on any plan's ΔKL
    r: np.ndarray  # [n, k] reduced cost of each choice (inf for padding)
    tol: float  # ties within this count as equal
    lag: np.ndarray  # [n] each unit's Lagrangian choice (reduced cost 0, cheapest on ties)


@dataclass
class _Reduced:
    """What the bound leaves to search: the allowed choices, the free units in search order, the
    fixed units' totals, and suffix sums over the free units (position t: units t.. of ``free``)."""

    allowed: np.ndarray  # [n, k]
    fixed_choice: np.ndarray  # [n] the only allowed choice of a fixed unit, the Lagrangian one of a free unit
    free: np.ndarray  # free unit indices, least flexible first
    base_cost: int  # bits of the fixed units
    base_val: float  # ΔKL of the fixed units
    suf_min_cost: np.ndarray
    suf_max_cost: np.ndarray
    suf_lag_cost: np.ndarray
    suf_lag_val: np.ndarray


@dataclass
class _Front:
    """Partial plans after some free units: bits, ΔKL and Σ reduced cost per state, with the index
    of the state each came from (``parent``) and the choice it added (``pick``)."""

    cost: np.ndarray
    val: np.ndarray
    r: np.ndarray
    parent: np.ndarray
    pick: np.ndarray


@dataclass
class _Search:
    """The search's result: the best value and where it is (``("incumbent", choice)`` or
    ``("complete", level, state)``), the per-level parent/pick arrays to rebuild it, the largest
    front and whether the search finished (then the plan is optimal)."""

    best_val: float
    best: tuple
    parents: list[np.ndarray] = field(default_factory=list)
    picks: list[np.ndarray] = field(default_factory=list)
    max_front: int = 1
    exact: bool = True
