"""manifest.json: what produced an artifact and the sha256 of every file in it; ``verify`` rechecks."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import __version__
from ..errors import InputError, VerifyError
from ..hf.hashing import sha256_file

MANIFEST = "manifest.json"
# A Triton model repository keeps its manifest under a name of its own (its root holds model folders).
REPOSITORY_MANIFEST = "trtmoe_repository.json"
MANIFEST_NAMES = (MANIFEST, REPOSITORY_MANIFEST)


def is_bytecode_cache(rel: str) -> bool:
    """Python's bytecode cache (a ``__pycache__`` folder, a ``.pyc`` file): what an interpreter writes
    beside the Python files it imports (Triton's Python backend does, into model folders), never part
    of an artifact; manifests neither list it nor count it as an unlisted file."""
    parts = rel.split("/")
    return "__pycache__" in parts or parts[-1].endswith((".pyc", ".pyo"))


def manifest_file(path: str | Path) -> Path | None:
    """The manifest of the artifact at ``path`` (checkpoint, engine, calibration, report or model
    repository), or None when it has none."""
    for name in MANIFEST_NAMES:
        if (Path(path) / name).is_file():
            return Path(path) / name
    return None


def dump_json(obj, path: Path) -> None:
    """Deterministic JSON (sorted keys, fixed separators) so identical inputs give identical bytes."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_manifest(out_dir: Path, *, kind: str, file_hashes: dict[str, str], name: str = MANIFEST, **fields) -> dict:
    """Record the artifact in ``name`` (one of MANIFEST_NAMES). ``file_hashes`` covers every file
    except the manifest itself; any file in the directory that is not listed is hashed here."""
    assert name in MANIFEST_NAMES, name
    hashes = dict(file_hashes)
    for p in sorted(out_dir.rglob("*")):
        rel = p.relative_to(out_dir).as_posix()
        if p.is_file() and rel not in MANIFEST_NAMES and rel not in hashes and not is_bytecode_cache(rel):
            hashes[rel] = sha256_file(p)
    manifest = {"tool": "trtmoe", "tool_version": __version__, "kind": kind,
                "files": dict(sorted(hashes.items())), **fields}
    dump_json(manifest, out_dir / name)
    return manifest


def read_repository_manifest(repo: str | Path) -> dict:
    """The manifest ``trtmoe repo`` wrote into a Triton repository, or {} for a repository from
    elsewhere (none there); a manifest that is not valid is an error, never read as empty."""
    if not (Path(repo) / REPOSITORY_MANIFEST).is_file():
        return {}
    return read_manifest(repo)


def read_manifest(path: str | Path) -> dict:
    d = Path(path)
    f = manifest_file(d)
    if f is None:
        raise InputError(f"no {MANIFEST}; not a trtmoe artifact", where=str(d),
                         hint="produce it with `trtmoe convert`, `calibrate`, `build` or `repo`")
    try:
        manifest = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VerifyError(f"{f.name} is not valid JSON ({e})", where=str(d)) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        raise VerifyError(f"{f.name} must be an object whose 'files' maps paths to sha256", where=str(d))
    for rel, want in manifest.get("files", {}).items():
        problem = unsafe_member(d, rel)
        if problem or not isinstance(want, str):
            raise VerifyError(f"{f.name} lists {rel!r}: {problem or 'its sha256 is not a string'}", where=str(d))
    return manifest


def unsafe_member(root: Path, rel: str) -> str | None:
    """Why ``rel`` is not a plain relative path to a file inside ``root`` (None when it is): no
    absolute paths, no ``..``, no empty parts, no link that leads out of the artifact."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts):
        return "not a plain relative path inside the artifact"
    real, top = Path(os.path.realpath(root / rel)), Path(os.path.realpath(root))
    if top not in real.parents:
        return "leads outside the artifact"
    return None


def directory_problems(path: str | Path, *, progress=None) -> tuple[dict, list[str]]:
    """Recompute every hash listed in the manifest. Returns the manifest and one line per changed,
    missing or unlisted file (empty when everything matches)."""
    d = Path(path)
    manifest = read_manifest(d)
    listed = manifest.get("files", {})
    problems = []
    for rel, want in listed.items():
        p = d / rel
        if not p.is_file():
            problems.append(f"{rel}: missing")
            continue
        got = sha256_file(p)
        if progress:
            progress(p.stat().st_size)
        if got != want:
            problems.append(f"{rel}: sha256 {got[:12]}… ≠ recorded {want[:12]}…")
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d).as_posix()
        if p.is_file() and rel not in MANIFEST_NAMES and rel not in listed and not is_bytecode_cache(rel):
            problems.append(f"{rel}: not in the manifest")
    return manifest, problems
