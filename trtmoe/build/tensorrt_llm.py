"""``trtmoe build --backend tensorrt-llm``: run the pinned TensorRT-LLM 1.2.x ``trtllm-build`` on a
verified checkpoint and record what was built.

Parallelism is not a build flag: ``trtllm-build`` reads tp/pp/moe_tp/moe_ep from the checkpoint's
``mapping`` and builds one ``rank{N}.engine`` per rank. The engine goes into a temporary sibling of the
output directory; only a complete build (``config.json`` plus every rank engine) is renamed into place,
with a ``manifest.json`` recording the command, the versions and the source checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..checkpoint.atomic import atomic_directory, check_output_spares_inputs
from ..checkpoint.manifest import write_manifest
from ..checkpoint.verify import verify_artifact
from ..errors import InputError, TrtmoeError
from .estimate import MemoryEstimate, estimate_memory
from .preflight import (CheckpointFacts, GpuInfo, Limits, TrtllmInstall, check_gpus, check_trtllm_compatible,
                        count_gpus, find_tensorrt_llm, probe_tensorrt_llm, read_checkpoint, resolve_limits)

ENGINE_KIND = "trtllm-engine"


def _onoff(v: bool) -> str:
    return "enable" if v else "disable"


def trtllm_build_argv(checkpoint_dir: str | Path, output_dir: str | Path, build: dict,
                      program: list[str] | None = None) -> list[str]:
    """The exact ``trtllm-build`` argv for resolved build settings (``max_seq_len`` already filled).

    Every setting is passed explicitly, so the engine does not depend on the defaults of the
    installed release. Paths are made absolute so the command can be re-run from anywhere."""
    b = build
    return [*(program or ["trtllm-build"]),
            "--checkpoint_dir", str(Path(checkpoint_dir).absolute()),
            "--output_dir", str(Path(output_dir).absolute()),
            "--gemm_plugin", b["gemm_plugin"],
            "--gpt_attention_plugin", b["gpt_attention_plugin"],
            "--moe_plugin", b["moe_plugin"],
            "--max_batch_size", str(b["max_batch_size"]),
            "--max_input_len", str(b["max_input_len"]),
            "--max_seq_len", str(b["max_seq_len"]),
            "--max_num_tokens", str(b["max_num_tokens"]),
            "--max_beam_width", str(b["max_beam_width"]),
            "--kv_cache_type", b["kv_cache_type"],
            "--tokens_per_block", str(b["tokens_per_block"]),
            "--context_fmha", _onoff(b["context_fmha"]),
            "--use_paged_context_fmha", _onoff(b["use_paged_context_fmha"]),
            "--remove_input_padding", _onoff(b["remove_input_padding"]),
            "--workers", str(b["workers"]),
            "--log_level", "info",
            # trtllm-build's switches (store_true there): only when asked, like the release's own default.
            *(["--gather_context_logits"] if b.get("gather_context_logits") else []),
            *(["--gather_generation_logits"] if b.get("gather_generation_logits") else [])]


@dataclass
class Plan:
    """Everything decided before building: the checkpoint, resolved settings, argv and estimate."""

    facts: CheckpointFacts
    limits: Limits
    argv: list[str]
    estimate: MemoryEstimate
    environment: list[str] = field(default_factory=list)  # dry-run notes about this machine


@dataclass
class BuildResult:
    out_dir: Path
    argv: list[str]
    manifest: dict
    seconds: float


def plan_tensorrt_llm(checkpoint: str | Path, output: str | Path, build: dict, *, verify: bool = True) -> Plan:
    """Cheap checks first (settings, what TensorRT-LLM can build), then the hash verification; no GPU
    and no TensorRT-LLM needed. Used by ``--dry-run`` and as the first half of a real build."""
    facts = read_checkpoint(checkpoint)
    check_output_spares_inputs(output, (facts.path,), what="engine directory")
    limits = resolve_limits(build, facts, "tensorrt-llm")
    limits.notes.extend(check_trtllm_compatible(facts))
    if verify:
        verify_artifact(facts.path)
    argv = trtllm_build_argv(facts.path, output, limits.build)
    return Plan(facts, limits, argv, estimate_memory(facts, limits.build, "tensorrt-llm"))


def environment_notes(facts: CheckpointFacts, *, gpus: GpuInfo | None = None) -> list[str]:
    """What a real build would find missing on this machine (for ``--dry-run``; never raises)."""
    notes = []
    try:
        inst = find_tensorrt_llm(facts.target_trtllm_version)
        notes.append(f"TensorRT-LLM {inst.version} found ({inst.location})")
    except TrtmoeError as e:
        notes.append(f"a real build would stop here: {e.render()}")
    g = gpus or count_gpus()
    world = facts.mapping.world_size
    if g.count < world:
        notes.append(f"a real build needs GPUs: {g.count} visible ({g.how}), world size {world}")
    else:
        notes.append(f"{g.count} GPU(s) visible ({g.how})")
    return notes


def _driver_version(env: dict) -> str | None:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = p.stdout.strip().splitlines()
    return lines[0].strip() if p.returncode == 0 and lines else None


def build_tensorrt_llm(checkpoint: str | Path, output: str | Path, build: dict, *, force: bool = False,
                       allow_fewer_gpus: bool = False, log: Callable[[str], None] | None = None,
                       env: dict | None = None) -> BuildResult:
    """Preflight, run ``trtllm-build`` into a temporary sibling of ``output`` while streaming its log,
    check the result and rename it into place with a manifest. Raises before any work if a check fails."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    env = dict(os.environ if env is None else env)
    out = Path(output).absolute()
    if out.exists() and not force:
        raise InputError("output already exists", where=str(out), hint="pass --force to replace it")
    plan = plan_tensorrt_llm(checkpoint, out, build, verify=False)
    facts = plan.facts
    inst: TrtllmInstall = find_tensorrt_llm(facts.target_trtllm_version)
    gpus = count_gpus(env)
    check_gpus(facts.mapping.world_size, gpus, allow_fewer=allow_fewer_gpus)
    verify_artifact(facts.path)
    versions = probe_tensorrt_llm(env=env)
    versions["tensorrt_llm_dist"] = inst.version
    versions["driver"] = _driver_version(env)
    t0 = time.perf_counter()
    with atomic_directory(out, force=force, inputs=(facts.path,)) as tmp:
        argv = [*inst.trtllm_build, *trtllm_build_argv(facts.path, tmp, plan.limits.build)[1:]]
        log("running: " + " ".join(argv))
        log_path = tmp / "build.log"
        with open(log_path, "w") as logf:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    bufsize=1)
            try:
                for line in proc.stdout:
                    logf.write(line)
                    log(line.rstrip("\n"))
                rc = proc.wait()
            finally:
                if proc.poll() is None:  # interrupted: do not leave a builder running on the GPUs
                    proc.terminate()
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
        if rc != 0:
            tail = [l for l in log_path.read_text().splitlines() if l.strip()][-1:] or ["no output"]
            raise TrtmoeError(f"trtllm-build failed with exit code {rc}: {tail[0]}",
                              hint="the full log was streamed above; nothing was written")
        world = facts.mapping.world_size
        missing = [n for n in ["config.json", *(f"rank{r}.engine" for r in range(world))] if not (tmp / n).is_file()]
        if missing:
            raise TrtmoeError(f"trtllm-build exited 0 but did not write {', '.join(missing)}")
        shown = trtllm_build_argv(facts.path, out, plan.limits.build)
        manifest = write_manifest(
            tmp, kind=ENGINE_KIND, file_hashes={},
            command=shown, command_note="run with --output_dir set to a temporary sibling, then renamed",
            versions=versions, gpus={"count": gpus.count, "names": gpus.names, "how": gpus.how},
            build_config=plan.limits.build, target_trtllm_version=facts.target_trtllm_version,
            source_checkpoint={"path": str(facts.path), "manifest_sha256": facts.manifest_sha256,
                               "mapping": facts.manifest.get("mapping")},
            estimate=plan.estimate.to_dict())
    return BuildResult(out, shown, manifest, time.perf_counter() - t0)
