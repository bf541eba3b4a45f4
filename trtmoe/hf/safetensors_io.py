"""A small safetensors reader and streaming writer.

The format is an 8-byte little-endian header length, a JSON header mapping names to
``{dtype, shape, data_offsets}``, then raw bytes. We parse and check headers ourselves so that a
truncated file or a lying header is reported precisely, and we read with plain ``pread`` rather
than mmap so that resident memory stays bounded by what we hold, not by what we have touched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
import struct
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Iterable, Iterator

import torch

from ..errors import CheckpointError, UnsupportedError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    # FP8 E4M3: written for the fused-MoE formats' weights and scales (a source checkpoint's FP8 weights
    # are refused by the reader, which has no dequantization for them).
    "F8_E4M3": torch.float8_e4m3fn,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Dtypes trtmoe writes (quantized checkpoints for other engines) but does not read as source weights.
WRITE_DTYPE_NAMES = {**DTYPE_NAMES, torch.float8_e4m3fn: "F8_E4M3"}
_MAX_HEADER = 100 * 1024 * 1024
# Valid safetensors dtypes trtmoe does not read (named as such, not as corruption).
UNSUPPORTED_DTYPES = {"F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "U16", "U32", "U64",
                      "C64", "C128"}


def _as_int(x) -> int:
    """A header integer; anything else (a string, a fraction, a boolean) is malformed."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"not an integer: {x!r}")
    return x


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def dtype_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


# Headers validated before, with the file size they were validated against: a header is checked only
# against its own bytes and the file's size, so the same bytes in a file of the same size need no
# second parse. Calibration's activations file holds an entry per expert matrix and statistic (61,440
# on a 48-layer x 128-expert model, about 1.2 s to parse), and convert reopens it for every MoE layer.
# Bounded by the header bytes kept (the parsed entries take a few times more): the oldest go first.
_HEADER_CACHE: "deque[tuple[int, bytes, tuple]]" = deque()
_HEADER_CACHE_MIN = 1 << 16  # header bytes below which parsing is cheaper than keeping a copy
_HEADER_CACHE_BYTES = 16 << 20  # header bytes kept in all (61,440 entries of ~100 bytes: ~6 MB, estimated)
_HEADER_CACHE_LOCK = threading.Lock()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int


@dataclass(frozen=True)
class SourceRange:
    """Whole rows of one stored tensor as a contiguous byte range of its file, in the stored dtype.

    ``fd`` stays valid while the owning ``SafetensorsFile`` is open; ``offset`` is absolute (bytes);
    ``shape`` is the shape of the rows the range holds; ``rows`` is ``[a, b)`` or None for the whole tensor.
    """

    fd: int
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    name: str
    rows: tuple[int, int] | None = None


def pread_into(fd: int, view: memoryview, offset: int, what: str = "") -> None:
    """Fill ``view`` from ``fd`` at absolute ``offset`` (bytes); EOFError when the file ends first."""
    got, n = 0, len(view)
    while got < n:
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise EOFError(f"unexpected end of file reading {what or 'data'}")
        got += k


class SafetensorsFile:
    """One safetensors file, header validated on open; tensors read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = None
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer (regular files ignore the flag).
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            st = os.fstat(self._fd)
        except OSError as e:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            raise CheckpointError(f"cannot open: {e.strerror}", where=str(self.path)) from None
        try:
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"not a regular file ({_file_kind(st.st_mode)})", where=str(self.path),
                                      hint="weights must be plain files")
            os.set_blocking(self._fd, True)
            self.tensors, self.metadata = self._parse_header(st.st_size)
        except BaseException:
            self.close()
            raise
        try:  # tensors are mostly read front to back; a larger readahead window helps cold caches
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass

    def _bad(self, what: str) -> CheckpointError:
        return CheckpointError(what, where=str(self.path),
                               hint="the file is corrupt or truncated; re-download or re-save it")

    def _parse_header(self, size: int):
        if size < 8:
            raise self._bad(f"file is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if n > _MAX_HEADER or 8 + n > size:
            raise self._bad(f"header length {n} does not fit in a {size}-byte file")
        raw = os.pread(self._fd, n, 8)
        cacheable = _HEADER_CACHE_MIN <= n <= _HEADER_CACHE_BYTES
        if cacheable:
            with _HEADER_CACHE_LOCK:
                for size0, raw0, parsed in _HEADER_CACHE:
                    if size0 == size and raw0 == raw:
                        return parsed
        parsed = self._validate_header(raw, n, size)
        if cacheable:
            with _HEADER_CACHE_LOCK:
                _HEADER_CACHE.append((size, raw, parsed))
                kept = sum(len(r) for _, r, _ in _HEADER_CACHE)
                while kept > _HEADER_CACHE_BYTES:
                    kept -= len(_HEADER_CACHE.popleft()[1])
        return parsed

    def _validate_header(self, raw: bytes, n: int, size: int):
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"header is not valid JSON ({e})") from None
        except RecursionError:
            raise self._bad("header is not valid JSON (nested too deeply)") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._bad(f"__metadata__ must be an object of strings, got {meta!r:.80}")
        base = 8 + n
        infos: dict[str, TensorInfo] = {}
        spans = []
        for name, h in header.items():
            if isinstance(h, dict) and h.get("dtype") in UNSUPPORTED_DTYPES and h["dtype"] not in DTYPES:
                raise UnsupportedError(f"tensor {name!r} has unsupported dtype {h['dtype']} (a valid safetensors "
                                       "type that trtmoe does not read)", where=str(self.path),
                                       hint="weights must be F32, F16, BF16 or F64; dequantize the checkpoint first")
            try:
                dtype = DTYPES[h["dtype"]]
                shape = tuple(_as_int(x) for x in h["shape"])
                a, b = (_as_int(x) for x in h["data_offsets"])
                if any(x < 0 for x in shape):
                    raise ValueError("negative dimension")
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
        # Read-only: the openers of files with this header share them.
        return MappingProxyType(infos), MappingProxyType(meta)

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

    def _span(self, name: str, rows: tuple[int, int] | None) -> tuple[TensorInfo, int, int, list[int]]:
        """(info, absolute start, nbytes, shape) of a tensor or of rows ``[a, b)`` of its first dimension."""
        info = self.tensors[name]
        shape = list(info.shape)
        start, nbytes = info.start, info.nbytes
        if rows is not None:
            a, b = rows
            if not (shape and 0 <= a <= b <= shape[0]):
                raise IndexError(f"{name}: rows [{a}, {b}) outside shape {list(info.shape)}")
            row_bytes = nbytes // shape[0] if shape[0] else 0
            start += a * row_bytes
            nbytes = (b - a) * row_bytes
            shape[0] = b - a
        return info, start, nbytes, shape

    def byte_range(self, name: str, rows: tuple[int, int] | None = None) -> SourceRange:
        """Where a tensor (or rows ``[a, b)`` of it) lies in this file, for copying without reading."""
        info, start, nbytes, shape = self._span(name, rows)
        return SourceRange(self._fd, self.path, start, nbytes, info.dtype, tuple(shape), name, rows)

    def read(self, name: str, rows: tuple[int, int] | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read a tensor (or rows ``[a, b)`` of its first dimension) into a fresh CPU tensor, or into the
        front of ``out`` (a contiguous uint8 tensor of at least the needed bytes; the result is a view of it)."""
        info, start, nbytes, shape = self._span(name, rows)
        if out is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        else:
            if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() < nbytes:
                raise ValueError(f"out must be a contiguous uint8 tensor of at least {nbytes} bytes")
            buf = out.reshape(-1)[:nbytes]
        try:
            pread_into(self._fd, memoryview(buf.numpy()), start, repr(name))
        except EOFError as e:
            raise self._bad(str(e)) from None
        return buf.view(info.dtype).reshape(shape)


def _header_bytes(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None):
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, dtype, shape in specs:
        nb = math.prod(shape) * dtype_size(dtype)
        header[name] = {"dtype": WRITE_DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad so tensor data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, off


# Fallback order for copying file bytes in the kernel; a method that fails with one of these errnos
# is not retried for the rest of the process (EXDEV: other file system on old kernels, etc.).
_COPY_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF,
                     errno.ETXTBSY, errno.EPERM}
_copy_methods = ["copy_file_range", "sendfile", "pread"]
_COPY_CALL = 32 << 20  # bytes per copy step: regular progress reports, prompt signal handling
# User-space copy buffer, bytes: small enough to stay in a core's L2 cache between the read and the
# write (a 4 MiB buffer copied ~3x slower on a 2-core VM).
_BOUNCE = 512 << 10
_PAGE = 4096
# Whether ranges whose source and destination offsets differ modulo the page size go through the
# bounce buffer instead of the kernel. On its own a misaligned copy_file_range is the cheaper copy
# (Linux 6.18 / ext4: ~0.44 s of CPU per GB against ~0.58 s through the buffer, medians of 6
# interleaved runs). While convert's hashers mapped the written pages to read them back, the pages
# it left cost more to read that way (a 1.2 GB tp2/moe_ep2 convert took 3.48 s of CPU against 3.10 s
# with the buffer); since they pread them, the kernel copy is the cheaper whole convert too: 1.60 /
# 1.48 s against 1.91 / 1.59 s (tp2 / moe_ep2, medians of 4 interleaved rounds, 2-core VM), with
# the main thread's CPU steadier (0.67-0.69 s against 0.69-1.38 s over 4 in-process runs).
_BOUNCE_MISALIGNED = False


class StreamingWriter:
    """Writes a safetensors file tensor by tensor, in a declared order, never holding more than the
    chunk being written. The header is written first from the declared specs; each ``write`` or
    ``write_range`` must supply exactly the declared bytes, in order (possibly in several chunks).

    With ``inline_hash`` (the default) the sha256 of the whole file is computed on the fly, so bytes
    given to ``write_range`` pass through Python; without it they are copied inside the kernel
    (``copy_file_range``, else ``sendfile``, else through a small buffer) and ``close`` returns
    None. ``on_write(end, nbytes, source)`` is called after every write: the file now holds ``end``
    bytes (header included), the last ``nbytes`` of them copied from ``source`` (a ``SourceRange``;
    None for tensor bytes), and everything before ``end`` is visible to other readers of the file.
    """

    def __init__(self, path: str | Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict | None = None, *, inline_hash: bool = True,
                 on_write: Callable[[int, int, SourceRange | None], None] | None = None):
        self.path = Path(path)
        self.specs = specs
        header, self.data_bytes = _header_bytes(specs, metadata)
        self._on_write = on_write
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._sha = hashlib.sha256() if inline_hash else None
        self._buf: bytearray | None = None  # bounce buffer, allocated on first need
        self.written = 0  # bytes in the file so far
        self._idx = 0
        self._remaining = self._expected(0)
        try:
            self._put(memoryview(header))
        except BaseException:
            self.abort()
            raise

    def _expected(self, i: int) -> int:
        if i >= len(self.specs):
            return 0
        _, dtype, shape = self.specs[i]
        return math.prod(shape) * dtype_size(dtype)

    @property
    def current(self) -> tuple[str, torch.dtype, tuple[int, ...]]:
        return self.specs[self._idx]

    @property
    def tensors_done(self) -> int:
        """How many declared tensors have received all their bytes."""
        return self._idx

    def _take(self, nbytes: int, dtype: torch.dtype) -> None:
        """Account ``nbytes`` of the current tensor (checked against the declared size and dtype)."""
        if self._idx >= len(self.specs):
            raise ValueError(f"{nbytes} bytes written after the last declared tensor")
        name, want, _ = self.specs[self._idx]
        if dtype != want:
            raise TypeError(f"{name}: got {dtype}, declared {want}")
        if nbytes > self._remaining:
            raise ValueError(f"{name}: {nbytes} bytes exceed the {self._remaining} left")

    def _advance(self, nbytes: int) -> None:
        self._remaining -= nbytes
        while self._remaining == 0 and self._idx < len(self.specs):
            self._idx += 1
            self._remaining = self._expected(self._idx)

    def _emit(self, mv: memoryview) -> None:
        """Hash (with ``inline_hash``) and write ``mv`` at the file's current position."""
        if self._sha is not None:
            self._sha.update(mv)
        done, n = 0, len(mv)
        while done < n:
            done += os.write(self._fd, mv[done:])

    def _put(self, mv: memoryview) -> None:
        self._emit(mv)
        self.written += len(mv)
        if self._on_write is not None:
            self._on_write(self.written, len(mv), None)

    def _bounce_buffer(self) -> bytearray:
        if self._buf is None:
            self._buf = bytearray(_BOUNCE)
        return self._buf

    def write(self, t: torch.Tensor) -> None:
        """Append a chunk of the current tensor (dtype must match the declared one). The tensor is
        not kept: callers may reuse its memory once this returns."""
        self._take(t.nbytes, t.dtype)
        if not t.is_contiguous() and t.dim() and 0 < t[0].nbytes <= _BOUNCE:
            self._put_gathered(t)
        else:
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
            self._put(memoryview(raw))
        self._advance(t.nbytes)

    def _put_gathered(self, t: torch.Tensor) -> None:
        """Write a non-contiguous chunk (a column slice of rows, say) a few rows at a time through
        the reused bounce buffer, which stays in cache, rather than through a fresh contiguous copy
        of the whole chunk (whose pages are faulted in anew each time: a 4096 x 7168 bf16 column
        half took ~0.043 s of CPU that way and ~0.020 s this way). ``on_write`` hears of the chunk
        once, as for a contiguous one."""
        buf = self._bounce_buffer()
        staging = torch.frombuffer(buf, dtype=torch.uint8)
        mv = memoryview(buf)
        rows = len(buf) // t[0].nbytes
        for a in range(0, t.shape[0], rows):
            piece = t[a:a + rows]
            n = piece.nbytes
            staging[:n].view(t.dtype).view(piece.shape).copy_(piece)
            self._emit(mv[:n])
        self.written += t.nbytes
        if self._on_write is not None:
            self._on_write(self.written, t.nbytes, None)

    def write_range(self, src: SourceRange) -> None:
        """Append ``src.nbytes`` bytes of the current tensor copied verbatim from ``src.fd`` at
        ``src.offset`` (``src.dtype`` must match the declared dtype)."""
        self._take(src.nbytes, src.dtype)
        done = 0
        while done < src.nbytes:
            n = min(_COPY_CALL, src.nbytes - done)
            if self._sha is None:
                self._copy(src.fd, src.offset + done, n, src)
            else:  # the inline hash must see the bytes
                self._bounce(src.fd, src.offset + done, n, src)
            done += n
            self.written += n
            if self._on_write is not None:
                self._on_write(self.written, n, src)
        self._advance(src.nbytes)

    def _bounce(self, fd: int, offset: int, nbytes: int, src: SourceRange) -> None:
        """Copy through a reused user-space buffer (hashing on the way when inline hashing is on)."""
        mv = memoryview(self._bounce_buffer())
        done = 0
        while done < nbytes:
            k = min(len(mv), nbytes - done)
            try:
                pread_into(fd, mv[:k], offset + done, repr(src.name))
            except EOFError as e:
                raise CheckpointError(str(e), where=str(src.path), hint="the file changed during conversion") from None
            if self._sha is not None:
                self._sha.update(mv[:k])
            w = 0
            while w < k:
                w += os.write(self._fd, mv[w:k])
            done += k

    def _copy(self, fd: int, offset: int, nbytes: int, src: SourceRange) -> None:
        """Copy to the output's current position in the kernel, falling back method by method to
        the bounce buffer (see ``_BOUNCE_MISALIGNED``)."""
        if _BOUNCE_MISALIGNED and (offset - self.written) % _PAGE:
            self._bounce(fd, offset, nbytes, src)
            return
        done = 0
        while done < nbytes:
            method = _copy_methods[0]
            try:
                if method == "copy_file_range":
                    k = os.copy_file_range(fd, self._fd, nbytes - done, offset + done)
                elif method == "sendfile":
                    k = os.sendfile(self._fd, fd, offset + done, nbytes - done)
                else:
                    self._bounce(fd, offset + done, nbytes - done, src)
                    return
            except OSError as e:
                if e.errno in _COPY_UNSUPPORTED and len(_copy_methods) > 1:
                    _copy_methods.pop(0)
                    continue
                raise
            if k == 0:
                raise CheckpointError(f"unexpected end of file copying {src.name!r}", where=str(src.path),
                                      hint="the file changed during conversion")
            done += k

    def close(self, *, fsync: bool = True) -> str | None:
        """Finish the file (fsynced unless ``fsync=False``); returns its sha256 hex digest, or None
        without ``inline_hash``."""
        if self._idx != len(self.specs):
            name = self.specs[self._idx][0]
            raise ValueError(f"file closed before tensor {name!r} was complete")
        fd, self._fd = self._fd, None
        try:
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return self._sha.hexdigest() if self._sha is not None else None

    def abort(self):
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


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
