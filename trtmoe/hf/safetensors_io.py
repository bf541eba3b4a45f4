"""A small safetensors reader and streaming writer.

The format is an 8-byte little-endian header length, a JSON header mapping names to
``{dtype, shape, data_offsets}``, then raw bytes. We parse and check headers ourselves so that a
truncated file or a lying header is reported precisely, and we read with plain ``pread`` rather
than mmap so that resident memory stays bounded by what we hold, not by what we have touched.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int


class SafetensorsFile:
    """One safetensors file, header validated on open; tensors read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"cannot open: {e.strerror}", where=str(self.path)) from None
        try:
            self.tensors, self.metadata = self._parse_header(size)
        except Exception:
            os.close(self._fd)
            raise

    def _bad(self, what: str) -> CheckpointError:
        return CheckpointError(what, where=str(self.path),
                               hint="the file is corrupt or truncated; re-download or re-save it")

    def _parse_header(self, size: int):
        if size < 8:
            raise self._bad(f"file is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if n > _MAX_HEADER or 8 + n > size:
            raise self._bad(f"header length {n} does not fit in a {size}-byte file")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        base = 8 + n
        infos: dict[str, TensorInfo] = {}
        spans = []
        for name, h in header.items():
            try:
                dtype = DTYPES[h["dtype"]]
                shape = tuple(int(x) for x in h["shape"])
                a, b = (int(x) for x in h["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"tensor {name!r} has a malformed header entry {h!r}") from None
            want = math.prod(shape) * dtype_size(dtype)
            if b - a != want or a < 0:
                raise self._bad(f"tensor {name!r}: offsets [{a}, {b}) hold {b - a} bytes but "
                                f"{h['dtype']}{list(shape)} needs {want}")
            if base + b > size:
                raise self._bad(f"tensor {name!r} ends at byte {base + b} but the file has {size} bytes")
            infos[name] = TensorInfo(name, dtype, shape, base + a, want)
            spans.append((a, b, name))
        spans.sort()
        for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
            if a1 < b0:
                raise self._bad(f"tensors {n0!r} and {n1!r} overlap in the data section")
        return infos, meta

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Read a tensor (or rows ``[a, b)`` of its first dimension) into a fresh CPU tensor."""
        info = self.tensors[name]
        shape = list(info.shape)
        start, nbytes = info.start, info.nbytes
        if rows is not None:
            a, b = rows
            row_bytes = nbytes // shape[0] if shape and shape[0] else 0
            start += a * row_bytes
            nbytes = (b - a) * row_bytes
            shape[0] = b - a
        out = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy())
        got = 0
        while got < nbytes:
            chunk = os.preadv(self._fd, [view[got:]], start + got)
            if chunk <= 0:
                raise self._bad(f"unexpected end of file reading {name!r}")
            got += chunk
        return out.view(info.dtype).reshape(shape)


def _header_bytes(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None):
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, dtype, shape in specs:
        nb = math.prod(shape) * dtype_size(dtype)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad so tensor data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, off


class StreamingWriter:
    """Writes a safetensors file tensor by tensor, in a declared order, never holding more than the
    chunk being written. The header is written first from the declared specs; each ``write`` must
    supply exactly the declared bytes, in order (possibly in several chunks). A sha256 of the whole
    file is computed on the fly."""

    def __init__(self, path: str | Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict | None = None):
        self.path = Path(path)
        self.specs = specs
        header, self.data_bytes = _header_bytes(specs, metadata)
        self._f = open(self.path, "wb")
        self._sha = hashlib.sha256(header)
        self._f.write(header)
        self._idx = 0
        self._remaining = self._expected(0)

    def _expected(self, i: int) -> int:
        if i >= len(self.specs):
            return 0
        _, dtype, shape = self.specs[i]
        return math.prod(shape) * dtype_size(dtype)

    @property
    def current(self) -> tuple[str, torch.dtype, tuple[int, ...]]:
        return self.specs[self._idx]

    def write(self, t: torch.Tensor) -> None:
        """Append a chunk of the current tensor (dtype must match the declared one)."""
        name, dtype, _ = self.specs[self._idx]
        if t.dtype != dtype:
            raise TypeError(f"{name}: got {t.dtype}, declared {dtype}")
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        if raw.nbytes > self._remaining:
            raise ValueError(f"{name}: {raw.nbytes} bytes exceed the {self._remaining} left")
        mv = memoryview(raw)
        self._sha.update(mv)
        self._f.write(mv)
        self._remaining -= raw.nbytes
        while self._remaining == 0 and self._idx < len(self.specs):
            self._idx += 1
            self._remaining = self._expected(self._idx)

    def close(self) -> str:
        """Finish the file; returns its sha256 hex digest."""
        if self._idx != len(self.specs):
            name = self.specs[self._idx][0]
            raise ValueError(f"file closed before tensor {name!r} was complete")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self._sha.hexdigest()

    def abort(self):
        try:
            self._f.close()
        except Exception:
            pass


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    buf = bytearray(chunk)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(mv[:n])
    return h.hexdigest()


def iter_chunks(t: torch.Tensor, max_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
    """Split a tensor along dim 0 into pieces of at most ``max_bytes`` (at least one row)."""
    if t.dim() == 0 or t.nbytes <= max_bytes:
        yield t
        return
    rows = max(1, max_bytes // max(1, t[0].nbytes))
    for a in range(0, t.shape[0], rows):
        yield t[a:a + rows]


def write_file(path: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], metadata=None) -> str:
    """Convenience: write small in-memory tensors (tests, fixtures)."""
    items = list(tensors)
    w = StreamingWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in items], metadata)
    for _, t in items:
        w.write(t)
    return w.close()
