"""Artifact directories written atomically, and the path rules that keep a command from touching its
own inputs.

An artifact is written into a hidden temporary sibling and swapped into place at the end. The swap
of an existing output is one ``renameat2(RENAME_EXCHANGE)`` where the file system supports it, so a
kill at any moment leaves either the previous output or the new one at the final path. Elsewhere
the previous output is first moved aside to a marked sibling, and the next run puts it back if the
process died before the new one took its place. Interrupted runs (SIGINT/SIGTERM) remove their
partial directory; leftovers of a killed process are recognised by their owner pid and cleaned by
the next run for the same output. Only real directories this user owns are taken for leftovers: a
link or another user's entry under a leftover's name is left alone, so nothing is deleted or written
through it outside the output's parent. Without ``force`` the final rename refuses an output that
appeared while the command ran (another run to the same path), instead of replacing it."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import stat
import uuid
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import InputError
from .manifest import MANIFEST_NAMES

_MARK = ".trtmoe-partial-"
_OLD = "old-"
_RENAME_EXCHANGE = 2
# Errors only writing can cause (reading an input never gives these), so they concern the output.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
_AT_FDCWD = -100


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parse_leftover(prefix: str, name: str) -> tuple[int, bool] | None:
    """``.NAME.trtmoe-partial-PID-HEX`` (a partial new output) or ``…-PID-old-HEX`` (a previous
    output moved aside) → (pid, is_previous_output)."""
    if not name.startswith(prefix):
        return None
    pid, _, rest = name[len(prefix):].partition("-")
    if not pid.isdigit():
        return None
    return int(pid), rest.startswith(_OLD)


def own_directory(p: Path) -> bool:
    """True when ``p`` itself (not followed if a link) is a directory owned by this user."""
    try:
        st = os.lstat(p)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def foreign_entry(root: Path) -> str | None:
    """Why the tree at ``root`` is not one this user's run wrote, or None: every entry, ``root``
    included, must be a plain directory or regular file owned by this user (no links, devices,
    FIFOs), so removing, reading or writing inside it cannot reach outside it."""
    uid = os.getuid()
    try:
        if not own_directory(root):
            return "it is not a directory of this user's" if not os.path.islink(root) else "it is a symbolic link"
        for top, dirs, files in os.walk(root):
            for n in dirs + files:
                st = os.lstat(os.path.join(top, n))
                rel = os.path.relpath(os.path.join(top, n), root)
                if stat.S_ISLNK(st.st_mode):
                    return f"{rel} is a symbolic link"
                if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                    return f"{rel} is not a regular file"
                if st.st_uid != uid:
                    return f"{rel} belongs to another user"
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    return None


def inside(path: str | Path, root: str | Path) -> bool:
    """True when ``path``, every link resolved, is ``root`` (resolved) or lies under it."""
    p, r = _resolved(path), _resolved(root)
    return p == r or r in p.parents


def remove_tree(p: Path, root: Path) -> None:
    """Remove the directory ``p`` that this process made in ``root``; a link there is unlinked (never
    followed), and a path that resolves outside ``root`` is refused (InputError), so a planted link
    cannot turn cleanup into deleting someone else's files."""
    if os.path.islink(p):
        os.unlink(p)
        return
    if not os.path.lexists(p):
        return
    if not inside(p, root):
        raise InputError("refusing to remove a directory outside the output's parent", where=str(p))
    shutil.rmtree(p, ignore_errors=True)


def recover_leftovers(out: Path) -> None:
    """Clean up after killed runs that wrote ``out``: a previous output that was moved aside and
    never replaced goes back to ``out``; partial outputs and replaced previous outputs are removed.
    Leftovers of live processes are left alone."""
    parent, prefix = out.parent, f".{out.name}{_MARK}"
    if not parent.is_dir():
        return
    dead = []
    for p in sorted(parent.glob(prefix + "*")):
        parsed = _parse_leftover(prefix, p.name)
        if parsed is not None and own_directory(p) and not pid_alive(parsed[0]):
            dead.append((p, parsed[1]))
    for p, previous in dead:
        if previous and not os.path.lexists(out) and any((p / n).is_file() for n in _MANIFEST_NAMES):
            os.rename(p, out)
            _fsync_dir(parent)
        else:
            remove_tree(p, parent)


def _libc_exchange():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_exchange()


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step. False where the system or file system cannot (then nothing
    changed); OSError for any other failure."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _resolved(p: str | Path) -> Path:
    return Path(os.path.realpath(Path(p).expanduser()))


def check_output_spares_inputs(out: str | Path, inputs: Iterable[str | Path], *, what: str = "output",
                               outside: Iterable[str | Path] = ()) -> None:
    """Refuse an output path that is one of the inputs or holds one (an ancestor directory): writing
    it would delete or overwrite what the command reads. It may not lie inside an ``outside`` input
    either (an artifact that another artifact must not be nested in), nor inside an input directory
    (which would then hold files it did not have). Links are resolved first."""
    o = _resolved(out)
    for i in inputs:
        r = _resolved(i)
        if r == o or o in r.parents:
            raise InputError(f"the {what} would replace one of this command's inputs ({i})", where=str(out),
                             hint="choose an output directory outside the inputs")
    outside = [*outside, *(i for i in inputs if _resolved(i).is_dir())]
    for i in outside:
        if _resolved(i) in o.parents:
            raise InputError(f"the {what} may not lie inside {i}", where=str(out),
                             hint="choose an output directory outside the inputs")


def source_tree(model_dir: Path) -> Path:
    """The tree a model's files may link into: the folder itself, or for a hub-cache snapshot
    (``models--ORG--NAME/snapshots/REV``) its repository, whose ``blobs/`` hold the bytes."""
    d = Path(os.path.realpath(model_dir))
    if d.parent.name == "snapshots" and d.parent.parent.name.startswith("models--"):
        return d.parent.parent
    return d


def stays_inside(path: Path, tree: Path) -> bool:
    """True when ``path``, with every link resolved, is a file inside ``tree``."""
    real = Path(os.path.realpath(path))
    return real.is_file() and Path(os.path.realpath(tree)) in real.parents


def _is_replaceable(out: Path) -> bool:
    """--force replaces only what this tool wrote (a directory with a trtmoe manifest) or an empty
    directory, never an arbitrary directory such as a home or a model folder."""
    if not out.is_dir() or out.is_symlink():
        return False
    if not any(out.iterdir()):
        return True
    return any(_is_trtmoe_manifest(out / name) for name in _MANIFEST_NAMES)


# Checkpoints, engines and calibrations write manifest.json; model repositories (whose root
# Triton scans for model folders) keep theirs under a name of their own.
_MANIFEST_NAMES = MANIFEST_NAMES


def _is_trtmoe_manifest(path: Path) -> bool:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    # Checkpoints, engines and calibrations say "tool"; repositories name their "generator".
    return isinstance(manifest, dict) and (manifest.get("tool") == "trtmoe"
                                           or str(manifest.get("generator", "")).startswith("trtmoe "))


class _Interrupted(BaseException):
    pass


@contextlib.contextmanager
def atomic_directory(out: str | Path, *, force: bool = False, inputs: Iterable[str | Path] = (),
                     outside: Iterable[str | Path] = ()) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes ``out`` (replacing a previous trtmoe
    artifact there if ``force``). ``inputs`` are paths the command reads: ``out`` may not be or
    contain any of them, nor lie inside an ``outside`` one."""
    out = Path(out).expanduser().absolute()
    check_output_spares_inputs(out, inputs, outside=outside)
    recover_leftovers(out)
    if os.path.lexists(out):
        if not force:
            raise InputError("output already exists", where=str(out), hint="pass --force to replace it")
        if not _is_replaceable(out):
            raise InputError("output exists and is not a trtmoe artifact; --force replaces only those",
                             where=str(out), hint="remove it yourself or choose another output")
    if out.parent.exists() and not out.parent.is_dir():
        raise InputError("the output's parent is not a directory", where=str(out.parent))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}{_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
    except OSError as e:
        raise _name_output(e, tmp, out) from None

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
        _fsync_tree(tmp)
        _swap_into_place(tmp, out, replace=force)
    except _Interrupted:
        remove_tree(tmp, out.parent)
        raise KeyboardInterrupt("terminated") from None
    except _Appeared:
        remove_tree(tmp, out.parent)
        raise InputError("output already exists: another run wrote it while this one ran", where=str(out),
                         hint="this run's result was discarded; pass --force to replace it") from None
    except OSError as e:
        remove_tree(tmp, out.parent)
        raise _name_output(e, tmp, out) from None
    except BaseException:
        remove_tree(tmp, out.parent)
        raise
    finally:
        if in_main and old is not None:
            signal.signal(signal.SIGTERM, old)


def _name_output(e: OSError, tmp: Path, out: Path) -> OSError:
    """``e``, naming the output the user asked for rather than the removed partial directory: a
    path inside ``tmp`` becomes the same path inside ``out``, and a write or fsync error, which
    names no path, names ``out``. The same error, as a new exception when a name changed."""
    before = [n for n in (e.filename, e.filename2) if n is not None]
    names = []
    for name in before:
        if isinstance(name, (str, bytes, os.PathLike)):
            p = Path(os.fsdecode(name))
            if p == tmp or tmp in p.parents:
                name = str(out / p.relative_to(tmp))
        if name not in names:
            names.append(name)
    if not names and e.errno in _WRITE_ERRNOS:
        names = [str(out)]
    if names == before or e.errno is None:
        return e
    return OSError(e.errno, e.strerror, *names[:1], *([None, names[1]] if len(names) > 1 else [])
                   ).with_traceback(e.__traceback__)


class _Appeared(Exception):
    """The output appeared while the command ran, and it was not to be replaced."""


def _swap_into_place(tmp: Path, out: Path, replace: bool = True) -> None:
    """Make the complete directory ``tmp`` the new ``out``. After an exchange ``tmp`` holds the
    previous output (removed here, or by the next run if this one is killed first). Without
    ``replace`` an ``out`` that exists now (another run's, finished meanwhile) raises _Appeared."""
    if not replace:
        # rename(2) of a directory refuses, atomically, a target that is a non-empty directory or a
        # file (an empty directory made meanwhile is the only thing it replaces): a finished run's
        # output is never replaced by a second run that started before it ended.
        try:
            os.rename(tmp, out)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise _Appeared() from None
            raise
        _fsync_dir(out.parent)
        return
    if not os.path.lexists(out):
        os.rename(tmp, out)
    elif not exchange(tmp, out):
        aside = out.parent / f".{out.name}{_MARK}{os.getpid()}-{_OLD}{uuid.uuid4().hex[:8]}"
        os.rename(out, aside)
        os.rename(tmp, out)
        tmp = aside
    _fsync_dir(out.parent)
    if tmp.exists():
        remove_tree(tmp, out.parent)


def _fsync_tree(root: Path) -> None:
    """Make everything written into ``root`` durable before it takes the output's place: each
    regular file (links are not followed), then each directory, deepest first. Without this a power
    loss after the rename could leave the new output with files that are empty or short (ext4 and
    others allocate and write data later than the rename is journalled). A file its writer already
    fsynced (the rank files) costs a system call; a small one about 0.3 ms."""
    dirs = []
    for top, _, names in os.walk(root):
        dirs.append(top)
        for name in names:
            path = os.path.join(top, name)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        _fsync_dir(Path(d))


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
