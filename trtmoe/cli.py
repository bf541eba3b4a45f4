"""The ``trtmoe`` command line. Each command parses options, merges CLI > YAML > defaults, calls one
library function and renders its result; errors are one line with an exit code (2 bad input, 1 failure)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import traceback
from pathlib import Path

import click
from rich.markup import escape as rich_escape
from rich.table import Table

from . import __version__
from . import config as cfgmod
from .console import console, err_console, fmt_bytes, fmt_count, note, progress
from .errors import LayoutError, NotBuildable, TrtmoeError, raised_in
from .quant import QUANTIZED_NAMES

class TargetChoice(click.Choice):
    """``--target``: the names of trtmoe.targets' registry, read when the option is parsed or its help is
    shown (importing the registry imports torch, which ``import trtmoe.cli`` must not)."""

    def __init__(self):
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        from .targets import names

        return names()

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ assigns it; the registry is the source
        pass


# What an OSError's errno means for the user, where the bare strerror is not enough.
_OS_HINTS = {
    errno.ENOSPC: "free some space or write elsewhere; nothing half-written was kept",
    errno.EDQUOT: "disk quota exceeded; free some space or write elsewhere",
    errno.EROFS: "the file system is read-only; choose another output path",
    errno.EFBIG: "the file-size limit (ulimit -f) or the file system's maximum file size is too small",
    errno.EACCES: "check the permissions of the path and its parent directories",
    errno.EPERM: "check the permissions of the path and its parent directories",
    errno.ENOTDIR: "a component of the path is a file, not a directory",
    errno.EMFILE: "too many open files (ulimit -n)",
}


def os_error_message(e: OSError) -> str:
    """One line for an OSError: the path(s) it concerns, what went wrong, and a hint."""
    what = e.strerror or str(e) or type(e).__name__
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    msg = f"{' -> '.join(paths)}: {what}" if paths else what
    hint = _OS_HINTS.get(e.errno)
    return f"{msg} ({hint})" if hint else msg


def _one_line(text: str) -> str:
    return " ".join(text.split())


class TrtmoeGroup(click.Group):
    """Maps errors to one-line messages and exit codes (our error classes by their exit code, OS
    errors 1, usage errors 2); --debug shows tracebacks."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:  # a bad top-level option: one line too
            sub = e.ctx.command_path if e.ctx is not None else "trtmoe"
            err_console.print(f"[bold red]error:[/] {rich_escape(_one_line(e.format_message()))} "
                              f"(see `{sub} --help`)", highlight=False, soft_wrap=True, emoji=False)
            sys.exit(e.exit_code)

    def invoke(self, ctx):
        debug = bool(ctx.params.get("debug") or (ctx.obj or {}).get("debug"))

        def fail(msg: str, code: int):
            if debug:
                traceback.print_exc()
            err_console.print(f"[bold red]error:[/] {_one_line(msg)}", markup=True, highlight=False,
                              soft_wrap=True, emoji=False)
            sys.exit(code)

        try:
            return super().invoke(ctx)
        except TrtmoeError as e:
            fail(rich_escape(e.render()), e.exit_code)
        except click.exceptions.Exit:
            raise
        except click.UsageError as e:
            sub = e.ctx.command_path if e.ctx is not None else "trtmoe"
            fail(rich_escape(f"{e.format_message()} (see `{sub} --help`)"), e.exit_code)
        except click.ClickException as e:
            fail(rich_escape(e.format_message()), e.exit_code)
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]; nothing was written")
            sys.exit(130)
        except BrokenPipeError:
            # The reader of our output went away (e.g. `| head`): nothing to report to it.
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except OSError as e:
            fail(rich_escape(os_error_message(e)), 1)
        except (click.Abort, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 - the last line of defence against a traceback
            where = raised_in(e, "transformers")
            if where is not None:  # the model's own modelling code failed (its config, or transformers)
                fail(rich_escape(f"transformers' own modelling code failed on this model ({where}): "
                                 f"{type(e).__name__}: {e}") + " (transformers cannot run this model's config "
                     "here; if its own model runs it, that is a bug in trtmoe; --debug for the traceback)", 2)
            fail(rich_escape(f"internal error: {type(e).__name__}: {e}")
                 + " (a bug in trtmoe; rerun with --debug for the traceback)", 1)


@click.group(cls=TrtmoeGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="trtmoe")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def main(ctx, debug):
    """trtmoe: Hugging Face MoE checkpoint → quantized checkpoint → engine → Triton.

    \b
    Typical flow (TensorRT-LLM 1.2 engines, or the embedded engine):
      trtmoe inspect MODEL --tp 2 --moe-ep 2
      trtmoe calibrate MODEL --data calib.txt -o calib/
      trtmoe convert MODEL -o ckpt/ --tp 2 --moe-ep 2 --calib calib/ --budget 4.5
      trtmoe verify ckpt/
      trtmoe run ckpt/ --tokenizer MODEL --prompt "def main("
      trtmoe build ckpt/ -o engine/ && trtmoe repo engine/ -o repo/ && trtmoe serve repo/
    \b
    For TensorRT-LLM's PyTorch backend, vLLM or SGLang (a ModelOpt unified-HF checkpoint):
      trtmoe calibrate MODEL --data calib.txt -o calib/ --formats fp8,nvfp4 --runner stream
      trtmoe convert MODEL -o hf/ --target trtllm-pytorch --calib calib/ --budget 6
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def layout_options(f):
    """--tp, --pp, --moe-tp, --moe-ep and --dtype, as the YAML schema's ``convert`` keys."""
    return cfgmod.click_options("convert", "tp", "pp", "moe_tp", "moe_ep", "dtype")(f)


# ---- inspect ---------------------------------------------------------------------------------------
def moves_options(f):
    """inspect's options for what a decode step moves (trtmoe.report.moves)."""
    for opt in reversed((
        click.option("--batch", default=None, metavar="B,B,...",
                     help="Decode batch sizes (concurrent streams) to report what a step moves at "
                          "[default: 1,8,32,128]."),
        click.option("--calib", type=click.Path(path_type=Path), default=None,
                     help="Calibration directory: expert coverage from its measured routing (uniform beside it)."),
        click.option("--plan", type=click.Path(path_type=Path), default=None,
                     help="A converted checkpoint: its per-expert formats and placement instead of --format."),
        click.option("--context", type=int, default=None,
                     help="Tokens of context each stream's KV cache holds [default: 2048, or the model's "
                          "max_position_embeddings when shorter]."),
        click.option("--gpu", default=None,
                     help="Memory bandwidth of the roofline: H100 (3.35 TB/s), H200 (4.8), B200 (8), or GB/s "
                          "[default: H100]."),
    )):
        f = opt(f)
    return f


@main.command()
@click.argument("model")
@click.option("-c", "--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="YAML build config (as convert and build read it): its convert section's layout, dtype and "
                   "trtllm_version, and build.backend as --target; options override it.")
@layout_options
@click.option("--format", "fmt", type=click.Choice(["float", *QUANTIZED_NAMES]), default=None,
              help="Routed-expert format for the bytes per rank [default: float, the weight dtype].")
@click.option("--target", type=TargetChoice(), default=None,
              help="tensorrt-llm: also show whether TensorRT-LLM builds this layout and format (support table); "
                   "trtllm-pytorch / vllm / sglang: whether that engine loads the unified-HF export of the routed "
                   "experts in --format on --sm (the unified-HF support table, shown for every engine anyway).")
@click.option("--sm", "sm", type=click.Choice(["89", "90", "100"]), default="90", show_default=True,
              help="GPU generation of the unified-HF support cells.")
@click.option("--engine", "engine_release", default=None,
              help="Unified-HF --target: engine release of the cell (trtllm-1.2.1, trtllm-1.4, vllm-0.33, sglang-0.5) "
                   "[default: the target's first].")
@click.option("--trtllm-version", type=click.Choice(cfgmod.SCHEMA["convert"]["trtllm_version"].choices),
              default=None, help="TensorRT-LLM release line for --target [default: 1.2].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@moves_options
def inspect(model, config_path, tp, pp, moe_tp, moe_ep, dtype, fmt, target, sm, engine_release, trtllm_version, as_json,
            **moves):
    """Show what MODEL costs and really activates per token, and bytes per rank for a layout.

    MODEL is a local HF directory or a hub id already in the local cache. Only config.json is needed:
    plan a layout before downloading the weights.

    With --batch (or --calib, --plan, --gpu, --context): what a decode step at each batch size moves
    (distinct experts per MoE layer, weight and KV-cache bytes, per rank) and the steps per second a
    GPU's memory bandwidth allows, under uniform routing and the calibration's measured routing.

    \b
    Exit status (the report is printed first):
      0  the layout fits the model (and, with --target tensorrt-llm, TensorRT-LLM builds it)
      2  bad input, or a layout the model does not divide into
      3  --target tensorrt-llm: TensorRT-LLM's support table refuses this layout and format;
         --target trtllm-pytorch / vllm / sglang: the unified-HF support table refuses the format

    \b
    Examples:
      trtmoe inspect mistralai/Mixtral-8x7B-v0.1 --tp 4 --moe-tp 2 --moe-ep 2 --dtype bfloat16
      trtmoe inspect ./config-only-dir --tp 2 --moe-ep 2 --format int4_g128 --target tensorrt-llm
      trtmoe inspect ./model --calib calib/ --batch 1,8,32,128 --context 4096 --gpu H200 --moe-ep 2
      trtmoe inspect ./model --plan ckpt/ --batch 1,32 --gpu 2000    # the checkpoint's formats, 2000 GB/s
      trtmoe inspect MODEL -c build_configs/mixtral-8x7b-ep8.yaml --target tensorrt-llm || echo "not buildable"
      trtmoe inspect ./gpt-oss-20b --target trtllm-pytorch --format mxfp4 --sm 90   # unified-HF cell
    """
    from .report.inspect import inspect_model

    cfg = cfgmod.resolve(config_path, cfgmod.from_cli(dict(tp=tp, pp=pp, moe_tp=moe_tp, moe_ep=moe_ep, dtype=dtype,
                                                           trtllm_version=trtllm_version), "convert"))
    cv = cfg["convert"]
    if target is None and config_path is not None:
        target = (cfgmod.load_yaml(config_path).get("build") or {}).get("backend")
    rep = inspect_model(model, tp=cv["tp"], pp=cv["pp"], moe_tp=cv["moe_tp"], moe_ep=cv["moe_ep"], dtype=cv["dtype"],
                        fmt=fmt, target=target, trtllm_version=cv["trtllm_version"], sm=int(sm),
                        engine=engine_release)
    wants_moves = any(moves[k] is not None for k in ("batch", "calib", "plan", "gpu", "context"))
    if wants_moves and rep["layout"]["ok"] and "ranks" in rep:
        from .report.moves import moves_report

        rep["moves"] = moves_report(model, tp=cv["tp"], pp=cv["pp"], moe_tp=cv["moe_tp"], moe_ep=cv["moe_ep"],
                                    dtype=cv["dtype"], fmt=fmt, **moves)
    if as_json:
        click.echo(json.dumps(rep, indent=2))
    else:
        _render_inspect(rep)
        if "moves" in rep:
            from .report.moves import render_moves

            render_moves(rep["moves"], console)
    if not rep["layout"]["ok"]:
        raise LayoutError("layout check failed: " + "; ".join(rep["layout"]["problems"]))
    sup = rep.get("support")
    if sup is not None and not sup["ok"]:
        from .targets import target_for

        raise target_for(target).refusal(sup)


def _render_unified(rep: dict) -> None:
    u = rep.get("unified_hf")
    if not u:
        return
    console.print(f"  unified-HF export (convert --target trtllm-pytorch|vllm|sglang), SM{u['sm']}:")
    for engine, works in u["engines"].items():
        console.print(f"    {engine}: {rich_escape(works)}")


def _render_inspect(rep: dict) -> None:
    p = rep["parameters"]
    c = rep["config"]
    console.print(f"[bold]{rep['architecture']}[/] ({rep['family']}) — {rep['model']}"
                  + ("" if rep.get("weights_present", True) else " [dim](config.json only: no weights here)[/]"))
    console.print(f"  {c['num_layers']} layers ({len(rep['moe_layers'])} MoE, {len(rep['dense_layers'])} dense), "
                  f"{c['num_experts']} experts, top-{c['top_k']}, hidden {c['hidden_size']}, "
                  f"expert FFN {c['expert_intermediate_size']}, vocab {c['vocab_size']}")
    t = Table(title="Parameters", title_justify="left")
    t.add_column("component")
    t.add_column("total", justify="right")
    t.add_column("active / token", justify="right")
    t.add_column("share of total", justify="right")
    for name, d in p["components"].items():
        t.add_row(name, fmt_count(d["total"]), fmt_count(d["active_per_token"]),
                  f"{100 * d['total'] / p['total']:.1f}%")
    t.add_row("[bold]all", f"[bold]{fmt_count(p['total'])}", f"[bold]{fmt_count(p['active_per_token'])}",
              "100%")
    console.print(t)
    console.print(f"  A token touches [bold]{fmt_count(p['active_per_token'])}[/] of "
                  f"{fmt_count(p['total'])} parameters = [bold]{100 * p['active_share']:.2f}%[/] "
                  f"(one embedding row, all attention, routers, shared experts, top-k experts, full lm_head)")
    if "activated" in p:
        console.print(f"  Activated as model cards count it (all but the routed experts a token skips): "
                      f"[bold]{fmt_count(p['activated'])}[/]")
    lay = rep["layout"]
    if not lay["ok"]:  # the command ends with the problems as its one error line
        return
    if "ranks" not in rep:  # outside the registry: no per-rank plan (see report/inspect_hf.py)
        _render_unified(rep)
        _render_support(rep)
        for n in rep["notes"]:
            console.print(f"  [yellow]note:[/] {n}")
        return
    experts = "" if rep.get("expert_format", "float") == "float" else f", experts {rep['expert_format']}"
    t = Table(title=f"Weights per rank ({rep['dtype']}{experts}, tp={lay['tp']} pp={lay['pp']} "
                    f"moe_tp={lay['moe_tp']} moe_ep={lay['moe_ep']})", title_justify="left")
    both = any(r.get("checkpoint_bytes", r["bytes"]) != r["bytes"] for r in rep["ranks"])
    for col in ("rank", "tp", "pp", "moe_ep", "moe_tp", "experts", "layers",
                *(("engine", "ckpt file") if both else ("bytes",))):
        t.add_column(col, justify="right")
    for r in rep["ranks"]:
        t.add_row(str(r["rank"]), str(r["tp_rank"]), str(r["pp_rank"]), str(r["moe_ep_rank"]),
                  str(r["moe_tp_rank"]), f"{r['experts'][0]}–{r['experts'][1]}",
                  f"{r['layers'][0]}–{r['layers'][-1]}", fmt_bytes(r["bytes"]),
                  *((fmt_bytes(r["checkpoint_bytes"]),) if both else ()))
    console.print(t)
    if both:
        console.print(f"  engine: the routed experts in {rep['expert_format']}, as the engine holds them; "
                      "ckpt file: the rank file, whose weight-only per-channel experts stay float for the "
                      "engine builder to quantize")
    console.print("  layout checks: [green]ok[/] (heads, kv heads, experts % moe_ep, FFN % moe_tp)")
    _render_unified(rep)
    _render_support(rep)
    for n in rep["notes"]:
        console.print(f"  [yellow]note:[/] {n}")


def _render_support(rep: dict) -> None:
    sup = rep.get("support")
    if sup:
        state = "[green]builds[/]" if sup["ok"] else "[red]does not build[/]"
        name = sup.get("engine_label") or f"TensorRT-LLM {sup['release']}"
        console.print(f"  {name}: {state}; it builds {rich_escape(sup['what_works'])}")
        for line in sup["refusals"]:
            console.print(f"  [red]no:[/] {rich_escape(line)}")
        for line in sup["cautions"]:
            console.print(f"  [yellow]unlisted:[/] {rich_escape(line)}")


# ---- convert ---------------------------------------------------------------------------------------
@main.command()
@click.argument("model")
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="Output checkpoint directory (written atomically).")
@click.option("-c", "--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="YAML build config (see build_configs/); CLI options override it.")
@cfgmod.click_options("convert")
@cfgmod.click_options("quantize")
@click.option("--target", type=TargetChoice(), default=None,
              help="What the checkpoint is for: embedded / tensorrt-llm (TensorRT-LLM 1.2 engine path) write a "
                   "TensorRT-LLM checkpoint; trtllm-pytorch, vllm and sglang write a ModelOpt unified-HF checkpoint "
                   "(trtllm-serve / LLM(), vLLM, SGLang) [default: embedded].")
@click.option("--layer-format", "layer_formats", multiple=True, metavar="KEY=FORMAT",
              help="Unified-HF targets: '*=FMT' quantizes every linear but routers/embeddings/lm_head (as ModelOpt's "
                   "presets do); 'L=FMT' MoE layer L's routed experts; 'attention=FMT', 'shared=FMT', 'dense=FMT'. "
                   "Formats: bf16, fp8, fp8_block_wo, nvfp4, nvfp4_w4a16, mxfp4, int8, w4a8_awq. Repeatable.")
@click.option("--calib-ids", type=click.Path(path_type=Path), default=None,
              help="Unified-HF targets: JSON list of token-id lists the input amax of FP8/NVFP4/W4A8-AWQ layers is "
                   "measured on.")
@click.option("--engine", "engine_release", default=None,
              help="Unified-HF targets: engine release of the support cell (trtllm-1.2.1, trtllm-1.4, vllm-0.33, "
                   "sglang-0.5) [default: the target's first].")
@click.option("--sm", type=click.Choice(["89", "90", "100"]), default="90", show_default=True,
              help="Unified-HF targets: GPU generation of the support cell.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def convert(model, out, config_path, target, layer_formats, calib_ids, engine_release, sm, force, as_json,
            **options):
    """Convert an HF MoE checkpoint into a TensorRT-LLM 1.2 checkpoint directory (the default target,
    also what the embedded engine runs), or with --target trtllm-pytorch|vllm|sglang a ModelOpt
    unified-HF checkpoint.

    Streams tensor by tensor (memory stays bounded whatever the model size) into a temporary
    sibling directory that is renamed into place only when everything succeeded.

    \b
    Examples:
      trtmoe convert ./Mixtral-8x7B -o ckpt/ --tp 8 --moe-ep 8 --dtype bfloat16
      trtmoe convert ./qwen-moe -o ckpt/ -c build_configs/qwen-moe.yaml --tp 2
      trtmoe convert ./model -o ckpt/ --calib calib/ --budget 4.5            # graded, per expert matrix
      trtmoe convert ./model -o ckpt/ --calib calib/ --budget 4.5 --granularity expert
      trtmoe convert ./model -o ckpt/ --calib calib/ --budget 4.5 --target tensorrt-llm  # per layer
      trtmoe convert ./model -o ckpt/ --policy uniform --format int8
      trtmoe convert ./model -o ckpt/ --calib calib/ --budget 4.5 --device cuda
      trtmoe convert ./qwen3-moe -o hf-fp8/ --target trtllm-pytorch --layer-format '*=fp8' --calib-ids ids.json
      trtmoe convert ./qwen3-moe -o hf-mix/ --target vllm --layer-format 0=nvfp4 --layer-format 1=fp8 \\
          --calib-ids ids.json --sm 100
    """
    from .targets import target_for

    if target is not None and target_for(target).unified:
        if options.get("device") not in (None, "auto"):
            raise click.UsageError(f"--device applies to the embedded and tensorrt-llm targets, not --target {target}")
        q = cfgmod.resolve(config_path, cfgmod.from_cli(options, "convert", "quantize"))["quantize"]
        return _convert_unified(model, out, target, layer_formats, calib_ids, engine_release, int(sm), force, as_json,
                                q)
    if layer_formats or calib_ids or engine_release:
        from .targets import names

        raise click.UsageError(f"--layer-format, --calib-ids and --engine apply to --target {', '.join(names(unified=True))}")
    from .checkpoint.writer import search_device

    cfg = cfgmod.resolve(config_path, {**cfgmod.from_cli(options, "convert", "quantize"), "build": {"backend": target}})
    cv = cfg["convert"]
    search_device(cv["device"])  # before any planning: a --device the machine lacks is refused at once
    calib = cfg["quantize"]["calib"]
    from .quant.planning import plan_from_config
    plan = plan_from_config(model, cfg)
    with progress("convert", units="bytes") as prog:
        task = prog.add_task("converting", total=None)
        res = target_for(cfg["build"]["backend"]).write(
            model, out, tp=cv["tp"], pp=cv["pp"], moe_tp=cv["moe_tp"], moe_ep=cv["moe_ep"], dtype=cv["dtype"],
            trtllm_version=cv["trtllm_version"], force=force, resolved_config=cfg, quant=plan,
            inputs=(calib,) if calib else (), device=cv["device"],
            progress=lambda d, t: prog.update(task, completed=d, total=t))
    summary = {"output": str(res.out_dir), "mapping": res.mapping.describe(), "dtype": res.dtype,
               "bytes": res.bytes_written, "files": res.files,
               "quantization": res.quantization, "recipes": res.recipes,
               "notes": list((plan.meta.get("notes") or []) if plan is not None else []) + res.cautions}
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        console.print(f"[green]wrote[/] {res.out_dir} — {res.mapping.describe()}, {res.dtype}, "
                      f"{fmt_bytes(res.bytes_written)} in {len(res.files)} rank file(s)")
        if plan is not None:
            m = plan.meta
            used = ", ".join(sorted(plan.used_formats()))
            extra = f", {m['avg_bpw']:.3f} bpw" if "avg_bpw" in m else ""
            pred = f", predicted ΔKL {m['predicted_delta_kl']:.4g}" if "predicted_delta_kl" in m else ""
            console.print(f"  experts: {m.get('policy')} ({plan.granularity} granularity; {used}{extra}{pred})")
        if res.recipes:
            console.print(f"  {_recipes_line(res.recipes)}")
        for n in summary["notes"]:
            note(n)


def _convert_unified(model, out, target, layer_formats, calib_ids, engine, sm, force, as_json, q) -> None:
    from .build.unified_hf import convert_unified

    if not layer_formats and q.get("budget_bpw") is None:
        raise click.UsageError(f"--target {target} needs --layer-format (e.g. '*=fp8' or '0=nvfp4') or "
                               "--calib DIR --budget BPW")
    with progress("convert", units="bytes") as prog:
        task = prog.add_task("converting", total=None)
        r = convert_unified(model, out, target=target, layer_formats=layer_formats, engine=engine, sm=sm,
                            calib_ids=calib_ids, force=force, calib=q.get("calib"), budget_bpw=q.get("budget_bpw"),
                            formats=q.get("formats"), rounding=q.get("rounding"),
                            progress=lambda d, t: prog.update(task, completed=d, total=t))
    res = r.result
    q = res.hf_quant_config["quantization"]
    summary = {"output": str(res.out_dir), "target": target, "engine": r.engine, "sm": r.sm,
               "quant_algo": q["quant_algo"], "quantized_layers": q.get("quantized_layers"),
               "bytes": res.bytes_written, "files": res.files, "support": r.verdict.to_dict()}
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    console.print(f"[green]wrote[/] {res.out_dir} — unified-HF ({q['quant_algo']}), {fmt_bytes(res.bytes_written)} "
                  f"in {len(res.files)} shard(s)")
    m = res.plan.meta
    if m.get("policy") == "graded":
        console.print(f"  experts per MoE layer: " + ", ".join(f"{l}={f}" for l, f in sorted(res.plan.expert_formats.items()))
                      + (f" ({m['avg_bpw']:.3f} bpw" if "avg_bpw" in m else " (")
                      + (f", predicted ΔKL {m['predicted_delta_kl']:.4g})" if "predicted_delta_kl" in m else ")"))
    for c in r.verdict.cautions + list(m.get("notes") or []):
        note(c)


def _recipes_line(counts: dict[str, int]) -> str:
    """Where convert's activation-aware int4 transforms came from, in one line."""
    parts = [f"{counts.get('stored', 0)} from the calibration", f"{counts.get('searched', 0)} searched now"]
    if counts.get("reused"):
        parts.append(f"{counts['reused']} reused (the same shard on another rank)")
    line = "int4 transforms: " + ", ".join(parts)
    if counts.get("searched"):
        line += " (the calibration stored none for those: another moe_tp, dtype or rounding, or older recipes)"
    return line


# ---- verify ----------------------------------------------------------------------------------------
@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
def verify(directory, as_json):
    """Recheck every file of a trtmoe artifact against its manifest.json (sha256), and a checkpoint's
    strict config blocks against the target TensorRT-LLM schema.

    \b
    Example:
      trtmoe verify ckpt/
    """
    from .checkpoint.verify import verify_artifact

    res = verify_artifact(directory)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        console.print(f"[green]ok[/] {directory}: {res['kind']}, {len(res['files'])} file(s) match the manifest")


# ---- run (embedded engine) -------------------------------------------------------------------------
@main.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--prompt", "-p", multiple=True, required=True, help="Prompt text (repeatable).")
@click.option("--tokenizer", type=click.Path(path_type=Path), default=None,
              help="Tokenizer directory (tokenizer.json); default: the checkpoint's own copy if any.")
@click.option("--max-new-tokens", "-n", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--cpu-activations", type=click.Choice(["float32", "model"]), default=None,
              help="On CPU, compute in float32 or in the checkpoint's dtype (model: bfloat16 weights packed for "
                   "oneDNN where the CPU has native bfloat16; half the memory, faster at real widths) "
                   "[default: what the engine dir records; float32 for a checkpoint]")
@click.option("--weights", type=click.Choice(["checkpoint", "compute"]), default="checkpoint", show_default=True,
              help="How the engine holds its weight matrices: in the checkpoint's dtype (its memory; each product "
                   "converts a block of the weight at a time) or converted to the compute dtype (float32 on CPU, "
                   "packed for oneDNN: up to 2-3x a 16-bit checkpoint's memory)")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
def run(checkpoint, prompt, tokenizer, max_new_tokens, temperature, top_k, top_p, seed, device, cpu_activations,
        weights, as_json):
    """Generate text from a checkpoint with the embedded engine.

    CHECKPOINT is a TensorRT-LLM checkpoint (`trtmoe convert`), an embedded engine dir, or a
    unified-HF checkpoint (`trtmoe convert --target trtllm-pytorch`, or ModelOpt's own export): each
    quantized linear runs its format's kernel from the packed bytes, activations quantized with the
    checkpoint's input scales.

    \b
    Example:
      trtmoe run ckpt/ --tokenizer tests/fixtures/trained_mixtral -p "def main(" -n 40
      trtmoe run unified/ -p "def main(" -n 40     # tokenizer copied in by convert
    """
    from .runtime.engine import SamplingParams, decode_summary
    from .runtime.load import load_engine, load_tokenizer

    eng = load_engine(checkpoint, None if device == "auto" else device, cpu_activations=cpu_activations,
                      weights=weights)
    tok = load_tokenizer(tokenizer or checkpoint)
    results = []
    for text in prompt:
        ids = tok.encode(text)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed, end_id=tok.eos_id)
        before = eng.decode_traffic()
        if as_json:
            out = eng.generate(ids, params)
        else:
            console.print(f"[bold]{text}[/]", end="", highlight=False)
            out = []

            def show(t, out=out):
                prev = tok.decode(out)
                out.append(t)
                console.print(tok.decode(out)[len(prev):], end="", highlight=False, markup=False)
            eng.generate(ids, params, on_token=show)
            console.print()
        results.append({"prompt": text, "output_ids": out, "text": tok.decode(out),
                        # what its decode steps read: distinct experts per MoE layer and bytes per step
                        "decode": decode_summary(eng.decode_traffic(), before,
                                                 [l for l, x in enumerate(eng.cfg.moe_layers) if x])})
    if as_json:
        click.echo(json.dumps(results, indent=2))


def _register_optional():
    """Commands living in other modules register here so ``trtmoe --help`` lists them all."""
    import importlib

    for mod, names in (("trtmoe.build.commands", ("build",)),
                       ("trtmoe.triton.commands", ("repo", "serve", "generate")),
                       ("trtmoe.quant.commands", ("calibrate", "report"))):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod:
                continue
            raise
        for n in names:
            cmd = getattr(m, n, None) or getattr(m, f"{n}_command", None)
            if isinstance(cmd, click.Command):
                main.add_command(cmd, n)


_register_optional()

if __name__ == "__main__":
    main()
