"""Artifacts never destroy their inputs, and a kill at any file-system step of the final swap leaves
the previous complete output or the new one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trtmoe.checkpoint import atomic
from trtmoe.checkpoint.writer import convert
from trtmoe.errors import InputError

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_cli(args, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trtmoe.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)


# A calibration's measured seconds (calib.cost.json, and its hash in the manifest) differ from run to
# run by design; everything else an artifact holds is byte-reproducible.
TIMINGS = "calib.cost.json"


def _without_timings(v):
    if isinstance(v, dict):
        return {k: _without_timings(x) for k, x in v.items() if k != TIMINGS}
    if isinstance(v, list):
        return [_without_timings(x) for x in v if x != TIMINGS]
    return v


def tree_digest(d: Path) -> dict[str, str]:
    out = {}
    for p in sorted(d.rglob("*")):
        if not p.is_file() or p.name == TIMINGS:
            continue
        data = p.read_bytes()
        if p.name == "manifest.json" and (p.parent / TIMINGS).is_file():
            data = json.dumps(_without_timings(json.loads(data)), sort_keys=True).encode()
        out[p.relative_to(d).as_posix()] = hashlib.sha256(data).hexdigest()
    return out


# ---- outputs that would replace an input ------------------------------------------------------------

@pytest.fixture()
def models(tiny_model, tmp_path) -> Path:
    """A folder of two models, like a user's ~/models."""
    root = tmp_path / "models"
    for name, arch in (("mixtral", "mixtral"), ("qwen", "qwen2_moe")):
        shutil.copytree(tiny_model(arch), root / name)
    return root


@pytest.mark.parametrize("target", ["model", "models_root", "tmp_path"])
def test_convert_force_never_replaces_its_model(models, tmp_path, target):
    out = {"model": models / "mixtral", "models_root": models, "tmp_path": tmp_path}[target]
    before = tree_digest(tmp_path)
    proc = run_cli(["convert", models / "mixtral", "-o", out, "--force"])
    assert proc.returncode == 2, proc.stderr
    assert "would replace one of this command's inputs" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert tree_digest(tmp_path) == before


def test_convert_force_never_replaces_its_calibration(tiny_model, tmp_path):
    calib = tmp_path / "calib"
    calib.mkdir()
    (calib / "calib.json").write_text("{}")
    with pytest.raises(InputError, match="inputs"):
        convert(tiny_model("mixtral"), calib, force=True, inputs=(calib,))
    assert (calib / "calib.json").read_text() == "{}"


def test_inputs_reached_through_a_link_are_recognised(models, tmp_path):
    link = tmp_path / "alias"
    link.symlink_to(models)
    with pytest.raises(InputError, match="inputs"):
        convert(link / "mixtral", models, force=True)


def test_force_replaces_only_trtmoe_artifacts(tiny_model, tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = run_cli(["convert", tiny_model("mixtral"), "-o", out, "--force"])
    assert proc.returncode == 2 and "not a trtmoe artifact" in proc.stderr
    assert (out / "notes.txt").read_text() == "mine"
    # An empty directory and a previous trtmoe artifact (even with a stray file) are replaced.
    (out / "notes.txt").unlink()
    convert(tiny_model("mixtral"), out, force=True)
    (out / "stale.txt").write_text("old")
    convert(tiny_model("qwen2_moe"), out, force=True)
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "config.json").read_text())["architecture"] != "MixtralForCausalLM"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_build_and_repo_refuse_their_inputs(tiny_model, tmp_path):
    ck = tmp_path / "ckpt"
    convert(tiny_model("mixtral"), ck)
    before = tree_digest(ck)
    for args in (["build", ck, "-o", ck, "--backend", "embedded", "--force"],
                 ["build", ck, "-o", tmp_path, "--backend", "embedded", "--force"],
                 ["build", ck, "-o", ck / "engine", "--backend", "embedded"],
                 ["build", ck, "-o", tmp_path, "--backend", "tensorrt-llm", "--dry-run"]):
        proc = run_cli(args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert tree_digest(ck) == before


def test_killed_replacement_restores_the_previous_output(tiny_model, tmp_path):
    """Where the swap is two renames, a kill between them leaves the previous output aside; the
    next run puts it back instead of deleting it."""
    out = tmp_path / "ckpt"
    convert(tiny_model("mixtral"), out)
    before = tree_digest(out)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    os.rename(out, tmp_path / f".ckpt.trtmoe-partial-{dead.pid}-old-0123abcd")
    with pytest.raises(InputError, match="already exists"):
        convert(tiny_model("mixtral"), out)
    assert tree_digest(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


# ---- a kill at every step of the swap ---------------------------------------------------------------

_DRIVER = textwrap.dedent("""
    import os, shutil, signal, sys
    from trtmoe.checkpoint import atomic
    from trtmoe.checkpoint.writer import convert

    kill_at, exchange_ok = int(sys.argv[1]), sys.argv[2] == "1"
    calls = [0]

    def step(fn):
        def wrapped(*a, **k):
            if sys._getframe(1).f_code.co_filename == atomic.__file__:
                calls[0] += 1
                if calls[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **k)
        return wrapped

    os.rename = step(os.rename)
    shutil.rmtree = step(shutil.rmtree)
    atomic.exchange = step(atomic.exchange if exchange_ok else lambda a, b: False)
    convert(sys.argv[3], sys.argv[4], tp=2, force=True)
    print(calls[0])
""")


@pytest.mark.parametrize("exchange_ok", [True, False], ids=["exchange", "two-renames"])
def test_kill_at_every_swap_step(tiny_model, tmp_path, exchange_ok):
    if exchange_ok and not atomic.exchange(tmp_path, tmp_path):
        pytest.skip("this file system has no atomic exchange (renameat2 RENAME_EXCHANGE)")
    model = tiny_model("mixtral")
    previous, new = tmp_path / "previous", tmp_path / "new"
    convert(model, previous)
    convert(model, new, tp=2)
    old_bytes, new_bytes = tree_digest(previous), tree_digest(new)
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)

    def attempt(kill_at: int, parent: Path) -> subprocess.CompletedProcess:
        out = parent / "ckpt"
        shutil.copytree(previous, out)
        return subprocess.run([sys.executable, str(driver), str(kill_at), "1" if exchange_ok else "0", str(model),
                               str(out)], capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)

    full = attempt(0, tmp_path / "count")
    assert full.returncode == 0, full.stderr
    steps = int(full.stdout.split()[-1])
    # exchange + cleanup, or a refused exchange + rename aside + rename in + cleanup
    assert steps == (2 if exchange_ok else 4)
    for k in range(1, steps + 1):
        parent = tmp_path / f"kill{k}"
        proc = attempt(k, parent)
        assert proc.returncode == -9, proc.stderr
        out = parent / "ckpt"
        if out.exists():  # right after the kill: the previous output or the new one, complete
            assert tree_digest(out) in (old_bytes, new_bytes), k
        # The next run of the same command restores or cleans up, and ends with the new bytes.
        convert(model, out, tp=2, force=True)
        assert tree_digest(out) == new_bytes
        assert [p.name for p in parent.iterdir()] == ["ckpt"], k


# ---- manifests and links that lead outside the artifact ---------------------------------------------

@pytest.mark.parametrize("key", ["../outside.txt", "/etc/hostname", "a/../../outside.txt", "escape.txt"])
def test_manifest_paths_stay_inside_the_artifact(tiny_model, tmp_path, key):
    ck = tmp_path / "ckpt"
    convert(tiny_model("mixtral"), ck)
    (tmp_path / "outside.txt").write_text("not yours")
    if key == "escape.txt":  # a listed file that is a link out of the artifact
        (ck / key).symlink_to(tmp_path / "outside.txt")
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"][key] = hashlib.sha256(b"not yours").hexdigest()
    (ck / "manifest.json").write_text(json.dumps(manifest))
    for args in (["verify", ck], ["build", ck, "-o", tmp_path / "engine", "--backend", "embedded"]):
        proc = run_cli(args)
        assert proc.returncode == 1, (args, proc.stderr)
        assert key in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "engine").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "outside.txt"]


def test_tokenizer_links_out_of_the_model_are_not_copied(tmp_path):
    model = shutil.copytree(REPO_ROOT / "tests" / "fixtures" / "trained_mixtral", tmp_path / "model")
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": 1}')
    (model / "special_tokens_map.json").unlink(missing_ok=True)
    (model / "special_tokens_map.json").symlink_to(secret)
    convert(model, tmp_path / "ckpt")
    copied = {p.name for p in (tmp_path / "ckpt" / "tokenizer").iterdir()}
    assert "tokenizer.json" in copied and "special_tokens_map.json" not in copied


def test_repository_tokenizer_links_out_of_its_folder_are_not_copied(tmp_path):
    from trtmoe.build.embedded import build_embedded
    from trtmoe.config import defaults
    from trtmoe.triton.repository import generate_repository

    model = REPO_ROOT / "tests" / "fixtures" / "trained_mixtral"
    convert(model, tmp_path / "ckpt")
    build_embedded(tmp_path / "ckpt", tmp_path / "engine", {**defaults()["build"], "max_input_len": 128})
    tok = shutil.copytree(model, tmp_path / "tok", ignore=shutil.ignore_patterns("*.safetensors"))
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": 1}')
    (tok / "special_tokens_map.json").unlink(missing_ok=True)
    (tok / "special_tokens_map.json").symlink_to(secret)
    (tok / "inside.json").symlink_to(tok / "tokenizer_config.json")  # a link within the folder is fine
    generate_repository(tmp_path / "engine", tmp_path / "repo", tokenizer_dir=tok)
    copied = {p.name for p in (tmp_path / "repo" / "preprocessing" / "tokenizer").iterdir()}
    assert {"tokenizer.json", "inside.json"} <= copied and "special_tokens_map.json" not in copied


# ---- a kill between any two file-system steps of build and repo -------------------------------------

# Runs one command many times, each in a fork that SIGKILLs itself right before its k-th file-system
# step under its own folder (a link, rename, exchange, mkdir, unlink, copy, rmtree or file opened for
# writing), so every state the command can leave on disk is reached once. Fork: the imports (torch,
# the tokenizer libraries) are paid once, not once per kill point.
_STEP_DRIVER = textwrap.dedent("""
    import builtins, json, os, pathlib, shutil, signal, sys
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from trtmoe.checkpoint import atomic
    from trtmoe.cli import main
    import trtmoe.build.embedded, trtmoe.triton.repository  # noqa: F401 (imported before forking)

    spec = json.loads(sys.argv[1])

    def run(kill_at, root):
        count, swap_at = [0], [0]

        def counted(fn):
            def wrapped(*a, **kw):
                if any(isinstance(x, (str, os.PathLike)) and os.fspath(x).startswith(root) for x in a[:2]):
                    count[0] += 1
                    if count[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                return fn(*a, **kw)
            return wrapped

        real_open = builtins.open
        counted_open = counted(real_open)
        builtins.open = lambda f, mode="r", *a, **kw: (counted_open if any(c in mode for c in "wax+")
                                                      else real_open)(f, mode, *a, **kw)
        for owner, name in ((os, "link"), (os, "rename"), (os, "replace"), (os, "mkdir"), (os, "symlink"),
                            (os, "unlink"), (os, "rmdir"), (shutil, "copyfile"), (shutil, "copy2"),
                            (shutil, "copystat"), (shutil, "rmtree"), (pathlib.Path, "write_text"),
                            (pathlib.Path, "write_bytes")):
            setattr(owner, name, counted(getattr(owner, name)))
        exchange = counted(atomic.exchange if spec["exchange"] else (lambda a, b: False))

        def noted_exchange(a, b):
            swap_at[0] = swap_at[0] or count[0] + 1
            return exchange(a, b)
        atomic.exchange = noted_exchange
        args = [os.path.join(root, "out") if a == "OUT" else a for a in spec["args"]]
        try:
            main(args, prog_name="trtmoe")
            code = 0
        except SystemExit as e:
            code = e.code or 0
        with real_open(os.path.join(root, "..", os.path.basename(root) + ".steps"), "w") as f:
            f.write(f"{count[0]} {swap_at[0]}")
        return code

    # One unobserved run first, so the lazy imports (protobuf, tokenizers, ...) happen before forking.
    warm = os.path.join(spec["warm"], "out")
    try:
        main([warm if a == "OUT" else a for a in spec["args"]], prog_name="trtmoe")
    except SystemExit:
        pass
    shutil.rmtree(spec["warm"])
    results = {}
    for k, root in spec["runs"]:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run(k, root)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        results[str(k)] = os.waitstatus_to_exitcode(status)
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def engine_and_checkpoint(tiny_model, tmp_path_factory):
    from trtmoe.build.embedded import build_embedded
    from trtmoe.config import defaults

    root = tmp_path_factory.mktemp("kill-steps")
    model = shutil.copytree(tiny_model("mixtral", vocab_size=2048), root / "model")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(REPO_ROOT / "tests" / "fixtures" / "trained_mixtral" / f, model / f)
    convert(model, root / "ckpt")
    build_embedded(root / "ckpt", root / "engine", {**defaults()["build"], "max_input_len": 64})
    from trtmoe.data import write_split_text

    write_split_text("calib", root / "calib.txt", max_bytes=20000)
    return {"model": model, "ckpt": root / "ckpt", "engine": root / "engine", "text": root / "calib.txt"}


def _drive(driver: Path, args: list, runs: list[tuple[int, Path]], exchange_ok: bool) -> dict[str, int]:
    warm = driver.parent / "warm"
    warm.mkdir()
    spec = {"args": [str(a) for a in args], "exchange": exchange_ok, "runs": [(k, str(d)) for k, d in runs],
            "warm": str(warm)}
    proc = subprocess.run([sys.executable, str(driver), json.dumps(spec)], capture_output=True, text=True,
                          timeout=600, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(c in (0, -signal.SIGKILL) for c in codes.values()), (codes, proc.stderr[-3000:])
    return codes


@pytest.mark.parametrize("exchange_ok", [True, False], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("command", ["convert", pytest.param("calibrate", marks=pytest.mark.slow), "build", "repo"])
def test_kill_at_every_step(engine_and_checkpoint, tmp_path, command, exchange_ok, request):
    """With a previous output in place, a SIGKILL before any one file-system step of `--force` (the
    scratch checkpoint and progress files of calibrate included) leaves
    at the output path the previous output or the new one, complete; the next run cleans up and
    writes exactly the bytes of an uninterrupted run."""
    from click.testing import CliRunner

    from trtmoe.cli import main

    if exchange_ok and not atomic.exchange(tmp_path, tmp_path):
        pytest.skip("this file system has no atomic exchange (renameat2 RENAME_EXCHANGE)")
    a = engine_and_checkpoint
    base, prev_extra, new_extra, min_steps = {
        "convert": (["convert", a["model"], "-o", "OUT"], ["--dtype", "bfloat16"], ["--tp", "2", "--moe-ep", "2"], 8),
        "calibrate": (["calibrate", a["model"], "--data", a["text"], "-o", "OUT", "--seq-len", "16", "--formats",
                       "int8"], ["--samples", "2"], ["--samples", "3"], 8),
        "build": (["build", a["ckpt"], "-o", "OUT", "--backend", "embedded", "--max-input-len", "64"],
                  ["--max-batch-size", "4"], [], 8),
        "repo": (["repo", a["engine"], "-o", "OUT"], ["--max-batch-size", "4"], [], 15),
    }[command]
    prev_args, new_args = [*base, *prev_extra], [*base, *new_extra, "--force"]

    def cli(args, root: Path):
        res = CliRunner().invoke(main, [str(root / "out") if a == "OUT" else str(a) for a in args])
        assert res.exit_code == 0, (args, res.output, res.stderr)

    # In-process runs on one thread, as the driver's (OMP_NUM_THREADS=1): float sums of calibration's
    # scores depend on the thread count, so otherwise the bytes would depend on the tests run before.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    # References at the same depth as the runs (a repository records its engine by relative path).
    for name, args in (("prev", prev_args), ("new", new_args)):
        (tmp_path / name).mkdir()
        cli(args, tmp_path / name)
    prev, new = tree_digest(tmp_path / "prev" / "out"), tree_digest(tmp_path / "new" / "out")
    assert prev != new

    def fresh(name: str) -> Path:
        root = tmp_path / name
        shutil.copytree(tmp_path / "prev" / "out", root / "out")
        return root

    driver = tmp_path / "driver.py"
    driver.write_text(_STEP_DRIVER)
    # An uninterrupted run counts the steps (and must itself produce the new bytes).
    assert _drive(driver, new_args, [(0, fresh("count"))], exchange_ok) == {"0": 0}
    steps, swap_at = map(int, (tmp_path / "count.steps").read_text().split())
    assert tree_digest(tmp_path / "count" / "out") == new
    assert steps >= min_steps and 1 < swap_at <= steps, (steps, swap_at)
    # Every step with the exchange; the fallback differs from it only from the swap on.
    first = 1 if exchange_ok else swap_at
    roots = {k: fresh(f"kill{k}") for k in range(first, steps + 1)}
    codes = _drive(driver, new_args, list(roots.items()), exchange_ok)
    for k, root in roots.items():
        assert codes[str(k)] == -signal.SIGKILL, (k, codes[str(k)])
        out = root / "out"
        if exchange_ok:
            assert out.is_dir(), f"step {k}: no output at all"
        if out.exists():
            assert tree_digest(out) in (prev, new), f"step {k}: a half-written output"
        cli(new_args, root)
        assert tree_digest(out) == new, k
        assert [p.name for p in root.iterdir()] == ["out"], (k, list(root.iterdir()))
