"""CLI glue for quantization: ``trtmoe calibrate`` and the plan that ``trtmoe convert`` writes."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .. import config as cfgmod
from ..console import console, err_console, progress
from ..errors import InputError
from . import ENGINE_PATH_NAMES

# Every quantized format (calibrate measures them all by default), without importing torch.
DEFAULT_FORMATS = ENGINE_PATH_NAMES


@click.command()
@click.argument("model")
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="Directory for calib.json.")
@click.option("-c", "--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="YAML config (see build_configs/); its calibrate section sets these options and the command "
                   "line overrides it.")
@cfgmod.click_options("calibrate")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print calib.json's summary as JSON.")
def calibrate(model, out, config_path, force, as_json, **options):
    """Measure routing statistics and sensitivity (ΔKL per format of each expert's fc and proj) on
    calibration text.

    OUTPUT gets calib.json (the same inputs give the same bytes) and calib.cost.json: the seconds each
    phase took and the total's ratio to one forward pass over the same tokens, which is also printed.

    \b
    Examples:
      trtmoe calibrate tests/fixtures/trained_mixtral --data calib.txt -o calib/
      trtmoe convert tests/fixtures/trained_mixtral -o ckpt/ --calib calib/ --budget 4.5
    \b
    For the PyTorch-backend engines (FP8 / NVFP4 per MoE layer), one decoder layer resident:
      trtmoe calibrate ./qwen3-moe --data calib.txt -o calib/ --formats fp8,nvfp4 --runner stream
      trtmoe convert ./qwen3-moe -o hf/ --target vllm --calib calib/ --budget 6
    """
    from .calibrate import CalibrationSettings
    from .calibrate import calibrate as run

    c = cfgmod.resolve(config_path, cfgmod.from_cli(options, "calibrate"))["calibrate"]
    if c["data"] is None:
        raise InputError("no calibration text: pass --data PATH (or calibrate.data in the YAML config)")
    settings = CalibrationSettings.from_config(c)
    notes: list[str] = []
    with progress("calibrate") as prog:
        task = prog.add_task("measuring sensitivity", total=None)
        res = run(model, Path(c["data"]), out, settings, force=force, notes=notes,
                  progress=lambda what, d, t: prog.update(task, completed=d, total=t))
    if as_json:
        click.echo(json.dumps({k: res[k] for k in ("routing", "data", "tokens", "skipped_formats", "cost")}, indent=1))
        return
    for n in notes:
        err_console.print(f"note: {n}")
    _render_coverage(res, console, err_console)
    if res.get("cost"):
        _render_cost(res["cost"], console)


# Layers with under-observed experts that get a warning line each; more get one summary line.
_WARN_LAYERS = 3


def _render_coverage(res: dict, console, err_console) -> None:
    """The routing table (a column per expert where they fit the console, else a summary per layer)
    and a warning line per layer with under-observed experts, or one for all of them when more than
    ``_WARN_LAYERS`` layers have some."""
    r = res["routing"]
    E, L = res["num_experts"], res["moe_layers"]
    # Each expert column takes its widest cell ("12.3") plus rich's padding and border.
    wide = 7 + sum(max(len(str(e)), 4) + 3 for e in range(E)) + 12 + 11 <= console.width
    tokens, k = res["data"]["tokens"], res["top_k"]
    title = (f"Routing on {tokens} calibration tokens (share of top-{k} assignments per expert, %)" if wide else
             f"Routing by layer, {tokens} calibration tokens (expert: % of top-{k} assignments)")
    console.print(_routing_table(r, E, L, title, wide))
    thr = r["min_tokens_threshold"]
    by_layer: dict = {}
    for f in r["under_observed"]:
        by_layer.setdefault(f["layer"], []).append(f)
    also = "their ΔKL is also estimated from the layer's tokens sent through them, and the larger value is used"
    if len(by_layer) > _WARN_LAYERS:  # a fine-grained MoE on little data: one summary, the table has the rest
        n = sum(map(len, by_layer.values()))
        worst = sorted(by_layer.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:3]
        where = "cells in red above" if wide else f"the table's 'experts < {thr} tokens' column"
        err_console.print(f"[yellow]warning:[/] {n} experts in {len(by_layer)} of {len(L)} layers saw fewer than "
                          f"{thr} calibration tokens (most in layers "
                          f"{', '.join(f'{l} ({len(fs)})' for l, fs in worst)}; per layer: {where}; each one: "
                          f"calib.json's routing.under_observed); {also}")
    else:
        for l, fs in by_layer.items():
            shown = ", ".join(f"{f['expert']} ({f['tokens']})" for f in fs[:8])
            more = f" and {len(fs) - 8} more" if len(fs) > 8 else ""
            err_console.print(f"[yellow]warning:[/] layer {l}: {len(fs)} of {E} experts saw fewer than {thr} "
                              f"calibration tokens (expert (tokens): {shown}{more}); {also}")
    s = res["sensitivity"]
    console.print(f"sensitivity ({s.get('method', 'exact')}) for {len(res['formats'])} formats × 2 expert matrices "
                  "(fc, proj)")




def _render_cost(cost: dict, console) -> None:
    """The measured cost line and a table of the phases (calib.cost.json)."""
    from rich.table import Table

    from .calibrate import COST_PHASES, cost_summary, phase_order, seconds

    unit = cost["unit"]
    console.print(cost_summary(cost))
    t = Table(title=f"Calibration phases ({cost['runner']} runner, {cost['method']}, {cost['rounding']} rounding, "
                    f"{cost['device']}, {cost['torch_threads']} torch threads)", title_justify="left")
    for h in ("phase", "wall s", "CPU s", "share %", "what"):
        t.add_column(h, justify="left" if h in ("phase", "what") else "right")
    total = cost["total"][unit] or 1.0
    for name, p in phase_order(cost["phases"]):
        t.add_row(name, seconds(p["wall_seconds"]), seconds(p["cpu_seconds"]), f"{100 * p[unit] / total:.1f}",
                  COST_PHASES.get(name, ""))
    tot = cost["total"]
    t.add_row("total", seconds(tot["wall_seconds"]), seconds(tot["cpu_seconds"]), "100.0", "")
    console.print(t)


def _routing_table(r: dict, E: int, layers, title: str, per_expert: bool):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    t.add_column("layer")
    thr = r["min_tokens_threshold"]
    if per_expert:
        for e in range(E):
            t.add_column(str(e), justify="right")
    else:
        for name in ("busiest", "rarest", "experts < ¼ uniform", f"experts < {thr} tokens"):
            t.add_column(name, justify="right")
    t.add_column("entropy", justify="right")
    t.add_column("max/mean", justify="right")
    for l in layers:
        share = [100 * x for x in r["share"][l]]
        counts = r["counts"][l]
        if per_expert:
            cells = []
            for e in range(E):
                style = "red" if counts[e] < thr else ("yellow" if share[e] < 25 / E else "")
                cells.append(f"[{style}]{share[e]:.1f}[/]" if style else f"{share[e]:.1f}")
        else:
            hi = max(range(E), key=lambda e: share[e])
            lo = min(range(E), key=lambda e: share[e])
            cold = sum(x < 25 / E for x in share)
            starved = sum(c < thr for c in counts)
            cells = [f"{hi}: {share[hi]:.1f}", f"{lo}: {share[lo]:.2f}", f"[yellow]{cold}[/]" if cold else "0",
                     f"[red]{starved}[/]" if starved else "0"]
        t.add_row(str(l), *cells, f"{r['entropy_nats'][l]:.2f}/{r['max_entropy_nats']:.2f}",
                  f"{r['load_imbalance'][l]:.2f}")
    return t


@click.command()
@click.option("--ref", "ref", required=True, type=click.Path(path_type=Path),
              help="Unquantized checkpoint (`trtmoe convert` output) the others are compared with.")
@click.option("--quant", "quants", multiple=True, type=click.Path(path_type=Path),
              help="Quantized checkpoint to evaluate (repeatable).")
@click.option("--calib", type=click.Path(path_type=Path), default=None,
              help="Calibration directory (routing and sensitivity heatmaps, coverage).")
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="Held-out text (file, directory or JSONL), disjoint from calibration "
                   "[default: the corpus's heldout split].")
@click.option("--bench", "bench_paths", multiple=True, type=click.Path(path_type=Path),
              help="JSON from scripts/bench_quant.py --out: adds its KL-versus-bits series.")
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path), help="Report directory.")
@click.option("--samples", type=int, default=64, show_default=True, help="Held-out windows.")
@click.option("--seq-len", type=int, default=128, show_default=True, help="Tokens per window.")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--tokenizer", type=click.Path(path_type=Path), default=None,
              help="Tokenizer dir [default: the reference checkpoint's copy].")
@click.option("--field", default="text", show_default=True, help="JSONL field holding the text.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--what-ifs", "what_ifs", is_flag=True,
              help="Also measure router what-ifs on the reference (top-k − 1, router temperature 0.5 and 2, "
                   "per-expert capacity 1.0 / 1.25 / 2.0): held-out KL, dropped and re-routed shares.")
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
def report(ref, quants, calib, data, bench_paths, out, samples, seq_len, batch_size, tokenizer, field, device,
           what_ifs, as_json):
    """Evaluate quantized checkpoints against the reference on held-out text and write report.json plus
    a self-contained report.html (KL statistics, router agreement, heatmaps, KL-versus-bits curve).

    \b
    Example:
      trtmoe report --calib calib/ --ref ckpt_fp/ --quant ckpt_q/ --data heldout.txt -o report/
      trtmoe report --calib calib/ --ref ckpt_fp/ --what-ifs -o report/     # routing what-ifs only
    """

    from ..report.assemble import write_report
    from ..report.html import stats_rows

    res = write_report(ref, out, quants=quants, calib=calib, data=data, bench_paths=bench_paths, samples=samples,
                       seq_len=seq_len, batch_size=batch_size, tokenizer=tokenizer, text_field=field, device=device,
                       on_evaluate=lambda q: err_console.print(f"evaluating {q} …"), what_ifs=what_ifs)
    paths, evals, heldout, warnings = res.paths, res.evaluations, res.heldout, res.warnings
    if as_json:
        click.echo(json.dumps({"report": str(paths["html"]), "evaluations": evals,
                               "router_what_ifs": res.report.get("router_what_ifs")}, indent=1))
        return
    from rich.table import Table

    _, rows = stats_rows(evals)
    # The columns that fit a terminal, with short headers (report.html has them all).
    cols = {0: "checkpoint", 2: "bpw", 4: "KL mean ± se", 7: "KL 99.9%", 9: "top-1 %", 10: "RMS Δp %",
            13: "PPL ratio", 14: "top-k % mean/min"}
    t = Table(title=f"Held-out statistics ({heldout['tokens_scored'] if heldout else 0} scored tokens)",
              title_justify="left")
    for i, h in cols.items():
        t.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
    for r in rows:
        t.add_row(*[r[i] for i in cols])
    if rows:
        console.print(t)
    wi = res.report.get("router_what_ifs")
    if wi:
        t = Table(title=f"Router what-ifs ({wi['tokens']} held-out tokens)", title_justify="left")
        for h in ("what-if", "KL mean ± se", "same top-1 %", "dropped %", "re-routed %"):
            t.add_column(h, justify="left" if h == "what-if" else "right")
        for r in wi["what_ifs"]:
            t.add_row(r["name"], f"{r['kl']['mean']:.4g} ± {r['kl']['stderr']:.2g}", f"{100 * r['same_top1']:.2f}",
                      f"{100 * r['dropped']:.2f}", f"{100 * r['rerouted']:.2f}")
        console.print(t)
    for w in warnings:
        err_console.print(f"[yellow]warning:[/] {w}")
    console.print(f"[green]wrote[/] {paths['html']} and {paths['json']}")
