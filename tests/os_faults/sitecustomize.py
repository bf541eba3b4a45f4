"""Simulated kernel errors for one child process (tests/test_os_errors.py puts this folder on the
child's PYTHONPATH; Python imports ``sitecustomize`` at start-up).

``TRTMOE_TEST_OS_FAULT`` holds JSON: ``{"errno": "ENOSPC", "root": DIR, "op": OP, "after": N,
"match": TEXT}``. Only paths under ``root`` (whose text contains ``match``, when given) are
affected; everything else, the inputs included, behaves normally. ``op`` is where the error
strikes, as the kernel would report it:

* ``write``: after ``after`` bytes have been written under ``root`` in total (``os.write``,
  ``os.copy_file_range``, ``os.sendfile`` and file objects opened for writing); the call that
  crosses the limit writes what still fits, the next one fails (a disk filling up);
* ``open``: the ``after``-th (from 0) creation of a file opened for writing;
* ``mkdir``, ``rename`` (``os.rename``/``os.replace``), ``fsync``: the ``after``-th such call.

Calls raise ``OSError`` the way Python reports the real error: with the path for open, mkdir and
rename, without one for write and fsync.
"""

from __future__ import annotations

import builtins
import errno as _errno
import io
import json
import os

_spec = os.environ.get("TRTMOE_TEST_OS_FAULT")

if _spec:
    _cfg = json.loads(_spec)
    _code = getattr(_errno, _cfg["errno"])
    _root = os.path.realpath(_cfg["root"])
    _op = _cfg["op"]
    _match = _cfg.get("match")
    _state = {"bytes": 0, "calls": 0}

    def _under(path) -> bool:
        if isinstance(path, int):
            try:
                path = os.readlink(f"/proc/self/fd/{path}")
            except OSError:
                return False
        try:
            p = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        inside = p == _root or p.startswith(_root + os.sep)
        return inside and (_match is None or _match in p)

    def _fail(*paths):
        raise OSError(_code, os.strerror(_code), *paths)

    def _counted(op: str, *paths) -> None:
        """Raise when this is the ``after``-th call of ``op``."""
        if _op != op:
            return
        n = _state["calls"]
        _state["calls"] += 1
        if n == _cfg["after"]:
            _fail(*paths)

    def _budget(n: int) -> int:
        """How many of ``n`` bytes may still be written; raises when none may."""
        if _op != "write":
            return n
        left = _cfg["after"] - _state["bytes"]
        if left <= 0:
            _fail()
        k = min(n, left)
        _state["bytes"] += k
        return k

    _write, _cfr, _sendfile = os.write, getattr(os, "copy_file_range", None), os.sendfile
    _open, _mkdir, _rename, _replace, _fsync = os.open, os.mkdir, os.rename, os.replace, os.fsync
    _io_open = io.open

    def write(fd, data):
        if not _under(fd):
            return _write(fd, data)
        k = _budget(len(memoryview(data).cast("B")))
        return _write(fd, memoryview(data).cast("B")[:k])

    def copy_file_range(src, dst, count, offset_src=None, offset_dst=None):
        if not _under(dst):
            return _cfr(src, dst, count, offset_src, offset_dst)
        return _cfr(src, dst, _budget(count), offset_src, offset_dst)

    def sendfile(out_fd, in_fd, offset, count, *args, **kw):
        if not _under(out_fd):
            return _sendfile(out_fd, in_fd, offset, count, *args, **kw)
        return _sendfile(out_fd, in_fd, offset, _budget(count), *args, **kw)

    def open_(path, flags, mode=0o777, *, dir_fd=None):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and dir_fd is None and _under(path):
            _counted("open", path)
        return _open(path, flags, mode, dir_fd=dir_fd)

    def mkdir(path, mode=0o777, *, dir_fd=None):
        if dir_fd is None and not os.path.lexists(path) and _under(path):  # an existing one: EEXIST
            _counted("mkdir", path)
        return _mkdir(path, mode, dir_fd=dir_fd)

    def rename(src, dst, **kw):
        if _under(src) or _under(dst):
            _counted("rename", src, dst)
        return _rename(src, dst, **kw)

    def replace(src, dst, **kw):
        if _under(src) or _under(dst):
            _counted("rename", src, dst)
        return _replace(src, dst, **kw)

    def fsync(fd):
        if _under(fd):
            _counted("fsync")
        return _fsync(fd)

    class _Writer:
        """A file object opened for writing under ``root``: its writes spend the byte budget."""

        def __init__(self, f, text: bool):
            self._f, self._text = f, text

        def write(self, data):
            n = len(data.encode()) if self._text else len(memoryview(data).cast("B"))
            k = _budget(n)
            if k < n:
                _fail()
            return self._f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def __iter__(self):
            return iter(self._f)

        def __getattr__(self, name):
            return getattr(self._f, name)

    def io_open(file, mode="r", *args, **kw):
        writing = any(c in mode for c in "wax+")
        if writing and not isinstance(file, int) and _under(file):
            _counted("open", file)
            return _Writer(_io_open(file, mode, *args, **kw), "b" not in mode)
        return _io_open(file, mode, *args, **kw)

    os.write, os.sendfile, os.open, os.mkdir, os.rename, os.replace, os.fsync = (
        write, sendfile, open_, mkdir, rename, replace, fsync)
    if _cfr is not None:
        os.copy_file_range = copy_file_range
    io.open = builtins.open = io_open
