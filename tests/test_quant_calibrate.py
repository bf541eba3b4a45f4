"""`trtmoe calibrate` as an artifact: atomic output with a manifest, no leftovers after a kill,
deterministic bytes, formats that cannot apply skipped with a note, and the BOS/EOS it used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trtmoe.checkpoint.manifest import read_manifest
from trtmoe.checkpoint.verify import verify_artifact
from trtmoe.checkpoint.writer import convert
from trtmoe.data import write_split_text
from trtmoe.quant.calibrate import calibrate, measure
from trtmoe.runtime.engine import EmbeddedEngine

from test_quant_pipeline import cli, make_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("mixtral", num_local_experts=4, num_hidden_layers=2, seed=5)


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("txt") / "calib.txt"
    write_split_text("calib", p, max_bytes=8_000)
    return p


def _args(model, text, tokdir, out):
    return ["calibrate", model, "--data", text, "--tokenizer", tokdir, "--samples", 2, "--seq-len", 16,
            "--formats", "int8,int4", "-o", out]


def _kill_at_first_progress(model, text, tokdir, out, env=None) -> int:
    """Run calibrate in a child that SIGKILLs itself at its first sensitivity step (the scratch
    checkpoint exists by then); returns the child's exit status."""
    code = (
        "import os, signal, sys\n"
        "from trtmoe.quant.calibrate import calibrate\n"
        "out = sys.argv[4] if sys.argv[4] != '-' else None\n"
        "calibrate(sys.argv[1], sys.argv[2], out, tokenizer=sys.argv[3], samples=2, seq_len=16,\n"
        "          formats=('int8',), progress=lambda *a: os.kill(os.getpid(), signal.SIGKILL))\n")
    r = subprocess.run([sys.executable, "-c", code, str(model), str(text), str(tokdir), str(out)],
                       env={**os.environ, **(env or {})}, cwd=REPO, capture_output=True)
    return r.returncode


def test_killed_calibration_leaves_its_scratch_beside_the_output_and_the_next_run_removes_it(
        model, text, tokdir, tmp_path):
    out = tmp_path / "calib"
    assert _kill_at_first_progress(model, text, tokdir, out) == -9
    left = list(tmp_path.glob(".calib.trtmoe-partial-*"))
    assert len(left) == 1 and (left[0] / "scratch-checkpoint" / "rank0.safetensors").is_file()
    assert not out.exists()
    cli(*_args(model, text, tokdir, out))
    assert not list(tmp_path.glob(".calib*")), "the killed run's scratch checkpoint is still there"
    assert sorted(p.name for p in out.iterdir()) == ["activations.safetensors", "calib.cost.json", "calib.json",
                                                     "manifest.json", "moe-inputs", "recipes"]


def test_killed_outputless_calibration_is_cleaned_by_the_next_one(model, text, tokdir, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    assert _kill_at_first_progress(model, text, tokdir, "-", env={"TMPDIR": str(scratch)}) == -9
    assert len(list(scratch.glob(".trtmoe-calib.trtmoe-partial-*"))) == 1
    # A partial whose owner is alive is left alone (another calibration may be running).
    live = scratch / f".trtmoe-calib.trtmoe-partial-{os.getpid()}-00000000"
    live.mkdir()
    code = ("import sys\nfrom trtmoe.quant.calibrate import calibrate\n"
            "calibrate(sys.argv[1], sys.argv[2], None, tokenizer=sys.argv[3], samples=2, seq_len=16, formats=('int8',))\n")
    subprocess.run([sys.executable, "-c", code, str(model), str(text), str(tokdir)], check=True, cwd=REPO,
                   env={**os.environ, "TMPDIR": str(scratch)}, capture_output=True)
    assert sorted(p.name for p in scratch.iterdir()) == [live.name]


def test_calibration_is_an_artifact_with_deterministic_bytes(model, text, tokdir, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    cli(*_args(model, text, tokdir, a))
    # Rerunning into an existing output needs --force, and leaves it untouched without.
    res = cli(*_args(model, text, tokdir, a), expect=2)
    assert "already exists" in res.output
    cli(*_args(model, text, tokdir, b), "--force")
    assert (a / "calib.json").read_bytes() == (b / "calib.json").read_bytes()
    # The measured seconds live in calib.cost.json alone: the manifests differ in its hash only.
    man_a, man_b = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert man_a["files"].pop("calib.cost.json") != man_b["files"].pop("calib.cost.json")
    assert man_a == man_b
    cal = json.loads((a / "calib.json").read_text())
    assert "seconds" not in json.dumps(cal)
    assert cal["model"] == str(Path(model).resolve()) and cal["data"]["path"] == str(Path(text).resolve())
    assert verify_artifact(a)["kind"] == "calibration"
    man = read_manifest(a)
    # The MoE layers' stored inputs, which the activation statistics are rebuilt from, and the int4
    # recipes the searches chose (convert applies them) are hashed too.
    assert man["kind"] == "calibration" and set(man["files"]) == {
        "calib.json", "calib.cost.json", "activations.safetensors", *(f"moe-inputs/{l}.safetensors" for l in cal["moe_layers"]),
        *(f"recipes/{l}.safetensors" for l in cal["moe_layers"])}
    assert "model.safetensors" in man["source"]["files"]
    (a / "calib.json").write_text((a / "calib.json").read_text().replace('"version": 2', '"version": 2 '))
    with pytest.raises(Exception, match="sha256"):
        verify_artifact(a)


def test_sensitivity_is_never_negative_and_does_not_depend_on_the_thread_count(model, tmp_path):
    ck = convert(model, tmp_path / "ck").out_dir
    ids = torch.randint(0, 250, (4, 16), generator=torch.Generator().manual_seed(1))
    runs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        runs.append(measure(EmbeddedEngine.from_checkpoint(ck, device="cpu"), ids, formats=("int8",)))
    torch.set_num_threads(1)
    for m in ("fc", "proj"):
        vals = [v for row in runs[0]["sensitivity"]["matrices"][m]["measured"]["int8"] for v in row]
        assert min(vals) >= 0.0
    assert json.dumps(runs[0], sort_keys=True) == json.dumps(runs[1], sort_keys=True)


def test_convert_manifest_records_the_resolved_calibration(model, text, tokdir, tmp_path, monkeypatch):
    cli(*_args(model, text, tokdir, tmp_path / "calib"))
    monkeypatch.chdir(tmp_path)
    cli("convert", model, "-o", "ck", "--calib", "calib", "--budget", "6", "--formats", "fp16,int8,int4")
    man = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert man["resolved_config"]["quantize"]["calib"] == str((tmp_path / "calib").resolve())
    import hashlib
    want = hashlib.sha256((tmp_path / "calib" / "calib.json").read_bytes()).hexdigest()
    assert man["quantization"]["calib"] == {"path": str((tmp_path / "calib").resolve()), "sha256": want}


def test_formats_the_shapes_do_not_allow_are_skipped_with_a_note(tiny_model, text, tokdir, tmp_path):
    # Hidden size 160: no group size (64, 128) divides fc's input, so both group formats are skipped.
    odd = tiny_model("mixtral", num_local_experts=4, num_hidden_layers=2, seed=5, hidden_size=160,
                     intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=40)
    res = cli("calibrate", odd, "--data", text, "--tokenizer", tokdir, "--samples", 2, "--seq-len", 16,
              "-o", tmp_path / "c")
    out = " ".join(res.output.split())
    assert "int4_g128 skipped" in out and "int4_g64 skipped" in out and "160" in out
    cal = json.loads((tmp_path / "c" / "calib.json").read_text())
    assert cal["formats"] == ["int8", "int4"]
    assert set(cal["skipped_formats"]) == {"int4_g128", "int4_g64"}
    cli("convert", odd, "-o", tmp_path / "ck", "--calib", tmp_path / "c", "--budget", "5")
    # Only when nothing fits is it an error.
    res = cli("calibrate", odd, "--data", text, "--tokenizer", tokdir, "--samples", 2, "--seq-len", 16,
              "--formats", "int4_g64", "-o", tmp_path / "c2", expect=2)
    assert "none of the candidate formats" in res.output and not (tmp_path / "c2").exists()


def test_calibration_says_which_bos_and_eos_it_used(model, text, tokdir, tmp_path):
    # A tokenizer without tokenizer_config.json: BOS from special_tokens_map.json is still prepended.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tokdir / "tokenizer.json", bare)
    (bare / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    cal = calibrate(model, text, None, tokenizer=bare, samples=2, seq_len=16, formats=("int8",))
    assert cal["tokens"]["bos_id"] == 1 and cal["tokens"]["add_bos"] and cal["tokens"]["eos_id"] == 2
    notes = []
    off = calibrate(model, text, None, tokenizer=bare, samples=2, seq_len=16, formats=("int8",), add_bos=False,
                    notes=notes)
    assert off["tokens"]["bos_id"] is None and off["data"]["sha256"] != cal["data"]["sha256"]
    assert any("BOS not prepended" in n and "--no-add-bos" in n for n in notes)
    # tokenizer_config.json's choice is followed and named.
    res = cli(*_args(model, text, tokdir, tmp_path / "c"))
    assert "BOS '<s>' (id 1)" in res.output and "EOS '</s>' (id 2)" in res.output
    assert "add_bos_token" in res.output


def test_sensitivity_method_and_device_are_chosen_on_the_command_line(model, text, tokdir, tmp_path):
    res = cli(*_args(model, text, tokdir, tmp_path / "ex"), "--sensitivity", "exact", "--rounding", "rtn")
    assert "sensitivity (exact)" in " ".join(res.output.split())
    cal = json.loads((tmp_path / "ex" / "calib.json").read_text())
    assert cal["sensitivity"]["method"] == "exact"
    res = cli(*_args(model, text, tokdir, tmp_path / "fi"), "--rounding", "rtn")
    cal = json.loads((tmp_path / "fi" / "calib.json").read_text())
    assert cal["sensitivity"]["method"] == "fisher" and cal["sensitivity"]["cost_forward_passes"] <= 6
    if not torch.cuda.is_available():
        res = cli(*_args(model, text, tokdir, tmp_path / "gpu"), "--device", "cuda", expect=2)
        assert "no CUDA device" in res.output and not (tmp_path / "gpu").exists()
