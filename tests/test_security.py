"""Security cases of the hostile-input suite: nothing trtmoe reads back is unpickled (a scan of the
package's source, and a planted pickle payload that must not run), planted links and foreign
directories in place of calibration's resume folder never make it delete or write outside the
output's parent, overlapping runs to one output do not replace each other, non-finite numbers in
resume files or calib.json are refused, and bytecode caches do not fail ``verify``."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from trtmoe.checkpoint.atomic import atomic_directory, foreign_entry, remove_tree
from trtmoe.checkpoint.manifest import write_manifest
from trtmoe.checkpoint.verify import verify_artifact
from trtmoe.cli import main
from trtmoe.errors import CheckpointError, InputError, VerifyError
from trtmoe.hf.tree_file import read_tree, write_tree
from trtmoe.quant.calibrate import calibrate, load_calib
from trtmoe.quant.sensitivity import Progress

from conftest import tiny_mixtral_engine
from test_sensitivity import small  # noqa: F401 - the tiny calibration set-up (model, tokenizer, text)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "trtmoe"


# ---- no code path unpickles -----------------------------------------------------------------------

# Modules whose only purpose is running code stored in data; none may be imported by the package.
_UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib",
                       "copyreg", "pickletools"}
# Calls that unpickle (or may): torch.load (any arguments), torch.serialization.*, numpy.load
# with allow_pickle, pandas.read_pickle, and anything passed weights_only=False.
_UNPICKLING_CALLS = {"load", "read_pickle", "loads", "_load", "Unpickler"}


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def unpickling_sites(source: str) -> list[tuple[int, str]]:
    """(line, what) for every import of an unpickling module and every call that may unpickle."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in _UNPICKLING_MODULES or a.name.startswith("torch.serialization"):
                    found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in _UNPICKLING_MODULES or mod.startswith("torch.serialization") or (
                    mod in ("torch", "numpy", "pandas") and any(a.name in _UNPICKLING_CALLS for a in node.names)):
                found.append((node.lineno, f"from {mod} import ..."))
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            head, _, last = name.rpartition(".")
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            if last == "load" and head in ("torch", "np", "numpy"):
                if head == "torch" or not (isinstance(kw.get("allow_pickle"), ast.Constant)
                                           and kw["allow_pickle"].value is False):
                    # numpy.load is allowed only with allow_pickle=False spelled out.
                    found.append((node.lineno, f"{name}(...)"))
            elif last == "read_pickle" or head.startswith("torch.serialization"):
                found.append((node.lineno, f"{name}(...)"))
            elif "weights_only" in kw and not (isinstance(kw["weights_only"], ast.Constant)
                                                and kw["weights_only"].value is True):
                found.append((node.lineno, f"{name}(weights_only=...)"))
            elif last in ("__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).split(".")[0] in _UNPICKLING_MODULES:
                found.append((node.lineno, f"{name}({node.args[0].value!r})"))
        elif isinstance(node, ast.FunctionDef) and node.name in ("__reduce__", "__reduce_ex__", "__setstate__"):
            found.append((node.lineno, f"def {node.name}"))
    return found


@pytest.mark.parametrize("snippet", [
    "import pickle", "import marshal", "from pickle import loads", "import torch\ntorch.load(p)",
    "import torch\ntorch.load(p, weights_only=True)", "import numpy as np\nnp.load(p, allow_pickle=True)",
    "import numpy as np\nnp.load(p)", "x = f(p, weights_only=False)", "import shelve",
    "from torch.serialization import load", "from torch import load", "importlib.import_module('pickle')",
    "class A:\n    def __setstate__(self, s): pass", "import pandas as pd\npd.read_pickle(p)",
])
def test_the_scan_finds_each_way_to_unpickle(snippet):
    assert unpickling_sites(snippet), snippet


def test_the_scan_passes_data_only_reading():
    assert not unpickling_sites("import numpy as np\nnp.load(p, allow_pickle=False)\n"
                                "from safetensors.torch import load_file\nload_file(p)\njson.loads(s)")


def test_no_code_path_in_the_package_unpickles():
    """Every file trtmoe reads back is data (safetensors, JSON, YAML, text): no module imports pickle
    or its relatives, calls torch.load, numpy.load without allow_pickle=False, or passes weights_only."""
    sites = {str(p.relative_to(REPO)): s for p in sorted(PKG.rglob("*.py"))
             if (s := unpickling_sites(p.read_text()))}
    assert not sites, sites


# ---- resume files: data only, never executed --------------------------------------------------------

class _Payload:
    """Unpickling this runs ``open(path, 'w')``: the marker file proves the pickle was executed."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickle_bytes(marker: Path) -> bytes:
    import pickle  # the test plants a payload; the package itself never imports pickle

    return pickle.dumps({"counts": _Payload(marker)})


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _calibrate(small, out, **kw):
    model, tok, text = small
    args = dict(tokenizer=tok, samples=4, seq_len=16, batch_size=2, formats=("int8",), rounding="rtn")
    args.update(kw)
    return calibrate(model, text, out, **args)


_CHILD = (
    "import os, signal, sys\n"
    "from trtmoe.quant.calibrate import calibrate\n"
    "n = [0]\n"
    "def stop(what, d, t):\n"
    "    n[0] += 1\n"
    "    if n[0] == int(sys.argv[5]):\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "calibrate(sys.argv[1], sys.argv[2], sys.argv[4], tokenizer=sys.argv[3], samples=4, seq_len=16, batch_size=2,\n"
    "          formats=('int8',), rounding='rtn', progress=stop)\n")


@pytest.fixture(scope="module")
def killed(small, tmp_path_factory):
    """The progress a calibration killed after its first MoE layer left behind (a pristine copy)."""
    model, tok, text = small
    root = tmp_path_factory.mktemp("killed")
    out = root / "calib"
    r = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(text), str(tok), str(out), "8"],
                       cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == -9, r.stderr[-2000:]
    (left,) = root.glob(".calib.trtmoe-partial-*")
    progress = left / "sensitivity-progress"
    assert (progress / "layers" / "layer-000.safetensors").is_file()
    return progress


def _plant_progress(killed: Path, parent: Path, name: str = "calib") -> Path:
    """A copy of ``killed``'s progress in a dead run's partial directory for ``parent/name``."""
    import shutil

    d = parent / f".{name}.trtmoe-partial-{_dead_pid()}-deadbeef"
    d.mkdir(parents=True)
    shutil.copytree(killed, d / "sensitivity-progress")
    return d / "sensitivity-progress"


def _tail(p: Path) -> str:
    """A progress file's path from ``sensitivity-progress`` on (the run moves the folder it adopts)."""
    return "/".join(p.parts[p.parts.index("sensitivity-progress"):])


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_a_copied_progress_is_resumed(small, killed, tmp_path):
    """The planted-progress cases below are meaningful: the same progress, untouched, is resumed."""
    _plant_progress(killed, tmp_path)
    notes = []
    _calibrate(small, tmp_path / "calib", notes=notes)
    assert any("1 of 2 MoE layers were already done" in n for n in notes), notes


@pytest.mark.parametrize("where", ["layer", "batch", "acts", "old_layer_pt"])
def test_a_planted_pickle_in_the_resume_folder_is_never_executed(small, killed, tmp_path, where):
    marker = tmp_path / "EXECUTED"
    progress = _plant_progress(killed, tmp_path)
    target = {"layer": progress / "layers" / "layer-000.safetensors",
              "batch": progress / "acts" / "batch-000000.safetensors",
              "acts": progress / "acts" / "layer-001-batch-000000.safetensors",
              "old_layer_pt": progress / "layers" / "layer-001.pt"}[where]
    target.write_bytes(_pickle_bytes(marker))
    if where == "old_layer_pt":  # a pre-safetensors progress folder, as the old format named its files
        (progress / "state.json").write_text(json.dumps({"key": "anything"}))
    notes = []
    try:
        res = _calibrate(small, tmp_path / "calib", notes=notes)
    except InputError as e:  # refused in one line, naming the planted file
        assert _tail(target) in str(e) and "\n" not in str(e)
        assert not (tmp_path / "calib").exists()
    else:
        assert where == "old_layer_pt" and res["sensitivity"]["method"] == "fisher"
    assert not marker.exists(), "a planted pickle was executed"
    assert not list(tmp_path.glob(".calib*"))


def test_tree_files_refuse_a_pickle_and_non_finite_values(tmp_path):
    marker = tmp_path / "EXECUTED"
    f = tmp_path / "x.safetensors"
    f.write_bytes(_pickle_bytes(marker))
    with pytest.raises(CheckpointError):
        read_tree(f)
    assert not marker.exists()
    write_tree(f, {"a": torch.tensor([1.0, float("nan")]), "b": [1, "x", None]})
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        read_tree(f)
    assert torch.isnan(read_tree(f, finite=False)["a"][1])
    with pytest.raises(ValueError):
        write_tree(f, {"a": float("inf")})
    with pytest.raises(ValueError):
        write_tree(f, {"a": object()})
    (tmp_path / "link.safetensors").symlink_to(f)
    with pytest.raises(CheckpointError, match="symbolic link"):
        read_tree(tmp_path / "link.safetensors")


@pytest.mark.parametrize("what", ["measured", "counts", "rows"])
def test_nan_in_a_resume_file_is_refused(small, killed, tmp_path, what):
    progress = _plant_progress(killed, tmp_path)
    if what == "counts":  # a float where integers belong
        f = progress / "acts" / "batch-000000.safetensors"
        d = read_tree(f)
        d["counts"] = d["counts"].double()
    else:
        f = progress / ("layers/layer-000.safetensors" if what == "measured" else "acts/layer-001-batch-000000.safetensors")
        d = read_tree(f)
        if what == "measured":
            d["measured"]["fc"]["int8"][1] = float("nan")
        else:
            d["h"][0, 0] = float("nan")
    write_tree(f, d)
    with pytest.raises(InputError) as e:
        _calibrate(small, tmp_path / "calib")
    assert _tail(f) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "calib").exists() and not list(tmp_path.glob(".calib*"))
    _calibrate(small, tmp_path / "calib")  # the discarded progress does not stand in the way


def test_progress_with_another_key_or_no_marker_is_not_resumed(small, killed, tmp_path):
    progress = _plant_progress(killed, tmp_path)
    (progress / Progress.MARKER).unlink()
    notes = []
    _calibrate(small, tmp_path / "calib", notes=notes)
    assert not any("already done" in n for n in notes) and any("not resumed" in n for n in notes), notes
    progress = _plant_progress(killed, tmp_path / "b")
    marker = json.loads((progress / Progress.MARKER).read_text())
    marker["uid"] = os.getuid() + 1
    (progress / Progress.MARKER).write_text(json.dumps(marker))
    notes = []
    _calibrate(small, tmp_path / "b" / "calib", notes=notes)
    assert not any("already done" in n for n in notes), notes


# ---- links planted in place of the resume folder ----------------------------------------------------

@pytest.mark.parametrize("how", ["partial_dir", "progress_dir", "acts_dir", "layers_dir", "layer_file"])
def test_a_planted_link_never_reaches_outside_the_outputs_parent(small, killed, tmp_path, how):
    import shutil

    victim = tmp_path / "victim"
    shutil.copytree(killed, victim / "sensitivity-progress")  # looks like progress: a tempting target
    (victim / "precious.txt").write_text("keep me")
    before = _snapshot(victim)
    parent = tmp_path / "work"
    parent.mkdir()
    partial = parent / f".calib.trtmoe-partial-{_dead_pid()}-cafe0000"
    if how == "partial_dir":
        partial.symlink_to(victim, target_is_directory=True)
    elif how == "progress_dir":
        partial.mkdir()
        (partial / "sensitivity-progress").symlink_to(victim / "sensitivity-progress", target_is_directory=True)
    else:
        progress = _plant_progress(killed, parent)
        sub = {"acts_dir": "acts", "layers_dir": "layers", "layer_file": "layers/layer-000.safetensors"}[how]
        shutil.rmtree(progress / sub) if (progress / sub).is_dir() else (progress / sub).unlink()
        (progress / sub).symlink_to(victim / "sensitivity-progress" / sub)
    notes = []
    _calibrate(small, parent / "calib", notes=notes)
    assert (parent / "calib" / "calib.json").is_file()
    assert _snapshot(victim) == before, "calibrate wrote or deleted outside the output's parent"
    assert not any("already done" in n for n in notes), notes


def test_remove_tree_unlinks_links_and_refuses_outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("x")
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    remove_tree(root / "link", root)
    assert (outside / "f").is_file() and not os.path.lexists(root / "link")
    with pytest.raises(InputError):
        remove_tree(outside, root)
    assert (outside / "f").is_file()
    (root / "d").mkdir()
    (root / "d" / "l").symlink_to(outside / "f")
    assert foreign_entry(root / "d") == "l is a symbolic link"
    remove_tree(root / "d", root)
    assert not (root / "d").exists() and (outside / "f").is_file()


def test_a_leftover_that_is_a_link_is_not_restored_as_the_output(tmp_path):
    """A link named like a moved-aside previous output must not become the output."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "manifest.json").write_text(json.dumps({"tool": "trtmoe", "kind": "calibration", "files": {}}))
    (tmp_path / f".out.trtmoe-partial-{_dead_pid()}-old-12345678").symlink_to(victim, target_is_directory=True)
    with atomic_directory(tmp_path / "out") as d:
        (d / "x").write_text("new")
    assert not (tmp_path / "out").is_symlink() and (tmp_path / "out" / "x").read_text() == "new"
    assert sorted(p.name for p in victim.iterdir()) == ["manifest.json"]


# ---- overlapping runs -------------------------------------------------------------------------------

def test_an_output_written_meanwhile_is_not_replaced_without_force(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(InputError, match="another run wrote it"):
        with atomic_directory(out) as first:
            (first / "who").write_text("first")
            with atomic_directory(out) as second:
                (second / "who").write_text("second")
    assert (out / "who").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    write_manifest(out, kind="test", file_hashes={})
    with atomic_directory(out, force=True) as third:  # --force still replaces
        (third / "who").write_text("third")
    assert (out / "who").read_text() == "third"


def test_two_overlapping_calibrations_to_one_path(small, tmp_path):
    out = tmp_path / "calib"
    inner = {}

    def progress(what, done, total):
        if not inner:
            inner["res"] = _calibrate(small, out)  # a second run starts and finishes meanwhile
            inner["bytes"] = (out / "calib.json").read_bytes()

    with pytest.raises(InputError, match="another run wrote it"):
        _calibrate(small, out, progress=progress)
    assert (out / "calib.json").read_bytes() == inner["bytes"]
    assert not list(tmp_path.glob(".calib*"))


# ---- options and verification -------------------------------------------------------------------------

@pytest.mark.parametrize("formats", ["", ",", " , "])
def test_empty_formats_are_refused(small, tmp_path, formats):
    model, tok, text = small
    r = CliRunner().invoke(main, ["calibrate", str(model), "--data", str(text), "--tokenizer", str(tok),
                                  "-o", str(tmp_path / "c"), "--formats", formats])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error") and "--formats" in lines[0], r.output
    assert not (tmp_path / "c").exists()


def _nan_calibration(small, tmp_path) -> Path:
    out = tmp_path / "calib"
    _calibrate(small, out)
    text = (out / "calib.json").read_text()
    calib = json.loads(text)
    calib["sensitivity"]["delta_kl"]["int8"][1][0] = float("nan")
    (out / "calib.json").write_text(json.dumps(calib, indent=2, sort_keys=True) + "\n")
    return out


def test_verify_and_convert_refuse_a_nan_calibration(small, tmp_path):
    out = _nan_calibration(small, tmp_path)
    write_manifest(out, kind="calibration", file_hashes={})  # hashes that match: only the NaN is wrong
    with pytest.raises(VerifyError, match=r"NaN or infinite number at sensitivity\.delta_kl\.int8\.1\.0"):
        verify_artifact(out)
    with pytest.raises(InputError, match="NaN"):
        load_calib(out)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code != 0 and "NaN" in r.output


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_result_is_not_written(tmp_path, bad):
    from trtmoe.quant.calibrate import write_calibration

    result = {"version": 1, "sensitivity": {"delta_kl": {"int8": [[0.1, bad]]}}}
    with pytest.raises(InputError, match=r"non-finite at sensitivity\.delta_kl\.int8\.0\.1"):
        write_calibration(tmp_path, result)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["__pycache__/model.cpython-311.pyc", "1/__pycache__/model.cpython-311.pyc",
                                  "1/model.pyc"])
def test_verify_ignores_bytecode_caches(tmp_path, name):
    art = tmp_path / "a"
    (art / "1").mkdir(parents=True)
    (art / "1" / "model.py").write_text("x = 1\n")
    write_manifest(art, kind="test", file_hashes={})
    p = art / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"\x00bytecode")
    verify_artifact(art)
    (art / "1" / "extra.py").write_text("y = 2\n")  # anything else unlisted is still a problem
    with pytest.raises(VerifyError, match="extra.py"):
        verify_artifact(art)


# ---- repo: no remote code, no manifest entry outside the engine ------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    return tiny_mixtral_engine(tiny_model, tmp_path_factory.mktemp("eng"), "tokm")[3]


def _repo(args, out):
    r = CliRunner().invoke(main, ["repo", *map(str, args), "-o", str(out)])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    return r, lines


@pytest.mark.parametrize("how", ["option", "yaml"])
def test_repo_refuses_trust_remote_code(engine, tmp_path, how):
    if how == "option":
        args = [engine, "--trust-remote-code"]
    else:
        (tmp_path / "c.yaml").write_text("repo:\n  trust_remote_code: true\n")
        args = [engine, "-c", tmp_path / "c.yaml"]
    r, lines = _repo(args, tmp_path / "repo")
    assert r.exit_code == 2 and len(lines) == 1 and "--trust-remote-code is refused" in lines[0], r.output
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("entry", ["../ckpt/rank0.safetensors", "/etc/passwd", "a/../../x"])
def test_repo_refuses_an_engine_manifest_entry_outside_the_engine(engine, tmp_path, entry):
    import shutil

    eng = Path(shutil.copytree(engine, tmp_path / "engine"))
    shutil.copytree(engine.parent / "ckpt", tmp_path / "ckpt")
    m = json.loads((eng / "manifest.json").read_text())
    m["files"][entry] = "0" * 64
    (eng / "manifest.json").write_text(json.dumps(m))
    r, lines = _repo([eng], tmp_path / "repo")
    assert r.exit_code == 2 and len(lines) == 1 and repr(entry) in lines[0] and "manifest" in lines[0], r.output
    assert not (tmp_path / "repo").exists()


# ---- the HTTP front before tritonserver ---------------------------------------------------------------

@pytest.fixture
def front():
    """A BodyLimitFront (limit 1000 bytes) before a small HTTP/1.1 server that answers how many body
    bytes it read, streams a chunked answer on /stream, and closes on /close."""
    import http.server
    import threading

    from trtmoe.triton.front import BodyLimitFront

    class Upstream(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            if self.headers.get("Transfer-Encoding") == "chunked":
                data = b""
                while True:
                    line = self.rfile.readline()
                    if not line:  # the front cut the body off at its limit: nothing arrives to answer
                        return
                    n = int(line.strip(), 16)
                    if not n:
                        break
                    data += self.rfile.read(n)
                    self.rfile.readline()
                self.rfile.readline()
            else:
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/stream":
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(3):
                    part = f"data: {i}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                return
            body = json.dumps({"got": len(data), "sha": hashlib.sha256(data).hexdigest()}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Quiet(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            # A client the front answered 413 (or hung up on) closes before the stub's reply is sent;
            # anything else the stub raises is still printed.
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    up = Quiet(("127.0.0.1", 0), Upstream)
    threading.Thread(target=up.serve_forever, daemon=True).start()
    f = BodyLimitFront("127.0.0.1", 0, up.server_address[1], 1000).start()
    try:
        yield f, up
    finally:
        f.stop()
        up.shutdown()


def _raw(port: int, data: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        out = b""
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the front may answer and close before the request is all sent
            pass
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    return out


def test_the_front_passes_bodies_up_to_the_limit_on_one_connection(front):
    import http.client

    f, _ = front
    c = http.client.HTTPConnection("127.0.0.1", f.port, timeout=10)
    for n in (0, 10, 1000):  # keep-alive: one connection, requests in turn
        body = os.urandom(n)
        c.request("POST", "/x", body=body)
        r = c.getresponse()
        assert r.status == 200 and json.loads(r.read()) == {"got": n, "sha": hashlib.sha256(body).hexdigest()}
    c.request("POST", "/x", body=iter([b"a" * 600, b"b" * 400]), encode_chunked=True)
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["got"] == 1000
    c.request("POST", "/stream", body=b"{}")
    r = c.getresponse()
    assert r.status == 200 and r.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert f.refused == 0


@pytest.mark.parametrize("request_bytes,status", [
    (b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 1001\r\n\r\n", 413),
    (b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999\r\nExpect: 100-continue\r\n\r\n", 413),
    (b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n" + b"a" * 1000 + b"\r\n1\r\nb\r\n0\r\n\r\n", 413),
    (b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcde", 400),
    (b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
    (b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST /x HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431),
    # a request within the limit, then one over it on the same connection: the first is answered
    (b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabcPOST /x HTTP/1.1\r\nHost: a\r\n"
     b"Content-Length: 5000\r\n\r\n", 413),
])
def test_the_front_refuses_what_tritonserver_should_not_parse(front, request_bytes, status):
    f, _ = front
    out = _raw(f.port, request_bytes)
    assert out.split(b"\r\n", 1)[0].split()[1] == str(status).encode(), out[:300]
    assert json.loads(out.split(b"\r\n\r\n")[-1])["error"]
    assert f.refused == (1 if status == 413 else 0)


def test_the_front_answers_503_while_the_server_is_down(front):
    f, up = front
    up.shutdown()
    up.server_close()
    out = _raw(f.port, b"GET /v2/health/ready HTTP/1.1\r\nHost: a\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 503 ")
