"""Artifacts never destroy their inputs, and a kill at any file-system step of the final swap leaves
the previous complete output or the new one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trtmoe.checkpoint import atomic
from trtmoe.checkpoint.writer import convert
from trtmoe.errors import InputError

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_cli(args, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trtmoe.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)


def tree_digest(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


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
