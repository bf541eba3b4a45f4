"""``trtmoe report``: the quantization report as JSON and as one self-contained HTML page.

Every plot is a matplotlib PNG (Agg backend, no display needed) embedded as a base64 data URI, so
the page is a single file that can be mailed or archived. ``build_report`` assembles the JSON from
the calibration, the evaluations of quantized checkpoints and optional benchmark results;
``render`` writes ``report.json``, the PNGs and ``report.html``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

from ..quant.calibrate import cost_summary, phase_order, seconds
from ..quant.formats import BY_BITS, FORMATS, QUANTIZED

__all__ = ["build_report", "render", "curve_from_bench", "curve_from_evaluations", "FORMAT_COLORS"]

# One colour per storage format, ordered from most to fewest bits: what each format says of itself.
FORMAT_ORDER = ["float", *BY_BITS]
_LOOK = {"float": FORMATS["fp16"], **{n: FORMATS[n] for n in QUANTIZED}}
FORMAT_COLORS = {n: f.color for n, f in _LOOK.items()}
FORMAT_LABELS = {n: f.label for n, f in _LOOK.items()}
FORMAT_SHORT = {n: f.short for n, f in _LOOK.items()}
SERIES_STYLE = {  # curve series -> (colour, marker, line)
    "graded (matrix)": ("#0d47a1", "*", "-"),
    "graded +int4 (matrix)": ("#6a1b9a", "*", ":"),
    "graded (expert)": ("#1b5e20", "o", "-"),
    "graded +int4 (expert)": ("#00838f", "o", ":"),
    "graded (layer)": ("#2e7d32", "s", "--"),
    "frequency-bytes (matrix)": ("#bf360c", "<", "-"),
    "random-bytes (matrix)": ("#424242", ">", "-"),
    "frequency-bytes +int4 (matrix)": ("#ff8a65", "<", ":"),
    "random-bytes +int4 (matrix)": ("#9e9e9e", ">", ":"),
    "frequency-bytes (expert)": ("#ef6c00", "^", "-"),
    "random-bytes (expert)": ("#757575", "v", "-"),
    "frequency-bytes +int4 (expert)": ("#ffa726", "^", ":"),
    "random-bytes +int4 (expert)": ("#bdbdbd", "v", ":"),
    "frequency tiers": ("#ad1457", "P", ""),
    **{f"uniform {n}": (FORMAT_COLORS[n], "D", "") for n in QUANTIZED},
}


# ---- assembling the report ----------------------------------------------------------------------------
def _lowest_bit_format(calib: dict) -> str:
    bpw = calib["bits_per_weight"]
    return min(calib["formats"], key=lambda f: bpw[f])


def _cost_sentence(cal: dict) -> str:
    """What the calibration cost: the measured figure when calib.cost.json recorded one, else the
    multiply-accumulate estimate calib.json keeps (which leaves the quantization searches out)."""
    cost = cal.get("cost")
    if cost:
        phases = ", ".join(f"{k} {seconds(v[cost['unit']])}" for k, v in phase_order(cost["phases"]))
        unit = "CPU-s" if cost["unit"] == "cpu_seconds" else "s"
        return html.escape(f"{cost['summary'][0].upper()}{cost['summary'][1:]} (by phase, {unit}: {phases}).")
    if cal.get("cost_forward_passes"):
        return (f"Sensitivity cost estimated at {cal['cost_forward_passes']:.1f} forward passes of "
                "multiply-accumulates (the quantization searches not counted; no measured cost was recorded).")
    return "No cost was recorded."


def _calib_summary(calib: dict, cost: dict | None = None) -> dict:
    r = calib["routing"]
    low = _lowest_bit_format(calib)
    layers = calib["moe_layers"]
    return {
        "model": calib.get("model"), "data": calib.get("data"),
        "num_layers": calib["num_layers"], "num_experts": calib["num_experts"], "top_k": calib["top_k"],
        "moe_layers": layers, "formats": calib["formats"], "bits_per_weight": calib["bits_per_weight"],
        "tokens": r["tokens"], "share": r["share"], "counts": r["counts"],
        "min_tokens_threshold": r["min_tokens_threshold"],
        "min_routed_tokens": {str(l): int(min(r["counts"][l])) for l in layers},
        "under_observed": r["under_observed"], "dead": r["dead"],
        "load_imbalance": r["load_imbalance"], "entropy_nats": r["entropy_nats"],
        "max_entropy_nats": r["max_entropy_nats"],
        # An expert's sensitivity is the sum of its two matrices' ΔKL (fc + proj), as the allocator uses it.
        "sensitivity_format": low, "sensitivity": calib["sensitivity"]["delta_kl"][low],
        "sensitivity_all": calib["sensitivity"]["delta_kl"],
        "sensitivity_matrices": {m: d["delta_kl"][low] for m, d in calib["sensitivity"]["matrices"].items()},
        "cost_forward_passes": calib["sensitivity"].get("cost_forward_passes"),
        # What the calibration measured (calib.cost.json), when it recorded it.
        "cost": None if cost is None else {
            "summary": cost_summary(cost), "unit": cost["unit"], "device": cost["device"],
            "total": cost["total"], "forward": cost.get("forward"), "ratio_to_forward": cost.get("ratio_to_forward"),
            "phases": cost["phases"]},
    }


def curve_from_bench(bench: dict) -> dict[str, list[dict]]:
    """KL-versus-bits series from a ``scripts/bench_quant.py --out`` JSON: one list of points per
    policy, sorted by bits; points of the same policy and budget (random seeds) are averaged."""
    groups: dict[tuple, list[dict]] = {}
    for row in bench.get("rows", []):
        groups.setdefault((row["policy"], row.get("budget")), []).append(row)
    series: dict[str, list[dict]] = {}
    for (pol, budget), rows in groups.items():
        n = len(rows)
        mean = sum(r["kl_mean"] for r in rows) / n
        spread = math.sqrt(sum((r["kl_mean"] - mean) ** 2 for r in rows) / (n - 1)) if n > 1 else None
        series.setdefault(pol, []).append({
            "budget": budget, "bpw": sum(r["bpw"] for r in rows) / n, "kl_mean": mean,
            "kl_stderr": sum(r.get("kl_stderr", 0.0) for r in rows) / n, "seed_std": spread, "n": n})
    for pts in series.values():
        pts.sort(key=lambda p: p["bpw"])
    return series


def bench_table(bench: dict) -> list[dict]:
    """Benchmark rows with random seeds averaged: one row per (budget, policy), sorted by budget."""
    keys = ("bpw", "kl_mean", "kl_p999", "same_top1", "topk_agreement", "topk_agreement_min")
    groups: dict[tuple, list[dict]] = {}
    for r in bench.get("rows", []):
        if all(k in r for k in keys):
            groups.setdefault((r.get("budget"), r["policy"]), []).append(r)
    out = []
    for (b, pol), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] or 0.0, kv[0][1])):
        seeds = f" (mean of {len(rs)} seeds)" if len(rs) > 1 else ""
        row = {"budget": "—" if b is None else b, "policy": pol + seeds}
        row.update({k: sum(r[k] for r in rs) / len(rs) for k in keys})
        out.append(row)
    return out


def curve_from_evaluations(evals: list[dict]) -> dict[str, list[dict]]:
    """One point per evaluated checkpoint, grouped by its recorded policy."""
    series: dict[str, list[dict]] = {}
    for ev in evals:
        plan = ev.get("plan") or {}
        pol = plan.get("policy") or ev["name"]
        if pol == "graded":
            pol = f"graded ({plan.get('granularity', 'expert')})"
        elif pol.startswith("uniform-"):
            pol = "uniform " + pol[len("uniform-"):]
        elif pol == "frequency-tiers":
            pol = "frequency tiers"
        series.setdefault(pol, []).append({"budget": plan.get("budget_bpw"), "bpw": ev["expert_bpw"],
                                           "kl_mean": ev["kl"]["mean"], "kl_stderr": ev["kl"]["stderr"],
                                           "name": ev["name"], "n": 1})
    for pts in series.values():
        pts.sort(key=lambda p: p["bpw"])
    return series


def build_report(*, calib: dict | None, reference: dict | None, evaluations: list[dict],
                 bench: dict | None = None, heldout: dict | None = None, warnings: list[str] | None = None,
                 moves: dict | None = None, what_ifs: dict | None = None, calib_cost: dict | None = None) -> dict:
    """The report as a JSON-serialisable dict (what ``report.json`` holds); ``calib_cost`` is the
    calibration's calib.cost.json, when it has one."""
    return {
        "version": 1,
        "calibration": _calib_summary(calib, calib_cost) if calib else None,
        "reference": reference,
        "heldout": heldout,
        "evaluations": evaluations,
        "curve": {"inputs": curve_from_evaluations(evaluations),
                  "bench": curve_from_bench(bench) if bench else None,
                  "bench_targets": (bench or {}).get("targets"),
                  "bench_rows": bench_table(bench) if bench else None},
        "warnings": list(warnings or []),
        "moves": moves,
        "router_what_ifs": what_ifs,
    }


# ---- plots --------------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "figure.dpi": 110, "savefig.bbox": "tight"})
    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    _plt().close(fig)
    return buf.getvalue()


def _grid(rows: list[list[float]], layers: list[int]) -> list[list[float]]:
    return [rows[l] for l in layers]


def _annotate(ax, data, fmt, dark):
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            if v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            ax.text(j, i, fmt(v), ha="center", va="center", fontsize=7,
                    color="white" if dark(v) else "black")


def _expert_axes(ax, E: int, layers: list[int]) -> None:
    ax.set_xticks(range(E))
    ax.set_xticklabels([str(e) for e in range(E)] if E <= 32 else
                       [str(e) if e % max(1, E // 16) == 0 else "" for e in range(E)])
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels([str(l) for l in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")


def plot_share(cal: dict) -> bytes:
    plt = _plt()
    layers, E = cal["moe_layers"], cal["num_experts"]
    data = [[100 * v for v in row] for row in _grid(cal["share"], layers)]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * E + 2), max(2.5, 0.45 * len(layers) + 1.4)))
    vmax = max(max(r) for r in data) or 1.0
    im = ax.imshow(data, cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
    if E <= 32:
        _annotate(ax, data, lambda v: f"{v:.1f}", lambda v: v < 0.6 * vmax)
    _expert_axes(ax, E, layers)
    under = {(u["layer"], u["expert"]) for u in cal["under_observed"]}
    for (l, e) in under:
        ax.add_patch(_rect(e, layers.index(l)))
    fig.colorbar(im, ax=ax, label=f"% of top-{cal['top_k']} assignments")
    ax.set_title(f"Routed-token share per expert ({cal['tokens']} calibration tokens; uniform = {100 / E:.1f}%)"
                 + ("; red box: under-observed" if under else ""))
    return _png(fig)


def _rect(x, y):
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2)


def plot_sensitivity(cal: dict) -> bytes:
    plt = _plt()
    from matplotlib.colors import LogNorm

    layers, E = cal["moe_layers"], cal["num_experts"]
    data = _grid(cal["sensitivity"], layers)
    pos = [v for row in data for v in row if v > 0]
    lo, hi = (min(pos), max(pos)) if pos else (1e-6, 1e-5)
    if hi <= lo:
        hi = lo * 10
    shown = [[v if v > 0 else float("nan") for v in row] for row in data]
    mats = cal.get("sensitivity_matrices")
    w, h = max(5.0, 0.55 * E + 2), max(2.5, 0.45 * len(layers) + 1.4)
    fig, axes = plt.subplots(1, 2 if mats else 1, figsize=(w * (2 if mats else 1), h), squeeze=False)
    ax = axes[0][0]
    im = ax.imshow(shown, cmap="magma_r", norm=LogNorm(vmin=lo, vmax=hi), aspect="auto")
    if E <= 32:
        mid = math.sqrt(lo * hi)
        _annotate(ax, shown, lambda v: f"{v:.1e}".replace("e-0", "e-"), lambda v: v > mid)
    _expert_axes(ax, E, layers)
    for u in cal["under_observed"]:
        ax.add_patch(_rect(u["expert"], layers.index(u["layer"])))
    fig.colorbar(im, ax=ax, label="ΔKL (nats / token), log scale")
    ax.set_title(f"Expert ΔKL = fc + proj, each alone in {cal['sensitivity_format']} (lowest-bit candidate)"
                 + ("\nred box: under-observed, ΔKL partly estimated" if cal["under_observed"] else ""))
    if mats:
        # proj is a third of an expert's weights; its share of the ΔKL says where bits pay off.
        share = [[(p / (f + p)) if f + p > 0 else float("nan") for f, p in zip(mats["fc"][l], mats["proj"][l])]
                 for l in layers]
        ax2 = axes[0][1]
        im2 = ax2.imshow(share, cmap="coolwarm", vmin=0, vmax=1, aspect="auto")
        if E <= 32:
            _annotate(ax2, share, lambda v: f"{v:.2f}", lambda v: v < 0.15 or v > 0.85)
        _expert_axes(ax2, E, layers)
        fig.colorbar(im2, ax=ax2, label="proj ΔKL / (fc ΔKL + proj ΔKL)")
        ax2.set_title("proj's share of the expert's ΔKL (proj holds 1/3 of its weights)")
    return _png(fig)


def _format_panels(ev: dict) -> list[tuple[str, dict[str, list[str]]]]:
    """(title suffix, {layer: [format per expert]}) per heatmap panel: two (fc, proj) when the
    evaluated plan gives an expert's matrices different formats, else one."""
    mf = ev.get("matrix_formats")
    if mf and (mf["fc"] != mf["proj"] or (ev.get("plan") or {}).get("granularity") == "matrix"):
        return [("fc = [up; gate]", mf["fc"]), ("proj = down", mf["proj"])]
    return [("", mf["fc"] if mf else ev["formats"])]


def plot_formats(evals: list[dict], layers: list[int], E: int) -> bytes | None:
    plt = _plt()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    # Rows of two panels; a per-matrix plan gets a row of its own, fc beside proj.
    rows_of: list[list[tuple]] = []
    for ev in evals:
        if not (ev.get("formats") or ev.get("matrix_formats")):
            continue
        panels = [(ev, sub, grid) for sub, grid in _format_panels(ev)]
        if len(panels) == 1 and rows_of and len(rows_of[-1]) == 1 and len(_format_panels(rows_of[-1][0][0])) == 1:
            rows_of[-1].append(panels[0])
        else:
            rows_of.append(panels)
    if not rows_of:
        return None
    cols = max(len(r) for r in rows_of)
    rows = len(rows_of)
    w = max(4.5, 0.45 * E + 1.5)
    h = max(1.8, 0.4 * len(layers) + 1.0)
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows + 0.6), squeeze=False)
    cmap = ListedColormap([FORMAT_COLORS[f] for f in FORMAT_ORDER])
    used = set()
    placed = [(axes[i][j], p) for i, r in enumerate(rows_of) for j, p in enumerate(r)]
    for ax, (ev, sub, fmts) in placed:
        grid = [[FORMAT_ORDER.index(f) for f in fmts[str(l)]] for l in layers]
        used |= {f for l in layers for f in fmts[str(l)]}
        ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(FORMAT_ORDER) - 0.5, aspect="auto")
        if E <= 32:
            _annotate(ax, grid, lambda v: FORMAT_SHORT[FORMAT_ORDER[v]], lambda v: True)
        _expert_axes(ax, E, layers)
        ax.set_title(f"{ev['name']}{': ' + sub if sub else ''} ({ev['expert_bpw']:.3f} bpw)", fontsize=10)
    for i, r in enumerate(rows_of):
        for j in range(len(r), cols):
            axes[i][j].axis("off")
    fig.legend(handles=[Patch(color=FORMAT_COLORS[f], label=FORMAT_LABELS[f]) for f in FORMAT_ORDER if f in used],
               loc="lower center", ncol=4, bbox_to_anchor=(0.5, -0.02), frameon=False)
    fig.suptitle("Assigned format per expert (original expert ids; per-matrix plans: fc and proj panels)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _png(fig)


def plot_curve(curve: dict) -> bytes | None:
    plt = _plt()
    bench, inputs = curve.get("bench") or {}, curve.get("inputs") or {}
    if not bench and not inputs:
        return None
    fig, ax = plt.subplots(figsize=(10, 5.5))
    order = list(SERIES_STYLE)
    for name, pts in sorted(bench.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
        pts = [p for p in pts if p["kl_mean"] > 0]
        if not pts:
            continue
        c, m, ls = SERIES_STYLE.get(name, ("#333333", "o", "-"))
        xs, ys = [p["bpw"] for p in pts], [p["kl_mean"] for p in pts]
        err = [p["seed_std"] or p["kl_stderr"] for p in pts]
        ax.errorbar(xs, ys, yerr=err, color=c, marker=m, linestyle=ls or "none", capsize=3, markersize=6,
                    label=name + (f" (mean of {pts[0]['n']} seeds)" if pts[0]["n"] > 1 else ""))
    for name, pts in inputs.items():
        for p in pts:
            if p["kl_mean"] <= 0:
                continue
            ax.scatter([p["bpw"]], [p["kl_mean"]], s=140, facecolors="none", edgecolors="black", linewidths=1.5,
                       zorder=5)
            ax.annotate(p["name"], (p["bpw"], p["kl_mean"]), textcoords="offset points", xytext=(8, 6),
                        fontsize=8)
    ax.scatter([], [], s=140, facecolors="none", edgecolors="black", label="checkpoints in this report")
    ax.set_yscale("log")
    ax.set_xlabel("average bits per routed-expert weight (scales counted)")
    ax.set_ylabel("mean KL(p_ref ‖ p_quant), nats / token (log)")
    ax.set_title("Held-out KL versus bits: graded plans (per expert matrix, per expert, per layer) "
                 "against the baselines")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _png(fig)


def plot_router(evals: list[dict]) -> bytes | None:
    plt = _plt()
    if not evals:
        return None
    layers = sorted(int(l) for l in evals[0]["router"]["layers"])
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(layers) * max(1, len(evals)) / 2 + 3), 4))
    n = len(evals)
    width = 0.8 / n
    lo = 1.0
    for i, ev in enumerate(evals):
        vals = [100 * ev["router"]["layers"][str(l)]["topk_set_agreement"] for l in layers]
        lo = min(lo, min(vals) / 100)
        ax.bar([k + (i - (n - 1) / 2) * width for k in range(len(layers))], vals, width, label=ev["name"])
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels([str(l) for l in layers])
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("tokens with identical top-k set, %")
    ax.set_ylim(max(0, 100 * lo - 5), 100.5)
    ax.axhline(97, color="red", linestyle=":", linewidth=1, label="97% target")
    ax.set_title("Router top-k set agreement with the reference, per layer")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(True, axis="y", alpha=0.3)
    return _png(fig)


def plot_min_tokens(cal: dict) -> bytes:
    plt = _plt()
    layers = cal["moe_layers"]
    counts = cal["counts"]
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(layers) + 3), 3.6))
    mins = [min(counts[l]) for l in layers]
    meds = [sorted(counts[l])[len(counts[l]) // 2] for l in layers]
    x = list(range(len(layers)))
    ax.bar([k - 0.2 for k in x], mins, 0.4, label="least-routed expert", color="#c44e52")
    ax.bar([k + 0.2 for k in x], meds, 0.4, label="median expert", color="#4c72b0")
    for k, v, m in zip(x, mins, meds):
        ax.text(k - 0.2, v, str(v), ha="center", va="bottom", fontsize=8)
        ax.text(k + 0.2, m, str(m), ha="center", va="bottom", fontsize=8)
    ax.axhline(cal["min_tokens_threshold"], color="black", linestyle="--", linewidth=1,
               label=f"under-observed threshold ({cal['min_tokens_threshold']})")
    ax.set_yscale("symlog", linthresh=1)  # zero-count (dead) experts stay visible
    ax.set_ylim(0, max(meds + mins + [cal["min_tokens_threshold"]]) * 3)
    ax.set_xticks(x)
    ax.set_xticklabels([str(l) for l in layers])
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("routed calibration tokens")
    ax.set_title("Calibration coverage: routed tokens per expert")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _png(fig)


def plot_bytes(reference: dict | None, evals: list[dict]) -> bytes | None:
    plt = _plt()
    entries = ([("reference", reference["footprint"])] if reference and reference.get("footprint") else []) + [
        (ev["name"], ev["footprint"]) for ev in evals]
    if not entries:
        return None
    ranks = max(len(fp["ranks"]) for _, fp in entries)
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(entries) * ranks + 3), 4))
    width = 0.8 / ranks
    for r in range(ranks):
        xs = [i + (r - (ranks - 1) / 2) * width for i in range(len(entries))]
        other = [(fp["ranks"][r]["deployed_bytes"] - fp["ranks"][r]["routed_expert_bytes"]) / 2**20
                 if r < len(fp["ranks"]) else 0 for _, fp in entries]
        exp = [fp["ranks"][r]["routed_expert_bytes"] / 2**20 if r < len(fp["ranks"]) else 0 for _, fp in entries]
        ax.bar(xs, other, width, color="#9e9e9e", label="non-expert weights" if r == 0 else None)
        ax.bar(xs, exp, width, bottom=other, color="#4c72b0", label="routed experts" if r == 0 else None)
        if ranks > 1:
            for x, o, e in zip(xs, other, exp):
                ax.text(x, o + e, f"r{r}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(entries)))
    ax.set_xticklabels([n for n, _ in entries], rotation=20, ha="right")
    ax.set_ylabel("MiB per rank (deployed)")
    ax.set_title("Bytes per rank")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return _png(fig)


def plot_moves(moves: dict) -> bytes | None:
    """Expert coverage and bytes read per decode step against batch size (measured and uniform)."""
    if not moves or not moves.get("batches"):
        return None
    plt = _plt()
    bs = [r["batch"] for r in moves["batches"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("measured", "-o"), ("uniform", "--s")):
        if name not in moves["batches"][0]:
            continue
        a.plot(bs, [100 * r[name]["expert_coverage"] for r in moves["batches"]], style, label=f"{name} routing")
    a.set_xscale("log", base=2)
    a.set_xlabel("decode batch (streams)")
    a.set_ylabel("experts read per step, % of each layer's")
    a.set_ylim(0, 105)
    a.set_title("Expert coverage per decode step")
    a.grid(True, alpha=0.3)
    a.legend(fontsize=8)
    rows = [r.get("measured") or r["uniform"] for r in moves["batches"]]
    mib = 2 ** 20
    b.plot(bs, [r["nonexpert_bytes"] / mib for r in rows], ":", color="#757575", label="other weights")
    b.plot(bs, [r["expert_bytes"] / mib for r in rows], "-o", color="#4c72b0", label="experts read (reference)")
    b.plot(bs, [r["kv_bytes"] / mib for r in rows], "-.", color="#dd8452",
           label=f"KV cache ({moves['context']} tokens / stream)")
    for ck in (moves.get("checkpoints") or [])[1:]:
        b.plot(bs, [x / mib for x in ck["bytes_per_step"]], "-", linewidth=1, label=f"weights: {ck['name']}")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("decode batch (streams)")
    b.set_ylabel("MiB read per step")
    b.set_title("Bytes read per decode step (measured routing)")
    b.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def plot_what_ifs(wi: dict) -> bytes | None:
    """Held-out KL and the dropped / re-routed shares of each router what-if."""
    if not wi or not wi.get("what_ifs"):
        return None
    plt = _plt()
    rows = wi["what_ifs"]
    names = [r["name"] for r in rows]
    x = list(range(len(rows)))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(x, [r["kl"]["mean"] for r in rows], yerr=[r["kl"]["stderr"] for r in rows], color="#8172b3", capsize=3)
    a.set_yscale("log")
    a.set_ylabel("mean KL(p_ref ‖ p_what-if), nats / token")
    a.set_title("Held-out KL against the unmodified model")
    b.bar([k - 0.2 for k in x], [100 * r["dropped"] for r in rows], 0.4, label="picks dropped", color="#c44e52")
    b.bar([k + 0.2 for k in x], [100 * r["rerouted"] for r in rows], 0.4, label="tokens re-routed",
          color="#55a868")
    b.set_ylabel("% (picks, or token × MoE layer pairs)")
    b.set_title("Dropped and re-routed")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=25, ha="right")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def _moves_section(rep: dict, pngs: dict) -> list[str]:
    """The "what it moves" and router what-if sections (empty when the report has neither)."""
    esc, parts = html.escape, []
    mv, wi = rep.get("moves"), rep.get("router_what_ifs")
    if mv:
        g = mv["gpu"]
        parts.append("<h2>What it moves</h2>")
        parts.append("<p class='note'>Per decode step at batch B (B independent streams), each MoE layer reads "
                     "every expert one of the B tokens picks: expected Σ<sub>e</sub> 1 − (1 − p<sub>e</sub>)"
                     "<sup>B</sup> distinct experts, p<sub>e</sub> the calibration's measured top-k inclusion "
                     "probability (uniform: k/E). Bytes are the checkpoints' stored sizes (quantized experts "
                     f"packed, scales counted); KV cache at {mv['context']} tokens per stream; steps/s is the "
                     f"memory-bandwidth roofline on {esc(g['name'])} ({esc(g['source'])}).</p>")
        parts.append(_img(pngs.get("moves"), "expert coverage and bytes per step against batch size"))
        trs = []
        for r in mv["batches"]:
            m, u = r.get("measured") or r["uniform"], r["uniform"]
            trs.append([r["batch"], f"{m['distinct_experts_mean']:.2f}", f"{u['distinct_experts_mean']:.2f}",
                        f"{100 * m['expert_coverage']:.1f}", f"{m['weight_bytes'] / 2**20:,.2f}",
                        f"{m['kv_bytes'] / 2**20:,.2f}", f"{m['steps_per_s']:,.0f}", f"{m['tokens_per_s']:,.0f}"])
        parts.append(_table(["batch", "distinct experts / layer (measured)", "(uniform)", "coverage %",
                             "weights MiB / step", "KV MiB / step", "steps/s (roofline)", "tokens/s"], trs))
    if wi:
        parts.append("<h2>Router what-ifs</h2>")
        parts.append(f"<p class='note'>The reference rerun on the same {wi['windows']} held-out windows × "
                     f"{wi['seq_len']} tokens with its routing changed: top-k − 1, the router logits divided by "
                     "a temperature, or a per-expert capacity (ceil(factor · tokens · k / E) picks per "
                     f"{esc(wi['capacity_group'])}; picks over it dropped, in token order). Dropped: share of the "
                     "k expert places per token and MoE layer where no expert runs (top-k − 1: 1/k); re-routed: "
                     "share of (token, MoE layer) pairs that run an expert the unmodified model did not pick "
                     "there.</p>")
        parts.append(_img(pngs.get("what_ifs"), "router what-ifs"))
        parts.append(_table(["what-if", "mean KL ± stderr", "99% KL", "same top-1 %", "dropped %", "re-routed %"],
                            [[esc(r["name"]), f"{r['kl']['mean']:.4g} ± {r['kl']['stderr']:.2g}",
                              f"{r['kl']['p99']:.4g}", f"{100 * r['same_top1']:.2f}", f"{100 * r['dropped']:.2f}",
                              f"{100 * r['rerouted']:.2f}"] for r in wi["what_ifs"]]))
    return parts


# ---- HTML ---------------------------------------------------------------------------------------------
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;
color:#222;padding:0 1em}
h1{font-size:1.6em}h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ccc;padding:.25em .5em;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}
img{max-width:100%;height:auto;display:block;margin:.6em 0}
.warn{background:#fff4e5;border-left:4px solid #ef6c00;padding:.4em .8em;margin:.3em 0}
.pass{color:#1b5e20;font-weight:600}.fail{color:#b71c1c;font-weight:600}
.note{color:#555;font-size:.9em}
"""


def _img(png: bytes | None, alt: str) -> str:
    if png is None:
        return ""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(headers: list[str], rows: list[list], cls: str = "") -> str:
    h = "".join(f"<th>{html.escape(str(x))}</th>" for x in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def stats_rows(evals: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The statistics table (header, rows of strings) shared by the HTML page and the CLI."""
    headers = ["checkpoint", "policy", "bpw", "MiB/rank (max)", "mean KL ± stderr", "median KL", "99% KL",
               "99.9% KL", "max KL", "same top-1 %", "RMS Δp %", "PPL ref", "PPL quant", "PPL ratio",
               "top-k agree % (mean / min layer)"]
    rows = []
    for ev in evals:
        k = ev["kl"]
        plan = ev.get("plan") or {}
        pol = plan.get("policy", "")
        if plan.get("granularity"):
            pol += f" ({plan['granularity']})"
        mib = max(r["deployed_bytes"] for r in ev["footprint"]["ranks"]) / 2**20
        rows.append([ev["name"], pol, f"{ev['expert_bpw']:.3f}", f"{mib:.2f}",
                     f"{k['mean']:.4g} ± {k['stderr']:.2g}", f"{k['median']:.4g}", f"{k['p99']:.4g}",
                     f"{k['p999']:.4g}", f"{k['max']:.4g}", f"{100 * ev['same_top1']:.2f}",
                     f"{100 * ev['rms_dp_top1']:.2f}", f"{ev['ppl_ref']:.3f}", f"{ev['ppl_quant']:.3f}",
                     f"{ev['ppl_ratio']:.4f}",
                     f"{100 * ev['router']['mean_topk_set_agreement']:.2f} / "
                     f"{100 * ev['router']['min_topk_set_agreement']:.2f}"])
    return headers, rows


def _page(rep: dict, pngs: dict[str, bytes | None]) -> str:
    esc = html.escape
    cal, evals, held = rep.get("calibration"), rep["evaluations"], rep.get("heldout") or {}
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>trtmoe quantization report</title>"
             f"<style>{_CSS}</style></head><body>", "<h1>trtmoe quantization report</h1>"]
    ref = rep.get("reference") or {}
    parts.append("<p class='note'>Reference: <code>" + esc(str(ref.get("checkpoint", "?"))) + "</code>. "
                 f"Held-out evaluation: {held.get('samples', '?')} windows × {held.get('seq_len', '?')} tokens "
                 f"({held.get('tokens_scored', '?')} scored positions) from <code>{esc(str(held.get('source', '?')))}"
                 "</code>. KL is KL(p_ref ‖ p_quant) over the full vocabulary, in nats per token; both models run "
                 "in the embedded engine from the converted checkpoints (quantized experts from their packed "
                 "bytes).</p>")
    for w in rep.get("warnings") or []:
        parts.append(f"<div class='warn'>{esc(w)}</div>")
    parts.append("<h2>Held-out statistics</h2>")
    headers, rows = stats_rows(evals)
    parts.append(_table(headers, [[esc(c) for c in r] for r in rows], "stats"))
    parts.append("<p class='note'>bpw: average stored bits per routed-expert weight, scales included. "
                 "RMS Δp: root-mean-square change of the probability of the reference's top-1 token. "
                 "top-k agree: fraction of tokens whose selected expert set is identical to the reference's "
                 "(placement permutations undone).</p>")
    parts.append("<h2>KL versus bits</h2>")
    parts.append(_img(pngs.get("curve"), "KL versus bits"))
    brows = (rep.get("curve") or {}).get("bench_rows") or []
    if brows:
        parts.append(_table(["budget (bpw)", "policy", "actual bpw", "mean KL", "99.9% KL", "same top-1 %",
                             "top-k agree % (mean / min layer)"],
                            [[esc(str(r["budget"])), esc(r["policy"]), f"{r['bpw']:.3f}", f"{r['kl_mean']:.4g}",
                              f"{r['kl_p999']:.4g}", f"{100 * r['same_top1']:.2f}",
                              f"{100 * r['topk_agreement']:.2f} / {100 * r['topk_agreement_min']:.2f}"]
                             for r in brows], "bench"))
    tg = (rep.get("curve") or {}).get("bench_targets")
    if tg:
        cmp = any(t.get("comparison") for t in tg)  # e.g. the expert-granularity number beside the target's
        trs = [[esc(t["name"]), esc(str(t.get("value", ""))), esc(str(t.get("threshold", ""))),
                ("info" if t.get("info") else
                 f"<span class='{'pass' if t['ok'] else 'fail'}'>{'pass' if t['ok'] else 'miss'}</span>")]
               + ([esc(str(t.get("comparison") or ""))] if cmp else []) for t in tg]
        parts.append(_table(["benchmark target", "measured", "required", ""] + (["for comparison"] if cmp else []),
                            trs))
    parts.append("<h2>Router top-k agreement</h2>")
    parts.append(_img(pngs.get("router"), "router agreement per layer"))
    parts.append("<h2>Assigned formats</h2>")
    parts.append(_img(pngs.get("formats"), "assigned format heatmaps"))
    if cal:
        parts.append("<h2>Calibration</h2>")
        d = cal.get("data") or {}
        parts.append(f"<p class='note'>{cal['tokens']} calibration tokens ({d.get('samples', '?')} × "
                     f"{d.get('seq_len', '?')}) from <code>{esc(str(d.get('path', '?')))}</code>. "
                     f"{_cost_sentence(cal)} "
                     "ΔKL is measured per expert matrix (fc = [up; gate], proj = down), each quantized alone; "
                     "an expert's ΔKL is fc + proj, which is what expert- and layer-granularity plans "
                     "allocate with.</p>")
        parts.append(_img(pngs.get("share"), "routed-token share heatmap"))
        parts.append(_img(pngs.get("sensitivity"), "sensitivity heatmap"))
        parts.append(_img(pngs.get("min_tokens"), "minimum routed tokens per expert"))
        if cal["under_observed"]:
            parts.append(_table(["layer", "expert", "routed tokens"],
                                [[u["layer"], u["expert"], u["tokens"]] for u in cal["under_observed"]]))
    parts.extend(_moves_section(rep, pngs))
    parts.append("<h2>Bytes per rank</h2>")
    parts.append(_img(pngs.get("bytes"), "bytes per rank"))
    brows = []
    if ref.get("footprint"):
        for r in ref["footprint"]["ranks"]:
            brows.append(["reference", r["rank"], r["stored_bytes"], r["deployed_bytes"], r["routed_expert_bytes"]])
    for ev in evals:
        for r in ev["footprint"]["ranks"]:
            brows.append([esc(ev["name"]), r["rank"], r["stored_bytes"], r["deployed_bytes"],
                          r["routed_expert_bytes"]])
    parts.append(_table(["checkpoint", "rank", "stored bytes", "deployed bytes", "routed-expert bytes"], brows))
    parts.append("</body></html>")
    return "\n".join(parts)


def render(rep: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.json``, one PNG per plot and the self-contained ``report.html`` into ``out_dir``.
    Returns the written paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cal, evals = rep.get("calibration"), rep["evaluations"]
    pngs: dict[str, bytes | None] = {
        "curve": plot_curve(rep.get("curve") or {}),
        "router": plot_router(evals),
        "bytes": plot_bytes(rep.get("reference"), evals),
    }
    if cal:
        pngs["share"] = plot_share(cal)
        pngs["sensitivity"] = plot_sensitivity(cal)
        pngs["min_tokens"] = plot_min_tokens(cal)
        pngs["formats"] = plot_formats(evals, cal["moe_layers"], cal["num_experts"])
    elif evals and evals[0].get("formats"):
        layers = sorted(int(l) for l in evals[0]["formats"])
        pngs["formats"] = plot_formats(evals, layers, len(evals[0]["formats"][str(layers[0])])) if layers else None
    if rep.get("moves"):
        pngs["moves"] = plot_moves(rep["moves"])
    if rep.get("router_what_ifs"):
        pngs["what_ifs"] = plot_what_ifs(rep["router_what_ifs"])
    paths: dict[str, Path] = {}
    for name, png in pngs.items():
        if png is not None:
            p = out / f"{name}.png"
            p.write_bytes(png)
            paths[name] = p
    (out / "report.json").write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
    paths["json"] = out / "report.json"
    (out / "report.html").write_text(_page(rep, pngs), encoding="utf-8")
    paths["html"] = out / "report.html"
    return paths
