"""``trtmoe verify``: an artifact's files against its manifest, plus schema checks for checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import VerifyError
from ..quant.calib_schema import NonFinite, parse_calib_json
from .manifest import directory_problems
from .schema import check_strict_blocks


def verify_artifact(path: str | Path) -> dict:
    """Raise VerifyError on any mismatch; return a short summary.

    Hash mismatches and schema problems are reported together, so an edited ``config.json`` says
    both that it changed and what in it TensorRT-LLM would reject."""
    d = Path(path)
    manifest, problems = directory_problems(d)
    if manifest.get("kind") == "trtllm-checkpoint":
        problems += _checkpoint_problems(d, manifest)
    elif manifest.get("kind") == "calibration":
        problems += _calibration_problems(d)
    if problems:
        raise VerifyError(f"{len(problems)} problem(s): " + "; ".join(problems[:5]), where=str(d))
    return {"path": str(d), "kind": manifest.get("kind"), "files": manifest["files"],
            "target_trtllm_version": manifest.get("target_trtllm_version")}


def _calibration_problems(d: Path) -> list[str]:
    """calib.json must be strict JSON: a NaN or infinite ΔKL would steer every plan made from it."""
    try:
        parse_calib_json((d / "calib.json").read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return []  # already reported as a missing file
    except NonFinite as e:
        return [f"calib.json {e}"]
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return [f"calib.json is not valid JSON ({str(e)[:100]})"]
    return []


def _checkpoint_problems(d: Path, manifest: dict) -> list[str]:
    try:
        cfg = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        return []  # already reported as a missing file
    except json.JSONDecodeError as e:
        return [f"config.json is not valid JSON ({e})"]
    problems = [f"config.json {p}" for p in check_strict_blocks(cfg, manifest.get("target_trtllm_version", "1.2"))]
    world = (cfg.get("mapping") or {}).get("world_size", 1)
    missing = [f"rank{r}.safetensors" for r in range(world) if not (d / f"rank{r}.safetensors").is_file()]
    if missing:
        problems.append(f"missing rank files: {missing}")
    return problems
