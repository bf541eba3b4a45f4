"""The ``trtmoe build`` command (registered by ``trtmoe.cli``)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from .. import config as cfgmod
from ..console import console
from ..errors import ConfigError


def _echo_lines(lines: list[str], err: bool = False) -> None:
    for line in lines:
        click.echo(line, err=err)


@click.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="Engine directory to write (atomically).")
@click.option("-c", "--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="YAML build config (its `build:` section); CLI options override it.")
@cfgmod.click_options("build")
@click.option("--dry-run", is_flag=True,
              help="Check everything that needs no GPU, print the exact command (tensorrt-llm) or engine "
                   "config (embedded) and a memory estimate; write nothing.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--allow-fewer-gpus", is_flag=True,
              help="tensorrt-llm: build every rank one after another on fewer GPUs than the world size.")
@click.option("--copy", "copy_files", is_flag=True,
              help="embedded: copy the checkpoint instead of hard-linking it.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def build(checkpoint, out, config_path, dry_run, force, allow_fewer_gpus, copy_files, as_json, **options):
    """Build an engine directory from a `trtmoe convert` checkpoint.

    Settings merge CLI > YAML (`build:` section) > defaults. Every check that needs no GPU runs
    before any work: the settings against each other and the model (each contradiction named), what
    TensorRT-LLM 1.2 can build (per-expert quantization, Qwen dense layers, DeepSeek dense layers
    other than layer 0), TensorRT-LLM installed at the checkpoint's target release, enough GPUs for
    the checkpoint's world size, and every file against the checkpoint's manifest.

    \b
    Examples:
      trtmoe build ckpt/ -o engine/ --backend embedded --max-batch-size 32 --max-input-len 256
      trtmoe build ckpt/ -o engine/ -c build_configs/mixtral-8x7b-ep8.yaml --dry-run
      trtmoe build ckpt/ -o engine/ --backend tensorrt-llm --max-seq-len 4096 --workers 4
      trtmoe verify engine/
    """
    _refuse_unified(checkpoint)
    cfg = cfgmod.resolve(config_path, cfgmod.from_cli(options, "build"))
    b = cfg["build"]
    _check_layout(checkpoint, cfgmod.load_yaml(config_path).get("convert") or {}, config_path)
    from ..targets import target_for

    step = target_for(b["backend"]).build_backend  # the builder of the target's engine directory
    if step == "tensorrt-llm":
        _tensorrt_llm(checkpoint, out, b, dry_run=dry_run, force=force, allow_fewer_gpus=allow_fewer_gpus,
                      as_json=as_json)
    elif step == "embedded":
        _embedded(checkpoint, out, b, dry_run=dry_run, force=force, link=not copy_files, as_json=as_json)
    else:
        raise ConfigError(f"backend {b['backend']!r} has no build step: its engines load the checkpoint as it is")


def _check_layout(checkpoint, convert: dict, config_path) -> None:
    """The parallel layout is the checkpoint's (``convert`` wrote it): a YAML config whose ``convert``
    section asks for another one is refused, naming both, instead of being silently overridden."""
    asked = {k: convert[k] for k in ("tp", "pp", "moe_tp", "moe_ep") if convert.get(k) is not None}
    if not asked or not (Path(checkpoint) / "config.json").is_file():
        return  # nothing asked; a missing checkpoint is named by the build itself
    from ..runtime.checkpoint_reader import load_config

    mp = load_config(checkpoint).mapping
    have = {"tp": mp.tp_size, "pp": mp.pp_size, "moe_tp": mp.moe_tp_size, "moe_ep": mp.moe_ep_size}
    differ = [f"{k} {v} (the checkpoint's {have[k]})" for k, v in asked.items() if have[k] != v]
    if differ:
        raise ConfigError(f"convert section asks for {', '.join(differ)}; build uses the checkpoint's layout "
                          f"({mp.describe()})", where=str(config_path),
                          hint="convert the model again with this layout, or drop those keys")


def _refuse_unified(checkpoint) -> None:
    """A unified-HF checkpoint has no build step: the engines load it as it is."""
    from ..errors import InputError

    try:
        kind = json.loads((Path(checkpoint) / "manifest.json").read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return
    if kind == "unified-hf-checkpoint":
        raise InputError("a unified-HF checkpoint (convert --target trtllm-pytorch / vllm / sglang) has no build step: "
                         "TensorRT-LLM's PyTorch backend, vLLM and SGLang load it directly", where=str(checkpoint),
                         hint=f"trtmoe repo {checkpoint} -o REPO (Triton llmapi), then trtmoe serve REPO "
                              "--print-command for the trtllm-serve / vLLM / SGLang command lines")


def _tensorrt_llm(checkpoint, out, b, *, dry_run, force, allow_fewer_gpus, as_json):
    from .estimate import render_estimate
    from .tensorrt_llm import build_tensorrt_llm, environment_notes, plan_tensorrt_llm

    if dry_run:
        plan = plan_tensorrt_llm(checkpoint, out, b)
        env = environment_notes(plan.facts)
        if as_json:
            click.echo(json.dumps({"backend": "tensorrt-llm", "dry_run": True, "command": plan.argv,
                                   "build_config": plan.limits.build, "notes": plan.limits.notes,
                                   "environment": env, "estimate": plan.estimate.to_dict()}, indent=2))
            return
        click.echo(f"checkpoint {plan.facts.path}: verified; {plan.facts.mapping.describe()}, {plan.facts.dtype}, "
                   f"quant_algo {plan.facts.quant_algo}")
        click.echo("command (dry run, not executed):")
        click.echo("  " + shlex.join(plan.argv))
        _echo_lines(render_estimate(plan.estimate, plan.facts.dtype))
        _echo_lines([f"note: {n}" for n in plan.limits.notes])
        _echo_lines([f"environment: {n}" for n in env])
        return
    res = build_tensorrt_llm(checkpoint, out, b, force=force, allow_fewer_gpus=allow_fewer_gpus,
                             log=lambda s: click.echo(s, err=True))
    if as_json:
        click.echo(json.dumps({"output": str(res.out_dir), "command": res.argv, "seconds": res.seconds,
                               "versions": res.manifest.get("versions")}, indent=2))
    else:
        console.print(f"[green]wrote[/] {res.out_dir} in {res.seconds:.1f} s — TensorRT-LLM "
                      f"{res.manifest['versions'].get('tensorrt_llm')}, "
                      f"{len([f for f in res.manifest['files'] if f.endswith('.engine')])} rank engine(s)")


def _embedded(checkpoint, out, b, *, dry_run, force, link, as_json):
    from .embedded import build_embedded, plan_embedded
    from .estimate import render_estimate

    if dry_run:
        plan = plan_embedded(checkpoint, b)
        if as_json:
            click.echo(json.dumps({"backend": "embedded", "dry_run": True, "output": str(out),
                                   "build_config": plan.config["build_config"], "notes": plan.limits.notes,
                                   "estimate": plan.estimate.to_dict()}, indent=2))
            return
        click.echo(f"checkpoint {plan.facts.path}: verified; {plan.facts.mapping.describe()}, {plan.facts.dtype}")
        click.echo(f"would write {out}/config.json with build_config "
                   f"{json.dumps(plan.config['build_config'], sort_keys=True)} and the checkpoint under "
                   f"{out}/checkpoint/ (dry run: nothing written)")
        _echo_lines(render_estimate(plan.estimate, plan.facts.dtype))
        return
    res = build_embedded(checkpoint, out, b, force=force, link=link)
    if as_json:
        click.echo(json.dumps({"output": str(res.out_dir), "build_config": res.config["build_config"],
                               "linked_files": res.linked_files, "copied_files": res.copied_files,
                               "seconds": res.seconds}, indent=2))
    else:
        bc = res.config["build_config"]
        how = "hard-linked" if res.copied_files == 0 else ("copied" if res.linked_files == 0 else "linked/copied")
        console.print(f"[green]wrote[/] {res.out_dir} in {res.seconds:.1f} s — embedded engine, checkpoint {how} "
                      f"({res.linked_files + res.copied_files} files); max_batch_size {bc['max_batch_size']}, "
                      f"max_input_len {bc['max_input_len']}, max_seq_len {bc['max_seq_len']}")
