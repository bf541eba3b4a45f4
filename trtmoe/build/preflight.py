"""Checks that run before ``trtmoe build`` does any work, each failing with one line that says what to do.

* ``read_checkpoint`` / ``CheckpointFacts``: what a build needs to know about a checkpoint, read from
  its ``config.json`` and ``manifest.json`` (hash verification is a separate, later step because it
  reads every byte).
* ``resolve_limits``: the build settings against each other and against the model (every
  contradiction named in one error).
* ``check_trtllm_compatible``: what the checkpoint's TensorRT-LLM release line cannot build, by the support table.
* ``find_tensorrt_llm`` / ``probe_tensorrt_llm``: TensorRT-LLM present, of the checkpoint's target
  release, and importable (the import needs the NVIDIA driver library, so it runs in a subprocess).
* ``visible_gpu_count`` / ``count_gpus`` / ``check_gpus``: GPUs for the checkpoint's world size.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.manifest import MANIFEST, read_manifest
from ..checkpoint.support import check_checkpoint_config
from ..config import INT32_MAX, SCHEMA
from ..errors import BackendUnavailable, ConfigError, InputError, UnsupportedError
from ..parallel.mapping import Mapping
from ..runtime.checkpoint_reader import CheckpointConfig, load_config
from ..targets import target_for

# The NGC Triton image that carries the pinned TensorRT-LLM (see the Dockerfile for the evidence).
NGC_IMAGE = "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
PINNED_TRTLLM = "1.2.1"
INSTALL_HINT = (f"build inside the NGC container {NGC_IMAGE} (TensorRT-LLM {PINNED_TRTLLM}; `docker build .` "
                f"with this repository's Dockerfile), or on a Linux GPU host with Python 3.10/3.12: "
                f"pip install tensorrt_llm=={PINNED_TRTLLM} --extra-index-url https://pypi.nvidia.com")

# TensorRT-LLM does not stretch max_position_embeddings by the rope factor for these scaling types.
_NO_FACTOR_ROPE = {"su", "longrope", "llama3"}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


# ---- the checkpoint ------------------------------------------------------------------------------
@dataclass
class CheckpointFacts:
    """What a build needs from a TensorRT-LLM checkpoint directory. Lengths are in tokens."""

    path: Path
    config: dict
    manifest: dict
    manifest_sha256: str
    model: CheckpointConfig  # the model it holds, as the embedded engine reads it (one reading for every backend)
    seq_len_limit: int  # max_position_embeddings stretched by the rope factor, as trtllm-build defaults it
    target_trtllm_version: str
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    granularity: str | None  # trtmoe's quantization granularity ("matrix" / "expert" / "layer"), None for float
    quant_cfg: dict | None = None  # quant_cfg.json (MIXED_PRECISION), when present

    @property
    def mapping(self) -> Mapping:
        return self.model.mapping

    @property
    def dtype(self) -> str:
        """The weight dtype's name (config.json's ``dtype``)."""
        return self.model.source_dtype

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def dense_layers(self) -> list[int]:
        return [l for l, moe in enumerate(self.model.moe_layers) if not moe]


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"no {path.name}", where=str(path.parent)) from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path.name} is not valid JSON ({e})", where=str(path.parent)) from None
    if not isinstance(data, dict):
        raise InputError(f"{path.name} is not a JSON object", where=str(path.parent))
    return data


def read_checkpoint(path: str | Path) -> CheckpointFacts:
    """Read a ``trtmoe convert`` checkpoint's config and manifest (no hashing; see ``verify``)."""

    d = Path(path)
    if not d.is_dir():
        raise InputError("checkpoint directory not found", where=str(d))
    cfg = _json(d / "config.json")
    if cfg.get("backend") == "embedded" or "pretrained_config" in cfg:
        raise InputError("this is an engine directory, not a checkpoint", where=str(d),
                         hint="pass the `trtmoe convert` output directory")
    manifest = read_manifest(d)
    if manifest.get("kind") != "trtllm-checkpoint":
        raise InputError(f"manifest kind is {manifest.get('kind')!r}, not a TensorRT-LLM checkpoint", where=str(d),
                         hint="pass the `trtmoe convert` output directory")
    # The embedded engine's own config parser: one reading of the checkpoint for every backend.
    c = load_config(d)
    quant = cfg.get("quantization") or {}
    ours = (cfg.get("trtmoe") or {}).get("quantization") or {}
    quant_cfg = _json(d / "quant_cfg.json") if (d / "quant_cfg.json").is_file() else None
    rs = cfg.get("rotary_scaling") or {}
    limit = c.max_position_embeddings
    if isinstance(rs, dict) and rs.get("type") not in _NO_FACTOR_ROPE and rs.get("factor"):
        limit = int(limit * float(rs["factor"]))
    return CheckpointFacts(
        path=d, config=cfg, manifest=manifest,
        manifest_sha256=hashlib.sha256((d / MANIFEST).read_bytes()).hexdigest(),
        model=c, seq_len_limit=limit,
        target_trtllm_version=str(manifest.get("target_trtllm_version") or "1.2"),
        quant_algo=quant.get("quant_algo"), kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
        granularity=ours.get("granularity"), quant_cfg=quant_cfg)


# ---- build settings ------------------------------------------------------------------------------
DEFAULT_MAX_INPUT_LEN = 1024  # max_input_len when not given (TensorRT-LLM's), or half of max_seq_len
@dataclass
class Limits:
    """Resolved build settings plus non-fatal notes."""

    build: dict
    notes: list[str] = field(default_factory=list)


def resolve_limits(build: dict, facts: CheckpointFacts, backend: str) -> Limits:
    """Fill ``max_seq_len`` (default: the model's limit) and check the settings against each other
    and against the model. Raises ConfigError naming every contradiction at once."""
    b = dict(build)
    if b.get("max_seq_len") is None:
        b["max_seq_len"] = facts.seq_len_limit
    if b.get("max_input_len") is None:  # the default fits the model: half of it left for the output
        b["max_input_len"] = max(1, min(DEFAULT_MAX_INPUT_LEN, b["max_seq_len"] // 2))
    b["backend"] = backend
    problems, notes = [], []
    for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        if not 1 <= b[k] <= INT32_MAX:  # settings built in code skip the schema's check
            problems.append(f"{k} {b[k]} is outside 1..{INT32_MAX} (TensorRT-LLM and Triton hold it as a "
                            "32-bit integer)")
    mi, ms, mnt = b["max_input_len"], b["max_seq_len"], b["max_num_tokens"]
    if ms > facts.seq_len_limit:
        problems.append(f"max_seq_len {ms} exceeds the model's limit {facts.seq_len_limit} "
                        f"(max_position_embeddings{' × rope factor' if facts.seq_len_limit != facts.model.max_position_embeddings else ''})")
    if mi >= ms:
        problems.append(f"max_input_len {mi} ≥ max_seq_len {ms} (a request needs room for at least one "
                        f"generated token)")
    widest = SCHEMA["build"]["max_beam_width"].maximum  # settings built in code skip the schema's check
    if not 1 <= b.get("max_beam_width", 1) <= widest:
        problems.append(f"max_beam_width {b['max_beam_width']} is outside 1..{widest:g} (the beam widths a "
                        "request may ask for)")
    target = target_for(backend)
    if mnt < mi and not target.chunks_prompts(b):
        problems.append(f"max_num_tokens {mnt} < max_input_len {mi} (a whole prompt is processed in one step"
                        + target.no_chunking_reason())
    target.check_build(b, facts.dtype, problems, notes)
    if problems:
        raise ConfigError(f"{len(problems)} contradiction(s) in the build settings: " + "; ".join(problems))
    return Limits(b, notes)


# ---- what TensorRT-LLM 1.2 can build --------------------------------------------------------------
def check_trtllm_compatible(facts: CheckpointFacts) -> list[str]:
    """Raise UnsupportedError (exit 2) for a checkpoint its TensorRT-LLM release line cannot build, by
    the support table (``trtmoe.checkpoint.support``); return its cautions (cells NVIDIA does not list)."""
    verdict = check_checkpoint_config(facts.config, facts.quant_cfg, facts.target_trtllm_version)
    verdict.raise_if_refused(where=str(facts.path), stage="build")
    return verdict.cautions


# ---- TensorRT-LLM ----------------------------------------------------------------------------------
@dataclass
class TrtllmInstall:
    version: str
    location: str
    trtllm_build: list[str]  # argv prefix that runs trtllm-build


def _release(version: str) -> tuple[int, ...]:
    m = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def version_matches(installed: str, target: str) -> bool:
    """``target`` is a release line ("1.2") or a release ("1.2.1"); ``installed`` must lie inside it."""
    t, i = _release(target), _release(installed)
    return bool(t) and i[:len(t)] == t


def _installed_version(spec) -> str | None:
    for name in ("tensorrt_llm", "tensorrt-llm"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    # A source checkout has no dist metadata; its version.py holds the string.
    for loc in spec.submodule_search_locations or []:
        f = Path(loc) / "version.py"
        if f.is_file():
            m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read_text())
            if m:
                return m.group(1)
    return None


def find_tensorrt_llm(target_version: str) -> TrtllmInstall:
    """Locate TensorRT-LLM without importing it (the import needs libcuda) and check its release line."""
    spec = importlib.util.find_spec("tensorrt_llm")
    if spec is None:
        raise BackendUnavailable(f"TensorRT-LLM is not installed for this Python ({sys.executable})",
                                 hint=INSTALL_HINT)
    version = _installed_version(spec)
    if version is None:
        raise BackendUnavailable("TensorRT-LLM is installed but its version cannot be read",
                                 where=str(spec.origin), hint=INSTALL_HINT)
    if not version_matches(version, target_version):
        raise BackendUnavailable(
            f"TensorRT-LLM {version} is installed but the checkpoint targets {target_version}",
            hint=f"use TensorRT-LLM {target_version}.x ({NGC_IMAGE}), or reconvert with "
                 f"--trtllm-version matching the installed release")
    exe = shutil.which("trtllm-build")
    argv = [exe] if exe else [sys.executable, "-m", "tensorrt_llm.commands.build"]
    return TrtllmInstall(version=version, location=str(spec.origin), trtllm_build=argv)


_PROBE = r"""
import json, sys
out = {}
try:
    import tensorrt_llm
    out["tensorrt_llm"] = str(getattr(tensorrt_llm, "__version__", "unknown"))
except BaseException as e:
    out["error"] = (type(e).__name__ + ": " + str(e)).splitlines()[0]
    print("TRTMOE_PROBE " + json.dumps(out)); sys.exit(0)
try:
    import tensorrt
    out["tensorrt"] = str(tensorrt.__version__)
except BaseException as e:
    out["tensorrt"] = None
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except BaseException as e:
    out["torch_error"] = (type(e).__name__ + ": " + str(e)).splitlines()[0]
print("TRTMOE_PROBE " + json.dumps(out))
"""


def probe_tensorrt_llm(timeout_s: float = 600.0, env: dict | None = None) -> dict:
    """Import TensorRT-LLM in a child interpreter; returns its, TensorRT's, torch's and CUDA's versions
    and the GPUs torch sees. Raises BackendUnavailable with the import error's first line."""
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s,
                           env=env)
    except subprocess.TimeoutExpired:
        raise BackendUnavailable(f"importing tensorrt_llm did not finish within {timeout_s:.0f} s") from None
    line = next((l for l in reversed(p.stdout.splitlines()) if l.startswith("TRTMOE_PROBE ")), None)
    if line is None:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise BackendUnavailable(f"importing tensorrt_llm crashed the interpreter (exit {p.returncode}): {tail}",
                                 hint=INSTALL_HINT)
    info = json.loads(line[len("TRTMOE_PROBE "):])
    if "error" in info:
        raise BackendUnavailable(f"tensorrt_llm is installed but cannot be imported here: {info['error']}",
                                 hint="the import needs the NVIDIA driver (libcuda.so.1) and MPI; run on a GPU "
                                      f"host, e.g. docker run --gpus all ... {NGC_IMAGE}")
    return info


# ---- GPUs ------------------------------------------------------------------------------------------
_GPU_LINE = re.compile(r"^GPU (\d+): (.*?) \(UUID: ([^)]+)\)")
_MIG_UUID = re.compile(r"\(UUID: (MIG-[^)]+)\)")


def parse_gpu_list(smi_text: str) -> list[tuple[int, str, str]]:
    """(index, name, uuid) of each physical GPU in ``nvidia-smi -L`` output (MIG lines ignored)."""
    out = []
    for line in smi_text.splitlines():
        m = _GPU_LINE.match(line.strip())
        if m:
            out.append((int(m.group(1)), m.group(2), m.group(3)))
    return out


def visible_gpu_count(smi_text: str, cuda_visible_devices: str | None) -> int:
    """GPUs a CUDA process would see: ``nvidia-smi -L`` lists every GPU, CUDA_VISIBLE_DEVICES narrows
    it the way the CUDA runtime does (entries by index or UUID prefix; the first invalid entry ends
    the list)."""
    gpus = parse_gpu_list(smi_text)
    if cuda_visible_devices is None:
        return len(gpus)
    seen: set = set()  # indices and UUIDs already taken
    for item in (x.strip() for x in cuda_visible_devices.split(",")):
        if not item:
            break
        if re.fullmatch(r"-?\d+", item):
            idx = int(item)
            if idx < 0 or idx >= len(gpus) or idx in seen:
                break
            seen.add(idx)
            continue
        if not item.startswith(("GPU-", "MIG-")):  # CUDA reads anything else as an index
            break
        keys = {uuid: i for i, _, uuid in gpus} | {u: u for u in _MIG_UUID.findall(smi_text)}
        hits = [k for u, k in keys.items() if u.startswith(item)]
        if len(hits) != 1 or hits[0] in seen:
            break
        seen.add(hits[0])
    return len(seen)


@dataclass
class GpuInfo:
    count: int
    names: list[str]
    how: str  # where the count came from, for messages


def count_gpus(env: dict | None = None) -> GpuInfo:
    """Visible GPUs from ``nvidia-smi -L`` and CUDA_VISIBLE_DEVICES; never imports CUDA libraries."""
    env = os.environ if env is None else env
    exe = shutil.which("nvidia-smi", path=env.get("PATH"))
    if exe is None:
        return GpuInfo(0, [], "nvidia-smi not found")
    try:
        p = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as e:
        return GpuInfo(0, [], f"nvidia-smi failed: {e}")
    if p.returncode != 0:
        first = (p.stderr or p.stdout).strip().splitlines()
        return GpuInfo(0, [], f"nvidia-smi failed: {first[0] if first else f'exit {p.returncode}'}")
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    n = visible_gpu_count(p.stdout, cvd)
    names = [name for _, name, _ in parse_gpu_list(p.stdout)]
    how = "nvidia-smi -L" + (f", CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None else "")
    return GpuInfo(n, names, how)


def check_gpus(world_size: int, gpus: GpuInfo, *, allow_fewer: bool = False) -> None:
    """trtllm-build needs a GPU even to build (it sets a CUDA device per rank); serving needs one per rank."""
    if gpus.count == 0:
        raise BackendUnavailable(f"no GPU visible ({gpus.how}); trtllm-build needs a GPU of the architecture "
                                 f"the engine will run on", hint="run on a GPU host (docker run --gpus all ...)")
    if gpus.count < world_size and not allow_fewer:
        raise BackendUnavailable(
            f"the checkpoint's mapping has world size {world_size} (tp × pp) but {gpus.count} GPU(s) are visible "
            f"({gpus.how})", hint="serving needs one GPU per rank; to build all ranks one after another on "
                                  "fewer GPUs of the same architecture, pass --allow-fewer-gpus")
