"""Text corpora for training fixtures, calibration and held-out evaluation.

Two sources:

* the running interpreter's own standard-library ``.py`` sources, which every machine with Python
  has, split deterministically into ``train`` / ``calib`` / ``heldout`` by a stable hash of each
  file's path relative to the stdlib root (80 / 10 / 10), so the three never share a file;
* user-supplied calibration text (``load_texts``): a plain-text file, a directory of files, or
  JSONL with one record per line.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

from trtmoe.errors import InputError

SPLITS = ("train", "calib", "heldout")

# Percent boundaries on the path hash: [0, 80) train, [80, 90) calib, [90, 100) heldout.
_SPLIT_BOUNDS = {"train": (0, 80), "calib": (80, 90), "heldout": (90, 100)}

# Separator between concatenated documents when a split is written to one file.
DOC_SEPARATOR = "\n\n"

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests"}
_JSONL_SUFFIXES = {".jsonl", ".ndjson"}
# How many leading bytes decide whether a file in a directory is text.
_SNIFF_BYTES = 8192


def stdlib_root() -> Path:
    """The directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _is_test_dir(name: str) -> bool:
    return name in _EXCLUDED_DIRS or name.startswith("test_") or name.endswith(("_test", "_tests"))


def _keep_stdlib_file(rel: Path) -> bool:
    if any(_is_test_dir(part) for part in rel.parts[:-1]):
        return False
    name = rel.name
    # _sysconfigdata_* is generated per build (paths, compiler flags), not library source.
    return not (name.startswith("test_") or name.startswith("_sysconfigdata"))


def stdlib_files() -> list[Path]:
    """Every standard-library ``.py`` file kept for the corpus, as absolute paths sorted by
    their path relative to the stdlib root.

    Excludes third-party packages (``site-packages``/``dist-packages``), test directories
    (``test``, ``tests``, ``*_test``, ``test_*``), ``test_*`` files and the per-build
    ``_sysconfigdata_*`` module.
    """
    root = stdlib_root()
    kept: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so site-packages (often most of the tree) is never walked.
        dirnames[:] = [d for d in dirnames if not _is_test_dir(d)]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root)
            if _keep_stdlib_file(rel) and path.is_file():
                kept.append((rel.as_posix(), path))
    kept.sort(key=lambda item: item[0])
    return [path for _, path in kept]


def _split_of(rel_posix: str) -> str:
    # sha256, not hash(): Python's str hash is salted per process.
    bucket = int.from_bytes(hashlib.sha256(rel_posix.encode("utf-8")).digest()[:8], "big") % 100
    for name, (lo, hi) in _SPLIT_BOUNDS.items():
        if lo <= bucket < hi:
            return name
    raise AssertionError(bucket)  # pragma: no cover - bounds cover 0..99


def corpus_split(name: str) -> list[Path]:
    """The stdlib files of one split (``"train"``, ``"calib"`` or ``"heldout"``), sorted by
    relative path. The splits are disjoint and together cover ``stdlib_files()``; membership of a
    file depends only on its relative path, so it is the same on every run and machine."""
    if name not in SPLITS:
        raise InputError(f"unknown corpus split {name!r}", hint=f"choose one of {', '.join(SPLITS)}")
    root = stdlib_root()
    return [p for p in stdlib_files() if _split_of(p.relative_to(root).as_posix()) == name]


def _read_source(path: Path) -> str:
    # A few stdlib files carry Latin-1 bytes in comments; replacement keeps the corpus total.
    return path.read_bytes().decode("utf-8", errors="replace")


def split_texts(name: str, max_bytes: int | None = None) -> list[str]:
    """The texts of one split's files, one string per file, in split order (whitespace-only
    files are skipped).

    ``max_bytes`` caps the total UTF-8 size in bytes: files are taken whole until the next one
    would exceed it, and that last file is cut at a line boundary.
    """
    return _take_texts(name, max_bytes, separator_bytes=0)


def _take_texts(name: str, max_bytes: int | None, separator_bytes: int) -> list[str]:
    """Split texts whose sizes plus ``separator_bytes`` between consecutive texts fit ``max_bytes``."""
    if max_bytes is not None and max_bytes <= 0:
        raise InputError(f"max_bytes must be positive, got {max_bytes}")
    texts: list[str] = []
    used = 0
    for path in corpus_split(name):
        text = _read_source(path)
        if not text.strip():
            continue
        sep = separator_bytes if texts else 0
        size = len(text.encode("utf-8"))
        if max_bytes is not None and used + sep + size > max_bytes:
            tail = _cut_at_line(text, max_bytes - used - sep)
            if tail.strip():
                texts.append(tail)
            break
        texts.append(text)
        used += sep + size
    return texts


def _cut_at_line(text: str, budget: int) -> str:
    """The longest prefix of whole lines of ``text`` whose UTF-8 size is <= ``budget`` bytes."""
    out: list[str] = []
    used = 0
    for line in text.splitlines(keepends=True):
        size = len(line.encode("utf-8"))
        if used + size > budget:
            break
        out.append(line)
        used += size
    return "".join(out)


def write_split_text(split: str, out_path: str | Path, max_bytes: int | None = None) -> int:
    """Write a split's files, concatenated with blank lines between them, to ``out_path`` as
    UTF-8 (parent directories are created). ``max_bytes`` caps the text taken, as in
    ``split_texts``, separators included. Returns the number of bytes written."""
    texts = _take_texts(split, max_bytes, separator_bytes=len(DOC_SEPARATOR.encode("utf-8")))
    data = DOC_SEPARATOR.join(texts).encode("utf-8")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return len(data)


def _looks_binary(head: bytes) -> bool:
    if b"\x00" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A multi-byte character cut by the sniff window is still text.
        return exc.start < len(head) - 3
    return False


def _read_jsonl(path: Path, field: str) -> list[str]:
    texts: list[str] = []
    with path.open("r", encoding="utf-8", errors="strict") as fh:
        try:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"invalid JSON ({exc.msg})", where=where) from None
                if not isinstance(record, dict):
                    raise InputError(f"expected a JSON object, got {type(record).__name__}", where=where)
                if field not in record:
                    raise InputError(
                        f"record has no {field!r} field",
                        where=where,
                        hint=f"fields present: {', '.join(sorted(record)) or 'none'}; choose one with field=",
                    )
                value = record[field]
                if not isinstance(value, str):
                    raise InputError(f"field {field!r} is {type(value).__name__}, expected a string", where=where)
                if value.strip():
                    texts.append(value)
        except UnicodeDecodeError:
            raise InputError("JSONL file is not valid UTF-8", where=str(path)) from None
    return texts


def _read_text_file(path: Path, field: str, *, strict: bool) -> list[str]:
    if path.suffix.lower() in _JSONL_SUFFIXES:
        return _read_jsonl(path, field)
    raw = path.read_bytes()
    if _looks_binary(raw[:_SNIFF_BYTES]):
        if strict:
            raise InputError("not a text file (binary content)", where=str(path))
        return []
    text = raw.decode("utf-8", errors="replace")
    return [text] if text.strip() else []


def load_texts(path: str | Path, field: str = "text") -> list[str]:
    """Calibration texts from a local file or directory.

    * ``*.jsonl`` / ``*.ndjson``: one JSON object per line; the string in ``field`` is one text.
      Blank lines are skipped.
    * any other file: the whole file is one text (UTF-8; undecodable bytes are replaced).
    * a directory: every non-hidden file below it, sorted by relative path, read as above;
      binary files are skipped.

    Whitespace-only texts are dropped. Raises ``InputError`` for a missing path, a file that is
    binary, a malformed JSONL line (naming file and line number), or when no text results.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError("calibration data not found", where=str(p))
    texts: list[str] = []
    if p.is_dir():
        visible = (f for f in p.rglob("*") if not any(part.startswith(".") for part in f.relative_to(p).parts))
        files = sorted((f for f in visible if f.is_file()), key=lambda f: f.relative_to(p).as_posix())
        for f in files:
            texts.extend(_read_text_file(f, field, strict=False))
    else:
        texts = _read_text_file(p, field, strict=True)
    if not texts:
        raise InputError(
            "no calibration text found", where=str(p), hint="expected non-empty text files or JSONL records"
        )
    return texts
