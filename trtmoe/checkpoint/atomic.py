"""Write an artifact directory atomically: into a hidden temporary sibling, renamed into place at the
end. Interrupted runs (SIGINT/SIGTERM) remove their partial directory; a partial left by a killed
process is recognised by its owner pid and removed by the next run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import uuid
from pathlib import Path
from typing import Iterator

from ..errors import InputError

_MARK = ".trtmoe-partial-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(parent: Path, name: str) -> None:
    prefix = f".{name}{_MARK}"
    for p in parent.glob(prefix + "*"):
        try:  # ".NAME.trtmoe-partial-PID-HEX" or, for a replaced output, "...-PID-old-HEX"
            pid = int(p.name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


class _Interrupted(BaseException):
    pass


@contextlib.contextmanager
def atomic_directory(out: str | Path, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes ``out`` (replacing it if ``force``)."""
    out = Path(out).absolute()
    if out.exists() and not force:
        raise InputError("output already exists", where=str(out), hint="pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise InputError("output exists and is not a directory", where=str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(out.parent, out.name)
    tmp = out.parent / f".{out.name}{_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()

    def on_term(signum, frame):
        raise _Interrupted(signum)

    old = None
    in_main = True
    try:
        old = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not in the main thread: no handler, rely on stale cleanup
        in_main = False
    try:
        yield tmp
        _fsync_dir(tmp)
        if out.exists():
            trash = out.parent / f".{out.name}{_MARK}{os.getpid()}-old-{uuid.uuid4().hex[:8]}"
            os.rename(out, trash)
            os.rename(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, out)
        _fsync_dir(out.parent)
    except _Interrupted:
        shutil.rmtree(tmp, ignore_errors=True)
        raise KeyboardInterrupt("terminated") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if in_main and old is not None:
            signal.signal(signal.SIGTERM, old)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
