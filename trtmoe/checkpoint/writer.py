"""``trtmoe convert``: stream an HF MoE checkpoint into a TensorRT-LLM checkpoint directory.

Memory stays bounded whatever the model's size (a float convert peaked at 0.33-0.36 GiB resident for
1.2-4.6 GiB sources, 0.23 GiB of it the interpreter with torch; docs/benchmarks.md), though not by one
read chunk: every rank file is written header-first from the layout specs, then tensor by tensor in
order. Output bytes that are an exact byte range of a source file
(row slices, whole tensors, no cast) are copied inside the kernel; the rest is read, sliced or
cast, and written from Python. Background threads keep the main thread on copying:

* ``_SourceHasher`` hashes the source files for the manifest (files in parallel);
* ``_RankFollower`` reads each rank file back behind the writer (from the page cache) to hash it,
  checking the verbatim-copied source bytes for NaN/Inf on the way, and starts its writeback; the
  leading bytes a rank file shares with the first one (header and replicated embedding under
  tensor or expert parallelism) are compared with that file rather than hashed again;
* ``_Syncer`` fsyncs each finished rank file while the next one is written.

Any failure in any of them aborts the conversion before the output directory is renamed into place.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import os
import queue
import shutil
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import DEFAULT_TRTLLM_VERSION
from ..errors import CheckpointError, InputError
from ..hf.reader import HFCheckpoint, all_finite_bytes, parse_dtype, range_nonfinite_error
from ..hf.safetensors_io import SourceRange, StreamingWriter, iter_chunks, pread_into
from ..parallel.mapping import Mapping
from .atomic import atomic_directory, source_tree, stays_inside
from .layout import DTYPE_STR, RankLayout, TensorSpec, trtllm_config
from .manifest import dump_json, write_manifest
from .schema import check_strict_blocks

# What a checkpoint carries of the model's tokenizer (in its tokenizer/ folder).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

_WINDOW = 16 << 20  # a rank follower's step: the bytes it waits for, hashes and starts writing back
# Bytes the background hashers read at a time, into a buffer they reuse: small enough to stay in a
# core's L2 cache, so that a rank follower's NaN/Inf check reads the bytes its hash has just read.
# Reading into it with pread beat mapping 16 MiB windows of the page cache, where the check read the
# window from memory again after the hash: rank followers' CPU 1.51-1.57 -> 1.09-1.13 s on a 1.2 GB
# Mixtral-shaped tp2/moe_ep2 convert, source hashes 0.88 -> 0.81 s (pread's copy costs about what
# the mapping's page faults did; hashing alone is as fast either way).
_READ = 1 << 20


@dataclass
class ConvertResult:
    out_dir: Path
    mapping: Mapping
    dtype: str
    files: dict[str, str] = field(default_factory=dict)
    bytes_written: int = 0
    rank_bytes: list[int] = field(default_factory=list)
    cautions: list[str] = field(default_factory=list)  # support-table cells NVIDIA does not list
    quantization: dict | None = None  # the manifest's quantization entry (None for a float checkpoint)
    # int4 matrices whose transform came from the calibration's stored recipes, was searched during
    # this conversion, or was reused from earlier in this process (None: no activation-aware search)
    recipes: dict[str, int] | None = None


def resolve_dtype(src: HFCheckpoint, dtype: str) -> torch.dtype:
    """``auto`` keeps the source dtype (fp32 stays fp32); otherwise the named dtype."""
    if dtype == "auto":
        name = src.model.source_dtype
        return parse_dtype(name if name in DTYPE_STR.values() else "float32")
    return parse_dtype(dtype)


def _start_writeback(fd: int, start: int, stop: int) -> None:
    """Ask the kernel to start writing bytes ``[start, stop)`` to disk now (on Linux, DONTNEED starts
    asynchronous writeback of dirty pages and drops only clean ones), so the fsync at the end of
    the file has little left to wait for (measured ~8% off a 2 GB convert) and dirty pages do not
    pile up on big models."""
    try:
        os.posix_fadvise(fd, start, stop - start, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def _libc_memcmp():
    try:
        fn = ctypes.CDLL(None).memcmp
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_memcmp = _libc_memcmp()
# Hash states the first rank file keeps (one per window) for the files after it to resume from.
_MAX_SNAPSHOTS = 1 << 14


def _same_bytes(a: memoryview, b: memoryview) -> bool:
    """Whether two writable, equally long buffers hold the same bytes (memcmp: a byte comparison
    reads both buffers at several GB/s per core, where sha256 manages about 1.8)."""
    n = len(a)
    if n != len(b):
        return False
    if n == 0:
        return True
    ca, cb = (ctypes.c_char * n).from_buffer(a), (ctypes.c_char * n).from_buffer(b)
    try:
        return _memcmp(ca, cb, n) == 0
    finally:
        del ca, cb  # release the exports before the views are released


_SOURCE_NICE = 5


def _lower_thread_priority(by: int) -> None:
    """Raise the calling thread's nice value by ``by`` (Linux gives each thread its own); the source
    hashes can be computed any time, so they yield to the copy and the rank hashes that trail it
    (a 1.2 GB tp2/moe_ep2 convert: 1.80 s against 1.97 s without, medians of 4 interleaved runs)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (AttributeError, OSError):
        pass


def _pool_size() -> int:
    """Hashing threads per kind: sha256 is sequential within a file, so files go in parallel."""
    return max(2, min(8, os.cpu_count() or 2))


class _Background:
    """``count`` daemon threads running ``work``; the first exception is kept for the main thread
    and cancels the rest."""

    def __init__(self, name: str, count: int = 1):
        self.error: BaseException | None = None
        self._cancelled = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(count)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self) -> None:
        for t in self._threads:
            if t.ident is not None:  # started
                t.join()

    def _run(self):
        try:
            self.work()
        except BaseException as e:  # noqa: BLE001 - surfaced by the main thread
            if self.error is None:
                self.error = e
            self.cancel()

    def work(self):
        raise NotImplementedError

    def cancel(self):
        self._cancelled.set()


def _size(path: Path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class _SourceHasher(_Background):
    """Hashes the source files in the background while conversion runs (hashlib drops the GIL)."""

    def __init__(self, files: list[Path]):
        super().__init__("trtmoe-source-hash", min(len(files), _pool_size()) or 1)
        self.files, self.hashes = files, {}
        # Largest first, so that the longest hash does not start last and end after everything else.
        self._todo = deque(sorted(files, key=_size, reverse=True))

    def work(self):
        if _SOURCE_NICE:
            _lower_thread_priority(_SOURCE_NICE)
        while not self._cancelled.is_set():
            try:
                f = self._todo.popleft()
            except IndexError:
                return
            self.hashes[f.name] = self._hash(f)

    def _hash(self, f: Path) -> str | None:
        h = hashlib.sha256()
        fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass
            buf = memoryview(bytearray(_READ))
            for pos in range(0, size, _READ):
                if self._cancelled.is_set():
                    return None
                view = buf[:min(_READ, size - pos)]
                pread_into(fd, view, pos, f.name)
                h.update(view)
        finally:
            os.close(fd)
        return h.hexdigest()


class _Job:
    """One rank file as the writer reports it: bytes written so far and the verbatim-copied regions."""

    __slots__ = ("name", "path", "end", "closed", "regions", "snap_at", "snaps", "followed")

    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.end, self.closed = 0, False
        self.regions: deque[tuple[int, int, SourceRange]] = deque()  # [start, end) in the file, source
        # First file only: window ends, ascending, and the sha256 state of the file's bytes before each.
        self.snap_at: list[int] = []
        self.snaps: dict[int, object] = {}
        self.followed = False  # its follower has finished (or given up)


class _RankFollower(_Background):
    """Hashes rank files while they are written, reading each back one window behind the writer (the
    bytes are still in the page cache), and checks the regions copied verbatim from the source for
    NaN/Inf on the way, so that those bytes are read once, here, and never by the main thread. Each
    file is followed by one thread; a file still being hashed does not hold up the next one.

    Rank files of one checkpoint often begin alike: under tensor or expert parallelism every rank
    holds the same header and the whole embedding first (a fifth of a 1.2 GB Mixtral-shaped tp2
    checkpoint). The first file's follower keeps its hash state at each window's end; a later
    file's follower compares its bytes, window by window, with the first file's (on disk, not
    assumed from the layout) and, while they are equal, takes over the first file's state instead
    of hashing. From the first window that differs on, it hashes its own bytes as usual, so each
    digest is always that of the file's own bytes. ``shared_bytes`` counts the bytes not hashed."""

    def __init__(self, files: int = 1):
        super().__init__("trtmoe-rank-hash", max(1, min(files, _pool_size())))
        self._cv = threading.Condition()
        self._jobs: deque[_Job] = deque()  # added, not yet taken by a thread
        self._no_more = False
        self._first: _Job | None = None
        self.hashes: dict[str, str] = {}
        self.shared_bytes = 0

    # -- main thread ----------------------------------------------------------------------------
    def add(self, name: str, path: Path) -> _Job:
        job = _Job(name, path)
        with self._cv:
            if self._first is None:
                self._first = job
            self._jobs.append(job)
            self._cv.notify_all()
        return job

    def wrote(self, job: _Job, end: int, nbytes: int, source: SourceRange | None) -> None:
        """The writer's ``on_write``: the file holds ``end`` bytes, the last ``nbytes`` from ``source``."""
        if self.error is not None:
            raise self.error
        with self._cv:
            if source is not None and source.dtype.is_floating_point:
                job.regions.append((end - nbytes, end, source))
            job.end = end
            self._cv.notify_all()

    def closed(self, job: _Job) -> None:
        with self._cv:
            job.closed = True
            self._cv.notify_all()

    def no_more(self) -> None:
        with self._cv:
            self._no_more = True
            self._cv.notify_all()

    def cancel(self):
        super().cancel()
        with self._cv:
            self._cv.notify_all()

    # -- background -----------------------------------------------------------------------------
    def work(self):
        while True:
            with self._cv:
                while not self._jobs and not self._no_more and not self._cancelled.is_set():
                    self._cv.wait()
                if self._cancelled.is_set() or not self._jobs:
                    return
                job = self._jobs.popleft()
            self._follow(job)

    def _follow(self, job: _Job) -> None:
        sha = hashlib.sha256()
        pos, fd, ref_fd, buf = 0, None, None, None
        first = self._first
        ref = first if first is not job and _memcmp is not None else None  # while the prefix is shared
        try:
            while True:
                want = self._await_snapshot(ref, pos) if ref is not None else None
                if want is None:
                    ref = None
                need = want if ref is not None else pos + 1
                with self._cv:
                    while job.end < need and not job.closed and not self._cancelled.is_set():
                        self._cv.wait()
                    end, closed = job.end, job.closed
                if self._cancelled.is_set():
                    return
                if pos >= end and closed:
                    break
                if fd is None:
                    fd = os.open(job.path, os.O_RDONLY | os.O_CLOEXEC)
                if ref is not None and (end < want or self._boundary(job, pos, want) != want):
                    ref = None  # this file ends first, or the window would split one of its elements
                stop = want if ref is not None else self._boundary(job, pos, min(end, pos + _WINDOW))
                if buf is None:
                    buf = memoryview(bytearray(_READ))
                if ref is not None:
                    if ref_fd is None:
                        ref_fd = os.open(ref.path, os.O_RDONLY | os.O_CLOEXEC)
                        theirs = memoryview(bytearray(_READ))
                    if self._matches(job, fd, ref_fd, pos, stop, buf, theirs):
                        # bytes [0, stop) equal the first file's: so does their hash state
                        sha = ref.snaps[stop].copy()
                        self.shared_bytes += stop - pos
                    else:
                        ref = None
                if ref is None:
                    self._digest(job, fd, pos, stop, sha, buf)
                if self._cancelled.is_set():
                    return
                _start_writeback(fd, pos, stop)
                pos = stop
                if job is first and len(job.snap_at) < _MAX_SNAPSHOTS:
                    job.snaps[pos] = sha.copy()
                    job.snap_at.append(pos)  # after the state: readers look positions up here first
                    with self._cv:
                        self._cv.notify_all()
        finally:
            with self._cv:
                job.followed = True
                self._cv.notify_all()
            if fd is not None:
                os.close(fd)
            if ref_fd is not None:
                os.close(ref_fd)
        self.hashes[job.name] = sha.hexdigest()

    def _await_snapshot(self, ref: _Job, pos: int) -> int | None:
        """The first file's next kept window end after ``pos``, waiting while its follower (always
        started first, on another thread) may still keep one; None once it cannot."""
        with self._cv:
            while True:
                want = self._next_snapshot(ref, pos)
                if (want is not None or ref.followed or len(ref.snap_at) >= _MAX_SNAPSHOTS
                        or self._cancelled.is_set()):
                    return want
                self._cv.wait()

    @staticmethod
    def _next_snapshot(ref: _Job, pos: int) -> int | None:
        """The first file's next window end after ``pos`` whose hash state it has kept, if any yet."""
        at = ref.snap_at  # appended to by the first file's follower meanwhile
        i = bisect.bisect_right(at, pos)
        return at[i] if i < len(at) else None

    def _pieces(self, job: _Job, fd: int, pos: int, stop: int, buf: memoryview, what: str):
        """File bytes ``[pos, stop)`` read into ``buf`` a piece at a time, as (start, end, view);
        each piece ends on an element boundary of the checked region it cuts, so a piece can be
        checked on its own while the bytes just read are in cache. Stops early when cancelled."""
        while pos < stop and not self._cancelled.is_set():
            end = self._boundary(job, pos, min(stop, pos + len(buf)))
            view = buf[:end - pos]
            pread_into(fd, view, pos, what)
            yield pos, end, view
            pos = end

    def _matches(self, job: _Job, fd: int, ref_fd: int, pos: int, stop: int, buf: memoryview,
                 theirs: memoryview) -> bool:
        """Whether file bytes ``[pos, stop)`` equal the first file's (``ref_fd``, read into
        ``theirs``); the pieces compared equal are checked on the way (a piece checked twice, when
        a later one differs and the window is hashed, is harmless)."""
        for a, b, mine in self._pieces(job, fd, pos, stop, buf, job.name):
            other = theirs[:b - a]
            pread_into(ref_fd, other, a, self._first.name)
            if not _same_bytes(mine, other):
                return False
            self._check(job, a, b, mine)
        return not self._cancelled.is_set()

    def _digest(self, job: _Job, fd: int, pos: int, stop: int, sha, buf: memoryview) -> None:
        """Hash file bytes ``[pos, stop)`` and check their verbatim source regions, piece by piece,
        so that the check reads the bytes the hash has just brought into the cache."""
        for a, b, view in self._pieces(job, fd, pos, stop, buf, job.name):
            sha.update(view)
            self._check(job, a, b, view)

    @staticmethod
    def _boundary(job: _Job, pos: int, stop: int) -> int:
        """Pull ``stop`` back to an element boundary when it falls inside a checked region."""
        regions = job.regions  # indexed, not iterated: the writer may append meanwhile
        for i in range(len(regions)):  # only the first few regions can reach ``stop``
            a, b, src = regions[i]
            if a >= stop:
                break
            if a < stop < b:
                size = src.dtype.itemsize
                cut = a + (stop - a) // size * size
                return cut if cut > pos else min(b, pos + size)
        return stop

    @staticmethod
    def _check(job: _Job, pos: int, stop: int, view: memoryview) -> None:
        regions = job.regions
        while regions:
            a, b, src = regions[0]
            if a >= stop:
                return
            lo, hi = max(a, pos), min(b, stop)
            if hi > lo and not all_finite_bytes(view[lo - pos:hi - pos], src.dtype):
                raise range_nonfinite_error(src)
            if b > stop:
                return
            regions.popleft()


class _Syncer(_Background):
    """fsyncs finished rank files in order, so one file's flush to disk overlaps writing the next."""

    def __init__(self):
        super().__init__("trtmoe-fsync")
        self._queue: queue.Queue[Path | None] = queue.Queue()

    def add(self, path: Path | None) -> None:
        """Queue ``path``; None means no more files."""
        self._queue.put(path)

    def work(self):
        while (path := self._queue.get()) is not None:
            if self._cancelled.is_set():
                return
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def cancel(self):
        super().cancel()
        self._queue.put(None)


def write_rank(path: Path, specs: list[TensorSpec], progress: Callable[[int], None] | None = None, *,
               follower: _RankFollower | None = None) -> str | None:
    """Write one rank file from its specs; ``progress(nbytes)`` after each chunk of bytes written.

    With ``follower`` (what ``convert`` does) the follower hashes the file and checks its verbatim
    source bytes for NaN/Inf behind the writer; the file is not fsynced and None is returned.
    Without one, a private follower does that, the file is fsynced, and its sha256 hex digest is
    returned."""
    if follower is None:
        own = _RankFollower()
        own.start()
        try:
            write_rank(path, specs, progress, follower=own)
            own.no_more()
            own.join()
            if own.error is not None:
                raise own.error
        finally:
            own.cancel()
            own.join()
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return own.hashes[path.name]

    job = follower.add(path.name, path)
    counting = False  # the header is not progress

    def on_write(end: int, nbytes: int, source: SourceRange | None) -> None:
        follower.wrote(job, end, nbytes, source)
        if progress and counting:
            progress(nbytes)

    w = StreamingWriter(path, [(s.name, s.dtype, s.shape) for s in specs], {"format": "pt"}, inline_hash=False,
                        on_write=on_write)
    counting = True
    try:
        for i, s in enumerate(specs):
            def emit(t: torch.Tensor | SourceRange, s=s):
                if isinstance(t, SourceRange):
                    w.write_range(t)
                    return
                if t.dtype != s.dtype:
                    t = t.to(s.dtype)
                for chunk in iter_chunks(t):
                    w.write(chunk)
            s.produce(emit)
            if w.tensors_done <= i and s.nbytes:
                raise CheckpointError(f"produced too few bytes for {s.name}")
        w.close(fsync=False)
        follower.closed(job)
        return None
    except BaseException:
        w.abort()
        raise


def _copy_tokenizer(src_dir: Path, out: Path) -> None:
    """Keep the tokenizer beside the weights (TensorRT-LLM ignores the extra folder) so later stages
    can find it without another path."""
    tree = source_tree(src_dir)  # a link leading out of the model's own tree is never followed
    files = [src_dir / n for n in TOKENIZER_FILES if stays_inside(src_dir / n, tree)]
    if any(f.name == "tokenizer.json" for f in files):
        (out / "tokenizer").mkdir()
        for f in files:
            shutil.copyfile(f, out / "tokenizer" / f.name)


def convert(model: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, moe_tp: int | None = None,
            moe_ep: int | None = None, dtype: str = "auto", trtllm_version: str = DEFAULT_TRTLLM_VERSION,
            force: bool = False, resolved_config: dict | None = None,
            progress: Callable[[int, int], None] | None = None, quant=None,
            inputs: tuple[str | Path, ...] = (), check: Callable | None = None, device: str = "cpu") -> ConvertResult:
    """Convert ``model`` (HF dir or cached hub id) into a TensorRT-LLM checkpoint at ``out_dir``.

    ``progress(done_bytes, total_bytes)`` is called as rank bytes are written. ``quant`` is an
    optional ``trtmoe.quant.plan.QuantPlan`` (format per expert, granularity, placement). Nothing is
    written unless the whole conversion succeeds, and ``out_dir`` may not be or hold the model or any
    other path in ``inputs`` (a calibration directory, say). ``check(config, quant_cfg, version)``, the
    deployment target's (``trtmoe.targets``; TensorRT-LLM's engine builder passes
    ``support.check_checkpoint_config``), refuses a checkpoint the target cannot build before anything
    is written; the cells it does not list come back as ``cautions``. ``device``
    ("cpu", "cuda" or "auto", see ``search_device``) is where the plan's INT4 searches are to run.
    """
    dev = search_device(device)
    with HFCheckpoint(model) as src:
        mapping = Mapping.create(tp, pp, moe_tp, moe_ep)
        mapping.validate(src.model)
        tdtype = resolve_dtype(src, dtype)
        if quant is not None:
            quant = quant.bind(src.model, mapping, tdtype)
        quant_cfg = quant.quantization_config() if quant is not None else None
        extra = quant.config_extra() if quant is not None else None
        cfg = trtllm_config(src.model, mapping, tdtype, version=trtllm_version, quantization=quant_cfg, extra=extra)
        problems = check_strict_blocks(cfg, trtllm_version)
        assert not problems, problems  # our own tables must agree with themselves
        cautions: list[str] = []
        if check is not None:
            verdict = check(cfg, None, trtllm_version)
            verdict.raise_if_refused(stage="convert")
            cautions = verdict.cautions
        layouts = [RankLayout(src.model, mapping, r, tdtype, src, quant, device=dev) for r in mapping.ranks()]
        all_specs = [lay.specs() for lay in layouts]
        total = sum(s.nbytes for specs in all_specs for s in specs)
        done = [0]

        def tick(n: int):
            done[0] += n
            if progress:
                progress(done[0], total)

        hasher = _SourceHasher(sorted(src.path.glob("*.json")) + list(src.files))
        follower, syncer = _RankFollower(len(all_specs)), _Syncer()
        workers = (hasher, follower, syncer)
        result = ConvertResult(Path(out_dir), mapping, DTYPE_STR[tdtype], cautions=cautions,
                               quantization=quant.manifest_entry() if quant is not None else None)
        with atomic_directory(out_dir, force=force, inputs=(src.path, *src.files, *inputs)) as tmp:
            for t in workers:
                t.start()
            try:
                dump_json(cfg, tmp / "config.json")
                if quant is not None:
                    quant.write_sidecars(tmp)
                _copy_tokenizer(src.path, tmp)
                names = []
                for r, specs in enumerate(all_specs):
                    name = f"rank{r}.safetensors"
                    write_rank(tmp / name, specs, tick, follower=follower)
                    syncer.add(tmp / name)
                    names.append(name)
                    result.rank_bytes.append(sum(s.nbytes for s in specs))
                follower.no_more()
                syncer.add(None)
                for t in workers:
                    t.join()
                    if t.error is not None:
                        raise t.error
            finally:  # on any failure stop the helpers before the partial directory is removed
                for t in workers:
                    t.cancel()
                for t in workers:
                    t.join()
            result.files = {n: follower.hashes[n] for n in names}
            write_manifest(
                tmp, kind="trtllm-checkpoint", file_hashes=result.files,
                target_trtllm_version=trtllm_version,
                source={"name": src.path.name, "architecture": src.model.hf_architecture,
                        "files": {f.name: hasher.hashes[f.name] for f in hasher.files}},
                resolved_config=resolved_config or {
                    "tp": tp, "pp": pp, "moe_tp": mapping.moe_tp_size, "moe_ep": mapping.moe_ep_size,
                    "dtype": DTYPE_STR[tdtype], "trtllm_version": trtllm_version},
                mapping=mapping.summary(),
                quantization=result.quantization,
            )
        result.bytes_written = total
        result.recipes = _recipe_counts(layouts)
        return result


def search_device(device: str | torch.device | None) -> torch.device:
    """The device ``convert``'s INT4 searches run on: "cpu", "cuda" / "cuda:N" (InputError when no CUDA
    device is present) or "auto" / None (CUDA when present, else the CPU)."""
    name = "auto" if device is None else str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and name != "cuda" and not name.startswith("cuda:"):
        raise InputError(f"unknown device {name!r}", hint="use cpu, cuda or auto")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {name}: no CUDA device is available", hint="use --device cpu or auto")
    return torch.device(name)


def _recipe_counts(layouts: list[RankLayout]) -> dict[str, int] | None:
    """How the int4 matrices got their activation-aware transforms, over every rank (see
    ``CheckpointRounding.counts``); None when no rounding searched or stored any."""
    total: dict[str, int] = {}
    for lay in layouts:
        for k, n in (lay.rounding.counts if lay.rounding is not None else {}).items():
            total[k] = total.get(k, 0) + n
    return total if any(total.values()) else None
