"""The operating system refuses a write: disk full (ENOSPC), read-only file system (EROFS), file-size
limit (EFBIG), an output whose parent or ancestor is a file. Every command that writes an artifact
(convert, build, repo, calibrate) must answer with one ``error:`` line, exit 1 (2 for a parent that
is a file: the output path itself is wrong), no traceback, nothing left behind, its inputs
unchanged, and a previous output it was asked to replace still complete.

The errors come from the kernel where the container allows it: a small tmpfs (ENOSPC), a read-only
tmpfs (EROFS; root ignores permission bits, so chmod cannot make one) and RLIMIT_FSIZE (EFBIG).
Where a mount is not permitted those cases are skipped. To strike at a chosen step (the first file,
mid rank file, the manifest, an fsync, the final rename) the errno is raised at the OS boundary of
the command's process only, by ``tests/os_faults/sitecustomize.py``, as the kernel would report
it; the code under test runs unchanged. Each case is a real process, forked from one that has
imported the CLI already (``tests/os_faults/zygote.py``), which keeps the file fast.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import tiny_mixtral_engine

REPO_ROOT = Path(__file__).resolve().parents[1]
ZYGOTE = REPO_ROOT / "tests" / "os_faults" / "zygote.py"


def tree_digest(d: Path) -> dict[str, str]:
    if not d.exists():
        return {}
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@dataclass
class Base:
    model: Path  # tiny Mixtral with the trained fixture's tokenizer
    text: Path  # calibration text
    ckpt: Path  # `trtmoe convert model`
    engine: Path  # `trtmoe build ckpt --backend embedded`
    tmp: Path  # TMPDIR of every case (calibrate's scratch space when it has no output)
    root: Path


class Zygote:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=REPO_ROOT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)})

    def run(self, args, *, stderr: Path, tmpdir: Path, fault: dict | None = None, fsize: int | None = None) -> int:
        req = {"args": [str(a) for a in args], "stderr": str(stderr), "fault": fault, "fsize": fsize,
               "tmpdir": str(tmpdir)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the zygote process died"
        return json.loads(line)["rc"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


@pytest.fixture(scope="module")
def base(tiny_model, tmp_path_factory, one_torch_thread) -> Base:
    root = tmp_path_factory.mktemp("os-errors")
    model, text, ckpt, engine = tiny_mixtral_engine(tiny_model, root, "model")
    tmp = root / "tmpdir"
    tmp.mkdir()
    return Base(model, text, ckpt, engine, tmp, root)


def command(name: str, b: Base, out: Path) -> list:
    return {
        "convert": ["convert", b.model, "-o", out, "--tp", "2", "--moe-ep", "2"],
        "build": ["build", b.ckpt, "-o", out, "--backend", "embedded", "--max-input-len", "64", "--copy"],
        "repo": ["repo", b.engine, "-o", out],
        "calibrate": ["calibrate", b.model, "--data", b.text, "-o", out, "--samples", "2", "--seq-len", "16",
                      "--formats", "int8"],
    }[name]


@dataclass
class Written:
    total: int  # bytes a successful run writes
    largest: str  # its largest file that is not a tokenizer copy (the weights, mostly)
    largest_bytes: int


def written(name: str, b: Base, zygote, work: Path) -> Written:
    """What a successful run of ``name`` writes (so that a fault can strike in the middle of it)."""
    out = work / f"ok-{name}"
    rc = zygote.run(command(name, b, out), stderr=work / f"ok-{name}.err", tmpdir=b.tmp)
    assert rc == 0, (work / f"ok-{name}.err").read_text()
    files = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    big = max((f for f in files if "tokenizer" not in f), key=files.get)
    shutil.rmtree(out)
    return Written(sum(files.values()), big, files[big])


@pytest.fixture(scope="module")
def sizes(base, zygote, tmp_path_factory) -> dict[str, Written]:
    work = tmp_path_factory.mktemp("os-errors-sizes")
    return {name: written(name, base, zygote, work) for name in ("convert", "build", "repo")}


def fault(errno_name: str, parent: Path, op: str, after, w: Written) -> dict:
    """The fault spec; a "write" fault strikes half-way through the largest file."""
    if op == "write":
        return {"errno": errno_name, "root": str(parent), "op": "write", "after": int(w.largest_bytes * after),
                "match": "/" + w.largest}
    return {"errno": errno_name, "root": str(parent), "op": op, "after": after}


def inputs_digest(b: Base) -> dict:
    return {"model": tree_digest(b.model), "ckpt": tree_digest(b.ckpt), "engine": tree_digest(b.engine),
            "text": hashlib.sha256(b.text.read_bytes()).hexdigest()}


def check_refused(rc: int, err: Path, parent: Path, b: Base, before: dict, *, words: str, code: int = 1,
                  keep: dict[str, str] | None = None, out: Path | None = None) -> str:
    """One ``error:`` line naming the problem, exit ``code``, no traceback; nothing written under
    ``parent`` (or, with ``keep``, exactly the previous output ``out``), inputs unchanged."""
    text = err.read_text()
    lines = [l for l in text.splitlines() if l.strip()]
    assert rc == code, text
    assert "Traceback" not in text and "internal error" not in text, text
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert words in lines[0], lines[0]
    left = sorted(p.name for p in parent.iterdir()) if parent.is_dir() else []
    if keep is None:
        assert left == [], left
    else:
        assert left == [out.name], left
        assert tree_digest(out) == keep
    assert not [n for n in os.listdir(b.tmp) if "trtmoe" in n], os.listdir(b.tmp)
    assert inputs_digest(b) == before
    return lines[0]


# ---- errno raised at a chosen step of the command's own process ------------------------------------

ENOSPC_WORDS = "No space left on device"
EROFS_WORDS = "Read-only file system"

# (command, op, after): where the error strikes. ``after`` for "write" is a fraction of the largest
# file a successful run writes (a rank file, mid-copy); for the other ops the index of the call
# that fails.
POINTS = [
    ("convert", "mkdir", 0),  # the partial directory
    ("convert", "open", 0),  # the first file (config.json)
    ("convert", "write", 0.5),  # mid rank file
    ("convert", "write", 0.0),  # the first byte of that rank file
    ("convert", "fsync", 0),  # a rank file's fsync (in a background thread)
    ("convert", "rename", 0),  # the final swap into place
    ("build", "write", 0.5),
    ("build", "rename", 0),
    ("repo", "write", 0.5),
    ("repo", "open", 0),
]


# A read-only file system refuses opening, creating and renaming, never a write into an open file.
CASES = [(c, o, a, e) for c, o, a in POINTS for e in ("ENOSPC", "EROFS") if not (e == "EROFS" and o == "write")]


@pytest.mark.parametrize("cmd,op,after,errno_name", CASES, ids=[f"{c}-{o}{a or ''}-{e}" for c, o, a, e in CASES])
def test_os_error_at_each_step_is_one_line(cmd, op, after, errno_name, base, zygote, sizes, tmp_path):
    parent = tmp_path / "outs"
    parent.mkdir()
    out = parent / "out"
    before = inputs_digest(base)
    rc = zygote.run(command(cmd, base, out), stderr=tmp_path / "err", tmpdir=base.tmp,
                    fault=fault(errno_name, parent, op, after, sizes[cmd]))
    words = ENOSPC_WORDS if errno_name == "ENOSPC" else EROFS_WORDS
    line = check_refused(rc, tmp_path / "err", parent, base, before, words=words)
    assert str(out) in line and ".trtmoe-partial-" not in line, line  # names the output asked for


def test_manifest_write_fails(base, zygote, tmp_path):
    parent = tmp_path / "outs"
    parent.mkdir()
    before = inputs_digest(base)
    rc = zygote.run(command("convert", base, parent / "out"), stderr=tmp_path / "err", tmpdir=base.tmp,
                    fault={"errno": "ENOSPC", "root": str(parent), "op": "write", "after": 0,
                           "match": "manifest.json"})
    check_refused(rc, tmp_path / "err", parent, base, before, words=ENOSPC_WORDS)


@pytest.mark.parametrize("cmd,op", [("convert", "write"), ("convert", "fsync"), ("build", "write"),
                                    ("repo", "write")])
def test_force_keeps_the_previous_output_when_the_disk_fills(cmd, op, base, zygote, sizes, tmp_path):
    parent = tmp_path / "outs"
    parent.mkdir()
    out = parent / "out"
    assert zygote.run(command(cmd, base, out), stderr=tmp_path / "ok", tmpdir=base.tmp) == 0, \
        (tmp_path / "ok").read_text()
    previous = tree_digest(out)
    before = inputs_digest(base)
    rc = zygote.run([*command(cmd, base, out), "--force"], stderr=tmp_path / "err", tmpdir=base.tmp,
                    fault=fault("ENOSPC", parent, op, 0.5 if op == "write" else 0, sizes[cmd]))
    check_refused(rc, tmp_path / "err", parent, base, before, words=ENOSPC_WORDS, keep=previous, out=out)


def test_calibrate_disk_full_mid_scratch_checkpoint(base, zygote, tmp_path):
    parent = tmp_path / "outs"
    parent.mkdir()
    before = inputs_digest(base)
    # The scratch checkpoint is written inside the output's partial directory: fill the disk in it.
    rc = zygote.run(command("calibrate", base, parent / "calib"), stderr=tmp_path / "err", tmpdir=base.tmp,
                    fault={"errno": "ENOSPC", "root": str(parent), "op": "write", "after": 200_000})
    check_refused(rc, tmp_path / "err", parent, base, before, words=ENOSPC_WORDS)


# ---- the kernel's own errors ----------------------------------------------------------------------

@pytest.mark.parametrize("cmd,limit", [("convert", 1), ("convert", 0.5), ("build", 0.5), ("repo", 0.5),
                                       ("calibrate", 1)])
def test_file_size_limit(cmd, limit, base, zygote, sizes, tmp_path):
    """RLIMIT_FSIZE in the command's process (Python ignores SIGXFSZ, so writes fail with EFBIG):
    ``limit`` 1 is one byte (the first file fails), a fraction is of the largest file (mid-file)."""
    parent = tmp_path / "outs"
    parent.mkdir()
    before = inputs_digest(base)
    fsize = 1 if limit == 1 else int(sizes[cmd].largest_bytes * limit)
    rc = zygote.run(command(cmd, base, parent / "out"), stderr=tmp_path / "err", tmpdir=base.tmp, fsize=fsize)
    line = check_refused(rc, tmp_path / "err", parent, base, before, words="File too large")
    assert "ulimit -f" in line


@pytest.mark.parametrize("cmd", ["convert", "build", "repo", "calibrate"])
def test_output_parent_is_a_file(cmd, base, zygote, tmp_path):
    parent = tmp_path / "outs"
    parent.mkdir()
    afile = parent / "afile"
    afile.write_text("not a directory")
    before = inputs_digest(base)
    rc = zygote.run(command(cmd, base, afile / "out"), stderr=tmp_path / "err", tmpdir=base.tmp)
    text = (tmp_path / "err").read_text().strip()
    assert rc == 2 and text.startswith("error: ") and len(text.splitlines()) == 1, text
    assert "not a directory" in text and "Traceback" not in text
    # An ancestor further up that is a file: the OS reports it (ENOTDIR), exit 1.
    rc = zygote.run(command(cmd, base, afile / "sub" / "out"), stderr=tmp_path / "err2", tmpdir=base.tmp)
    text = (tmp_path / "err2").read_text().strip()
    assert rc == 1 and "Not a directory" in text and text.startswith("error: ") and len(text.splitlines()) == 1, text
    assert "Traceback" not in text
    assert sorted(p.name for p in parent.iterdir()) == ["afile"] and afile.read_text() == "not a directory"
    assert inputs_digest(base) == before


@contextlib.contextmanager
def mounted_tmpfs(where: Path, options: str):
    """A tmpfs mounted at ``where`` for the block; skips the test where mounting is not permitted."""
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, f"trtmoe-test-{uuid.uuid4().hex[:6]}",
                           str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}); the injected "
                    "ENOSPC/EROFS cases above cover these errors")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.skipif(shutil.which("mount") is None, reason="no mount command")
@pytest.mark.parametrize("cmd", ["convert", "build", "repo"])
def test_real_disk_full(cmd, base, zygote, sizes, tmp_path):
    """A tmpfs with room for half of the output: the kernel's own ENOSPC."""
    size_kb = max(8, sizes[cmd].total // 2 // 1024)
    with mounted_tmpfs(tmp_path / "mnt", f"size={size_kb}k") as parent:
        before = inputs_digest(base)
        rc = zygote.run(command(cmd, base, parent / "out"), stderr=tmp_path / "err", tmpdir=base.tmp)
        check_refused(rc, tmp_path / "err", parent, base, before, words=ENOSPC_WORDS)


@pytest.mark.skipif(shutil.which("mount") is None, reason="no mount command")
@pytest.mark.parametrize("cmd", ["convert", "calibrate"])
def test_real_read_only_file_system(cmd, base, zygote, tmp_path):
    with mounted_tmpfs(tmp_path / "mnt", "size=1m,ro") as parent:
        before = inputs_digest(base)
        rc = zygote.run(command(cmd, base, parent / "out"), stderr=tmp_path / "err", tmpdir=base.tmp)
        check_refused(rc, tmp_path / "err", parent, base, before, words=EROFS_WORDS)
