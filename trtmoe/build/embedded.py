"""``trtmoe build --backend embedded``: an engine directory for the embedded PyTorch engine.

Layout (read by ``trtmoe.runtime.load`` and ``trtmoe.triton.engine_dir``)::

    ENGINE_DIR/
      config.json     {"backend": "embedded", "checkpoint": "checkpoint", "build_config": {...},
                       "pretrained_config": <the checkpoint's config.json>}
      checkpoint/     the verified TensorRT-LLM checkpoint, unchanged (config.json, rank*.safetensors,
                      quant_cfg.json, tokenizer/, its own manifest.json)
      manifest.json   kind "embedded-engine": every file's sha256 and the source checkpoint's manifest hash

``checkpoint/`` is hard-linked from the source when both are on one filesystem (building costs one
verification pass and no copy), copied otherwise. It stays a valid TensorRT-LLM checkpoint that
``trtmoe verify`` and ``trtllm-build`` accept as is.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.atomic import atomic_directory
from ..checkpoint.manifest import MANIFEST, dump_json, write_manifest
from ..checkpoint.verify import verify_artifact
from ..errors import InputError, VerifyError
from .estimate import MemoryEstimate, estimate_memory
from .preflight import CheckpointFacts, Limits, read_checkpoint, resolve_limits

ENGINE_KIND = "embedded-engine"
CHECKPOINT_SUBDIR = "checkpoint"
BUILD_KEYS = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width",
              "tokens_per_block", "device", "cpu_matmul", "cpu_activations")
# trtllm-build's names; recorded in build_config only when set (an engine without them reads as False).
GATHER_KEYS = ("gather_context_logits", "gather_generation_logits")


@dataclass
class EmbeddedPlan:
    facts: CheckpointFacts
    limits: Limits
    config: dict  # the engine dir's config.json
    estimate: MemoryEstimate


@dataclass
class EmbeddedResult:
    out_dir: Path
    config: dict
    manifest: dict
    linked_files: int
    copied_files: int
    seconds: float


def engine_config(facts: CheckpointFacts, build: dict) -> dict:
    """The engine directory's config.json for resolved build settings."""
    bc = {k: build[k] for k in BUILD_KEYS}
    bc.update({k: True for k in GATHER_KEYS if build.get(k)})
    return {"backend": "embedded", "checkpoint": CHECKPOINT_SUBDIR, "build_config": bc, "pretrained_config": facts.config}


def plan_embedded(checkpoint: str | Path, build: dict, *, verify: bool = True) -> EmbeddedPlan:
    """Check the checkpoint (manifest hashes, the embedded engine's config reader, the limits) without
    writing anything."""
    facts = read_checkpoint(checkpoint)
    limits = resolve_limits(build, facts, "embedded")
    if verify:
        verify_artifact(facts.path)
    return EmbeddedPlan(facts, limits, engine_config(facts, limits.build),
                        estimate_memory(facts, limits.build, "embedded"))


def _copy_hashing(src: Path, dst: Path, chunk: int = 8 << 20) -> str:
    """Copy a file and return the sha256 of the bytes written, in one pass."""
    h = hashlib.sha256()
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while True:
            b = fi.read(chunk)
            if not b:
                break
            h.update(b)
            fo.write(b)
    shutil.copystat(src, dst)
    return h.hexdigest()


def _place(src: Path, dst: Path, want: str, link: bool) -> bool:
    """Hard-link ``src`` to ``dst`` (True) or copy it, checking the copy's hash (False)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link:
        try:
            os.link(src, dst)
            return True
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
    got = _copy_hashing(src, dst)
    if got != want:
        raise VerifyError(f"{src.name} changed while it was being copied (sha256 {got[:12]}… ≠ {want[:12]}…)",
                          where=str(src.parent))
    return False


def build_embedded(checkpoint: str | Path, output: str | Path, build: dict, *, force: bool = False,
                   link: bool = True) -> EmbeddedResult:
    """Verify ``checkpoint`` and write an embedded engine directory at ``output`` atomically."""
    out = Path(output).absolute()
    if out.exists() and not force:
        raise InputError("output already exists", where=str(out), hint="pass --force to replace it")
    t0 = time.perf_counter()
    plan = plan_embedded(checkpoint, build, verify=True)
    facts = plan.facts
    src_files: dict[str, str] = dict(facts.manifest["files"])
    linked = copied = 0
    with atomic_directory(out, force=force, inputs=(facts.path,), outside=(facts.path,)) as tmp:
        ck = tmp / CHECKPOINT_SUBDIR
        ck.mkdir()
        hashes = {}
        for rel, want in sorted(src_files.items()):
            if _place(facts.path / rel, ck / rel, want, link):
                linked += 1
            else:
                copied += 1
            hashes[f"{CHECKPOINT_SUBDIR}/{rel}"] = want
        # The checkpoint's own manifest comes along so checkpoint/ verifies on its own.
        shutil.copyfile(facts.path / MANIFEST, ck / MANIFEST)
        dump_json(plan.config, tmp / "config.json")
        manifest = write_manifest(
            tmp, kind=ENGINE_KIND, file_hashes=hashes, build_config=plan.config["build_config"],
            target_trtllm_version=facts.target_trtllm_version,
            source_checkpoint={"path": str(facts.path), "manifest_sha256": facts.manifest_sha256,
                               "mapping": facts.manifest.get("mapping")},
            checkpoint_placement="hard links" if copied == 0 else ("copies" if linked == 0 else "mixed"),
            estimate=plan.estimate.to_dict())
    return EmbeddedResult(out, plan.config, manifest, linked, copied, time.perf_counter() - t0)
