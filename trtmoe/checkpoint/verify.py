"""``trtmoe verify``: an artifact's files against its manifest, plus schema checks for checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import VerifyError
from .manifest import verify_directory
from .schema import check_strict_blocks


def verify_artifact(path: str | Path) -> dict:
    """Raise VerifyError on any mismatch; return a short summary."""
    d = Path(path)
    manifest = verify_directory(d)
    kind = manifest.get("kind")
    if kind == "trtllm-checkpoint":
        cfg = json.loads((d / "config.json").read_text())
        problems = check_strict_blocks(cfg, manifest.get("target_trtllm_version", "1.2"))
        world = cfg.get("mapping", {}).get("world_size", 1)
        missing = [f"rank{r}.safetensors" for r in range(world) if not (d / f"rank{r}.safetensors").is_file()]
        if missing:
            problems.append(f"missing rank files: {missing}")
        if problems:
            raise VerifyError("; ".join(problems), where=str(d))
    return {"path": str(d), "kind": kind, "files": manifest["files"],
            "target_trtllm_version": manifest.get("target_trtllm_version")}
