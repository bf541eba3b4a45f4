"""Click commands for the Triton stage: ``repo``, ``serve`` and ``generate``.

They are plain ``click.Command`` objects for the main ``trtmoe`` group to register; each parses
options, calls one library function and renders its result. Errors are ``trtmoe.errors`` classes
(InputError -> exit 2), which the main group turns into one-line messages.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import click

from .. import config as cfgmod
from ..errors import InputError


def _echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


_CONFIG = click.option("-c", "--config", "config_path", type=click.Path(path_type=Path), default=None,
                       help="YAML config (see build_configs/); its repo/serve section sets these options and "
                            "the command line overrides it.")


@click.command("repo")
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Model repository to write (replaced only with --force).")
@_CONFIG
@cfgmod.click_options("repo")
@click.option("--force", is_flag=True, help="Replace an existing repository.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def repo_command(engine_dir, out_dir, config_path, force, as_json, **options):
    """Write a Triton model repository for ENGINE_DIR.

    ENGINE_DIR is a `trtmoe build --backend embedded` or `trtllm-build` engine directory; every
    setting comes from its config.json. The repository holds ensemble, preprocessing, tensorrt_llm,
    postprocessing and tensorrt_llm_bls, with the tokenizer copied in; with `--layout llmapi` (embedded
    engines) one text-in, text-out tensorrt_llm model instead, as TensorRT-LLM 1.2's llmapi model.
    Options merge command line > the `repo:` section of -c CONFIG > defaults.

    \b
    Example:
      trtmoe repo engine/ -o repo/ --max-batch-size 8
      trtmoe repo engine/ -o repo-stream/ --streaming --exclude-input
      trtmoe repo engine/ -o repo-llmapi/ --layout llmapi --streaming
      trtmoe repo engine/ -o repo/ -c build_configs/tiny-cpu.yaml
      trtmoe serve repo/
    """
    from .repository import RepositorySettings, generate_repository

    if _is_unified_checkpoint(engine_dir):
        return _unified_repo(engine_dir, out_dir, config_path, force, as_json, options)
    kw = dict(cfgmod.resolve(config_path, cfgmod.from_cli(options, "repo"))["repo"])
    kw["tokenizer_dir"] = kw.pop("tokenizer")
    r = generate_repository(engine_dir, out_dir, RepositorySettings.from_options(**kw), force=force)
    if as_json:
        _echo_json({"path": str(r.path), "engine": r.engine.to_json(), "settings": r.settings.__dict__,
                    "launch_world_size": r.launch_world_size, "models": r.models, "warnings": r.warnings})
        return
    s, e = r.settings, r.engine
    click.echo(f"wrote {r.path}")
    click.echo(f"  engine         {e.path} ({'embedded' if e.backend == 'embedded' else 'TensorRT-LLM'}, {e.architecture})"
               + (f"; served from {s.engine_path}" if s.engine_path else ""))
    click.echo(f"  models         {', '.join(r.models)}")
    llmapi = r.layout == "llmapi"
    batch = (f"{s.max_batch_size} sequences decoded together (one prompt per request)" if llmapi
             else f"{s.max_batch_size} (engine {e.max_batch_size})")
    click.echo(f"  max_batch_size {batch}; max_input_len {s.max_input_len}; max_seq_len {s.max_seq_len}; "
               f"beam {s.max_beam_width}")
    decoupled = "decoupled tensorrt_llm" if llmapi else "decoupled tensorrt_llm, BLS and ensemble"
    click.echo(f"  streaming      {f'yes ({decoupled})' if s.streaming else 'no (not decoupled; --streaming to stream)'}")
    if llmapi:
        click.echo("  inputs         text_input, streaming, sampling_param_* (TensorRT-LLM 1.2's llmapi model); "
                   "text_output is the generated text")
    else:
        click.echo(f"  prompt         {'left out of' if s.exclude_input_in_output else 'included in'} non-streamed "
                   "outputs (per request: exclude_input_in_output)")
    if e.backend == "embedded":
        click.echo(f"  torch threads  {s.torch_num_threads}")
        if s.decode_cores:
            click.echo(f"  decode cores   {s.decode_cores} (the decode thread alone there; every other thread on "
                       "the rest)")
    click.echo(f"  tokenizer      {r.tokenizer_dir}")
    for w in r.warnings:
        click.echo(f"  warning: {w}", err=True)
    click.echo(f"next: trtmoe serve {r.path}" + (f"  (runs {r.launch_world_size} MPI ranks)" if r.launch_world_size > 1 else ""))


def _is_unified_checkpoint(path: Path) -> bool:
    """A checkpoint `convert --target trtllm-pytorch|vllm|sglang` wrote (its manifest's kind)."""
    import json

    try:
        return json.loads((Path(path) / "manifest.json").read_text()).get("kind") == "unified-hf-checkpoint"
    except (OSError, ValueError, AttributeError):
        return False


def _unified_repo(ckpt: Path, out_dir: Path, config_path, force: bool, as_json: bool, options: dict) -> None:
    """`repo` for a unified-HF checkpoint: upstream's llmapi layout (model.yaml of LLM() arguments)."""
    from ..build.unified_hf import gpu_commands, write_llmapi_repository

    cfg = cfgmod.resolve(config_path, cfgmod.from_cli(options, "repo"))
    cv, r = cfg.get("convert", {}), cfg["repo"]
    tp, ep = int(cv.get("tp") or 1), int(cv.get("moe_ep") or 1)
    build = {k: r[k] for k in ("max_batch_size", "max_seq_len") if r.get(k)}
    man = write_llmapi_repository(ckpt, out_dir, tp=tp, ep=ep, build=build, force=force)
    if as_json:
        _echo_json({"path": str(out_dir), "manifest": man})
        return
    click.echo(f"wrote {out_dir} (llmapi layout: tensorrt_llm/config.pbtxt, tensorrt_llm/1/model.yaml)")
    click.echo(f"  model.yaml     model: {Path(ckpt).absolute()}, backend: pytorch, tensor_parallel_size {tp}, "
               f"moe_expert_parallel_size {ep}")
    click.echo("  model.py       upstream's, from the TensorRT-LLM container on the GPU host:")
    click.echo("  " + gpu_commands(ckpt, tp=tp, ep=ep, build=build, repo=out_dir)["triton"])
    click.echo(f"next: trtmoe serve {out_dir}  (here, without upstream's model.py: the embedded engine on CPU; "
               "--print-command for the trtllm-serve, vLLM and SGLang command lines)")


def _unified_print_command(repo: Path) -> bool:
    """`serve --print-command` for an llmapi repository of a unified-HF checkpoint: the GPU command lines."""
    import json

    from ..build.unified_hf import gpu_commands

    try:
        man = json.loads((Path(repo) / "trtmoe_repository.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(man, dict) or not str(man.get("contract", "")).endswith("(PyTorch backend)"):
        return False
    mp = man.get("mapping") or {}
    for name, cmd in gpu_commands(man["checkpoint"], tp=mp.get("tp", 1), ep=mp.get("ep", 1), repo=repo).items():
        click.echo(f"# {name}\n{cmd}")
    click.echo(f"# this host, without upstream's model.py beside model.yaml: the embedded engine (CPU)\n"
               f"trtmoe serve {repo}")
    return True


@click.command("serve")
@click.argument("repo", type=click.Path(path_type=Path))
@_CONFIG
@cfgmod.click_options("serve", skip=("log_verbose",))
@click.option("--log-file", type=click.Path(path_type=Path), default=None, help="Server log [default: a temp file].")
@cfgmod.click_options("serve", "log_verbose")
@click.option("--print-command", is_flag=True, help="Print the launch command and environment, do not start.")
def serve_command(repo, config_path, log_file, print_command, **options):
    """Start tritonserver on a model repository and serve until Ctrl-C.

    Uses the NGC container's tritonserver (mpirun with one rank per engine rank for TensorRT
    engines) or, on CPU machines, the Triton binary of the nvidia-pytriton wheel with its Python
    backend running in this Python environment. An llmapi repository of a unified-HF checkpoint
    (`trtmoe repo <checkpoint>`) without upstream's model.py beside its model.yaml is served by the
    embedded engine on CPU, through the same llmapi inputs and outputs.

    \b
    Options merge command line > the `serve:` section of -c CONFIG > defaults.

    \b
    Example:
      trtmoe serve repo/ --grpc-port 8001
      trtmoe serve repo/ -c build_configs/tiny-cpu.yaml
      trtmoe generate "def main(" --url 127.0.0.1:8001
    """
    from .unified_repo import embedded_repository, needs_embedded_engine

    if print_command and _unified_print_command(repo):
        return
    work = None
    if needs_embedded_engine(repo):
        # A unified-HF checkpoint's llmapi repository without upstream's model.py: the embedded engine
        # serves it on CPU through the same contract, from a repository made for it.
        work = Path(tempfile.mkdtemp(prefix="trtmoe-llmapi-cpu-"))
        try:
            made = embedded_repository(repo, work)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        click.echo(f"{repo}: no model.py beside model.yaml, so the embedded engine serves its checkpoint on this "
                   f"host (repository {made.path})", err=True)
        repo = made.path
    try:
        _serve(repo, config_path, log_file, print_command, options)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _serve(repo, config_path, log_file, print_command, options):
    from . import cpu_binding
    from .serve import (Endpoints, build_launch_command, decode_binding, find_tritonserver, read_repository_manifest,
                        run_until_signalled, serve_repository, server_environment)

    o = cfgmod.resolve(config_path, cfgmod.from_cli(options, "serve"))["serve"]
    host, http_port, grpc_port, metrics_port = o["host"], o["http_port"], o["grpc_port"], o["metrics_port"]
    world_size, server, timeout_s, log_verbose = o["world_size"], o["server"], float(o["timeout_s"]), o["log_verbose"]

    if print_command:
        install = find_tritonserver(server)
        ws = world_size or int(read_repository_manifest(repo).get("launch_world_size", 1) or 1)
        backend_dir = (Path("<workspace>") / "backends") if install.kind == "pytriton" else None
        cmd = build_launch_command(repo, install, endpoints=Endpoints(host, http_port, grpc_port, metrics_port),
                                   world_size=ws, backend_dir=backend_dir)
        env = server_environment(install)
        binding = decode_binding(Path(repo))
        if isinstance(binding, tuple):  # as serve_repository starts it: the decode cores left to the model
            env[cpu_binding.ENV] = cpu_binding.format_cores(binding[0])
            cmd = ["taskset", "-c", cpu_binding.format_cores(binding[1]), *cmd]
        elif binding is not None:
            click.echo(f"# decode_cores not applied: {binding}", err=True)
        for key in ("LD_LIBRARY_PATH", "PYTHONPATH", cpu_binding.ENV):
            if env.get(key):
                click.echo(f"{key}={env[key]}")
        click.echo(" ".join(cmd))
        if o["http_max_body_mb"]:
            click.echo(f"# trtmoe serve itself listens on the HTTP port (bodies over {o['http_max_body_mb']:g} MiB "
                       "answered 413) and gives tritonserver another one on 127.0.0.1", err=True)
        return
    click.echo(f"starting tritonserver on {repo} (waiting up to {timeout_s:.0f} s for the models to load)...", err=True)
    srv = serve_repository(repo, host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                           world_size=world_size, server=server, timeout_s=timeout_s, log_file=log_file,
                           log_verbose=log_verbose, max_http_body_bytes=int(float(o["http_max_body_mb"]) * 2**20))

    def ready(s):
        ep = s.endpoints
        click.echo(f"ready: gRPC {ep.grpc}   HTTP {ep.http}   metrics {ep.metrics}")
        click.echo(f"log: {s.log_path}   (Ctrl-C to stop)")
        if s.binding:
            click.echo(f"cores: {s.binding}", err=not s.cpu_cores)
        click.echo(f'try: trtmoe generate "def main(" --url {ep.grpc}')
        sys.stdout.flush()

    window_s = float(o["restart_window_s"])
    within = f" within {window_s:g} s" if window_s > 0 else ""

    def restarting(s, reason, n):
        count = f"{n} of {o['restart']}{within}" if n <= int(o["restart"]) else f"restart {n}{within}, after a back-off"
        click.echo(f"restarting tritonserver ({count}): {reason}", err=True)

    def restarted(s, n):
        click.echo(f"ready again after restart {n}: gRPC {s.endpoints.grpc}", err=True)

    def backing_off(s, reason, why, wait_s):
        click.echo(f"tritonserver failed again: {reason}; {why}: restarting in {wait_s:g} s", err=True)

    run_until_signalled(srv, on_ready=ready, restarts=int(o["restart"]), restart_window_s=window_s,
                        timeout_s=timeout_s, on_restart=restarting, on_restarted=restarted,
                        backoff_max_s=float(o["restart_backoff_s"]), on_backoff=backing_off)
    click.echo("stopped", err=True)


@click.command("generate")
@click.argument("prompt")
@click.option("--url", default="127.0.0.1:8001", show_default=True, help="Triton gRPC endpoint host:port.")
@click.option("--model", default=None, help="ensemble, tensorrt_llm_bls, or tensorrt_llm of an llmapi repository "
                                            "[default: the ensemble, or that tensorrt_llm where the server has no "
                                            "ensemble]")
@click.option("-n", "--max-tokens", type=int, default=64, show_default=True)
@click.option("--stream/--no-stream", default=None, help="[default: stream when the model is decoupled]")
@click.option("--include-input", is_flag=True, help="Ask for the prompt in front of the completion (non-streamed).")
@click.option("--unary", is_flag=True, help="Use a unary ModelInfer call (only for non-decoupled models).")
@click.option("--temperature", type=float, default=None)
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--stop", "stop_words", multiple=True, help="Stop string (repeatable).")
@click.option("--beam-width", type=int, default=None,
              help="Beam search of this width (up to the engine's --max-beam-width); prints every beam, best first.")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print text and timings as JSON at the end.")
def generate_command(prompt, url, model, max_tokens, stream, include_input, unary, temperature, top_k, top_p, seed,
                     stop_words, beam_width, timeout_s, as_json):
    """Generate text from a served model over gRPC, printing tokens as they arrive.

    Decoupled models (a `trtmoe repo --streaming` repository) are called through the gRPC stream;
    others (the default repository) with a unary call. Only the completion is printed unless
    --include-input. A call that cannot work (e.g. --unary to a decoupled model) is
    refused with the reason.

    \b
    Example:
      trtmoe generate "def main(" -n 40 --url 127.0.0.1:8001
      trtmoe generate "import os" --model tensorrt_llm_bls --top-k 20 --seed 1
      trtmoe generate "class A:" --beam-width 2   # an engine built with --max-beam-width 2
    """
    from .client import generate

    if unary and stream:
        raise InputError("--unary and --stream contradict each other")
    on_text = None if as_json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
    r = generate(url, prompt, model=model, max_tokens=max_tokens, stream=stream, unary=unary, on_text=on_text,
                 timeout_s=timeout_s, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                 stop_words=list(stop_words) or None, exclude_input_in_output=not include_input,
                 beam_width=beam_width)
    if as_json:
        _echo_json({"model": r.model, "text": r.text, "streamed": r.streamed, "responses": len(r.pieces),
                    "ttft_s": r.ttft_s, "total_s": r.total_s, **({"beams": r.beams} if r.beams else {})})
    else:
        for i, text in enumerate(r.beams):
            sys.stdout.write(f"--- beam {i}\n{text}\n")
        sys.stdout.write("" if r.beams else "\n")
        click.echo(f"[{len(r.pieces)} responses, first text after {(r.ttft_s or 0) * 1000:.0f} ms, "
                   f"total {r.total_s * 1000:.0f} ms]", err=True)


COMMANDS = (repo_command, serve_command, generate_command)
