"""Nested data (dicts, lists, numbers, strings, tensors) stored as one safetensors file: the tensors
as tensors, the structure as JSON in the header's metadata. Reading one back parses data only, never
code, so a planted or damaged file can at worst be refused; this is how resumable progress is kept.

A value is ``None``, a bool, an int, a finite float, a str, a ``torch.Tensor``, a list or tuple of
values (read back as a list), or a dict with str keys not starting with ``$`` (the marker of a
tensor reference in the stored structure)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from ..errors import CheckpointError
from .safetensors_io import DTYPE_NAMES, SafetensorsFile, write_file

FORMAT = "trtmoe-tree"
_REF = "$t"


def _encode(obj, tensors: list, where: str):
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError(f"{where}: {obj} is not a finite number")
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.dtype not in DTYPE_NAMES:
            raise ValueError(f"{where}: dtype {obj.dtype} cannot be stored")
        tensors.append((str(len(tensors)), obj.detach().cpu().contiguous()))
        return {_REF: len(tensors) - 1}
    if isinstance(obj, (list, tuple)):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str) or k.startswith("$"):
                raise ValueError(f"{where}: key {k!r} cannot be stored (str keys not starting with $ only)")
            out[k] = _encode(v, tensors, f"{where}.{k}")
        return out
    raise ValueError(f"{where}: a {type(obj).__name__} cannot be stored")


def write_tree(path: str | Path, obj) -> None:
    """Write ``obj`` to ``path`` atomically (a kill leaves the previous file or none): a temporary
    sibling, then a rename, which replaces a link at ``path`` rather than writing through it."""
    path = Path(path)
    tensors: list = []
    tree = _encode(obj, tensors, "value")
    tmp = path.with_name(path.name + ".tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    write_file(tmp, tensors, metadata={"format": FORMAT, "tree": json.dumps(tree, allow_nan=False,
                                                                              separators=(",", ":"))})
    os.replace(tmp, path)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def read_tree(path: str | Path, *, finite: bool = True):
    """The value ``write_tree`` wrote to ``path``. CheckpointError (one line, naming the file) for a
    file that is not one, or, with ``finite``, that holds a NaN or infinite number in any float
    tensor or number."""
    path = Path(path)
    if os.path.islink(path):
        raise CheckpointError("is a symbolic link, not a file this tool wrote", where=str(path))
    f = SafetensorsFile(path)
    try:
        meta = f.metadata or {}
        if meta.get("format") != FORMAT or "tree" not in meta:
            raise CheckpointError(f"not a {FORMAT} file", where=str(path))
        try:
            tree = json.loads(meta["tree"], parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"its structure is malformed ({str(e)[:120]})", where=str(path)) from None
        tensors: dict[int, torch.Tensor] = {}

        def tensor(i):
            if isinstance(i, bool) or not isinstance(i, int) or str(i) not in f.tensors:
                raise CheckpointError(f"its structure names a tensor {i!r} the file does not hold", where=str(path))
            if i not in tensors:
                t = f.read(str(i))
                if finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise CheckpointError("holds NaN or infinite values", where=str(path))
                tensors[i] = t
            return tensors[i]

        def decode(v):
            if isinstance(v, list):
                return [decode(x) for x in v]
            if isinstance(v, dict):
                if _REF in v:
                    if len(v) != 1:
                        raise CheckpointError("its structure is malformed (a tensor reference with other keys)",
                                              where=str(path))
                    return tensor(v[_REF])
                return {k: decode(x) for k, x in v.items()}
            return v

        try:
            return decode(tree)
        except RecursionError:
            raise CheckpointError("its structure is malformed (nested too deeply)", where=str(path)) from None
    finally:
        f.close()
