"""YAML build configs: the shipped ones are valid and sensible; mistakes name the key and what is
allowed; precedence is CLI > YAML > defaults, both in ``resolve`` and through ``trtmoe convert``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import click
from conftest import require_fixture
import pytest

from trtmoe import config as cfgmod
from trtmoe.build.preflight import resolve_limits
from trtmoe.errors import ConfigError, LayoutError
from trtmoe.model.description import ModelSpec
from trtmoe.parallel.mapping import Mapping

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO_ROOT / "build_configs").glob("*.yaml"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}

# Public facts of the models the shipped configs name (their HF config.json values).
MODEL_FACTS = {
    "mistralai/Mixtral-8x7B-v0.1": dict(
        family="mixtral", hf_architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, num_experts=8, top_k=2, expert_intermediate_size=14336,
        normalization_mode=1, moe_layers=(True,) * 32, max_position_embeddings=32768, source_dtype="bfloat16"),
    "Qwen/Qwen1.5-MoE-A2.7B": dict(
        family="qwen2_moe", hf_architecture="Qwen2MoeForCausalLM", vocab_size=151936, hidden_size=2048,
        num_layers=24, num_heads=16, num_kv_heads=16, head_dim=128, num_experts=60, top_k=4,
        expert_intermediate_size=1408, normalization_mode=0, moe_layers=(True,) * 24, dense_intermediate_size=5632,
        shared_expert_intermediate_size=5632, shared_expert_gate=True, qkv_bias=True,
        max_position_embeddings=8192, source_dtype="bfloat16"),
}


def test_shipped_configs_exist():
    assert {p.name for p in SHIPPED} >= {"tiny-cpu.yaml", "mixtral-8x7b-ep8.yaml", "qwen-moe.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    data = cfgmod.load_yaml(path)
    assert data["model"] and {"convert", "build"} <= set(data)
    resolved = cfgmod.resolve(path)
    cv = resolved["convert"]
    Mapping.create(cv["tp"], cv["pp"], cv["moe_tp"], cv["moe_ep"])  # moe_tp × moe_ep = tp


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_comments_every_key(path):
    """Every key line carries a comment, inline or on the line just above it."""
    prev = ""
    missing = []
    for line in path.read_text().splitlines():
        s = line.strip()
        if re.match(r"^[A-Za-z_]+:", s) and "#" not in s and not prev.startswith("#"):
            missing.append(s)
        if s:
            prev = s
    assert not missing, f"keys without a comment: {missing}"


@pytest.mark.parametrize("name", ["mixtral-8x7b-ep8.yaml", "qwen-moe.yaml"])
def test_gpu_configs_fit_their_models(name):
    """The layout can hold the named model and the build limits agree with each other and with it."""
    resolved = cfgmod.resolve(REPO_ROOT / "build_configs" / name)
    facts = MODEL_FACTS[resolved["model"]]
    cv = resolved["convert"]
    mapping = Mapping.create(cv["tp"], cv["pp"], cv["moe_tp"], cv["moe_ep"])
    mapping.validate(ModelSpec(**facts))
    assert cv["dtype"] == facts["source_dtype"]
    b = resolved["build"]
    assert b["backend"] == "tensorrt-llm" and b["workers"] == mapping.world_size
    ck = SimpleNamespace(dtype=cv["dtype"], seq_len_limit=facts["max_position_embeddings"],
                         max_position_embeddings=facts["max_position_embeddings"])
    resolve_limits(b, ck, b["backend"])  # raises ConfigError naming any contradiction


def test_qwen_config_is_a_graded_plan_for_trtllm():
    q = cfgmod.resolve(REPO_ROOT / "build_configs" / "qwen-moe.yaml")["quantize"]
    assert q["policy"] == "graded" and q["budget_bpw"] is not None and q["calib"]
    assert len(q["formats"]) >= 3
    # Every candidate is one the support table lets Qwen2-MoE build on the configured release (no AWQ:
    # SharedMoE), and at least one quantized format fits the budget on its own (no MIXED_PRECISION).
    from trtmoe.checkpoint.support import canonical_format, options

    line = cfgmod.resolve(REPO_ROOT / "build_configs" / "qwen-moe.yaml")["convert"]["trtllm_version"]
    allowed = options(line, "qwen2_moe")
    assert not allowed.has_mixed
    assert all(canonical_format(f) in allowed.uniform for f in q["formats"]), (q["formats"], allowed.uniform)
    assert "int4" in q["formats"] and q["budget_bpw"] >= 4.25


def test_tiny_cpu_config_matches_the_trained_fixture():
    resolved = cfgmod.resolve(REPO_ROOT / "build_configs" / "tiny-cpu.yaml")
    assert resolved["build"]["backend"] == "embedded" and resolved["build"]["device"] == "cpu"
    assert resolved["convert"]["tp"] == 1
    fixture = REPO_ROOT / resolved["model"]
    require_fixture(fixture)
    hf = json.loads((fixture / "config.json").read_text())
    ck = SimpleNamespace(dtype=resolved["convert"]["dtype"], seq_len_limit=hf["max_position_embeddings"],
                         max_position_embeddings=hf["max_position_embeddings"])
    resolve_limits(resolved["build"], ck, "embedded")


# ---- mistakes name the key and what is allowed ----------------------------------------------------

def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def error_of(tmp_path, text: str) -> str:
    with pytest.raises(ConfigError) as ei:
        cfgmod.load_yaml(write(tmp_path, text))
    return ei.value.render()


def test_unknown_section_lists_sections(tmp_path):
    msg = error_of(tmp_path, "convrt:\n  tp: 2\n")
    assert "unknown section 'convrt'" in msg
    assert "allowed: model, convert, quantize, build" in msg


def test_unknown_key_names_key_and_lists_keys(tmp_path):
    msg = error_of(tmp_path, "convert:\n  tp: 2\n  moe_ep_size: 2\n")
    assert "unknown key convert.moe_ep_size" in msg
    for k in cfgmod.SCHEMA["convert"]:
        assert k in msg
    msg = error_of(tmp_path, "build:\n  max_batch: 8\n")
    assert "unknown key build.max_batch" in msg and "max_batch_size" in msg


@pytest.mark.parametrize("text, parts", [
    ("convert:\n  dtype: fp8\n", ["convert.dtype", "'fp8' is not allowed", "auto, float32, float16, bfloat16"]),
    ("build:\n  backend: vllm\n", ["build.backend", "'vllm'", "embedded, tensorrt-llm"]),
    ("quantize:\n  policy: best\n", ["quantize.policy", "'best'", "graded", "frequency-bytes"]),
    ("quantize:\n  formats: [int8, int3]\n", ["quantize.formats", "'int3'", "int4_g128"]),
    ("convert:\n  tp: two\n", ["convert.tp", "must be int", "'two'"]),
    ("convert:\n  tp: 0\n", ["convert.tp", "below the minimum 1"]),
    ("convert:\n  tp: true\n", ["convert.tp", "must be int"]),
    ("build:\n  max_beam_width: 9\n", ["build.max_beam_width", "above the maximum 8"]),
    ("quantize:\n  budget_bpw: 64\n", ["quantize.budget_bpw", "above the maximum 32"]),
    ("build:\n  context_fmha: yes please\n", ["build.context_fmha", "must be bool"]),
    ("convert:\n  tp:\n", ["convert.tp", "must not be null"]),
    ("- tp: 2\n", ["top level must be a mapping"]),
    ("convert: [1, 2]\n", ["section 'convert' must be a mapping"]),
    ("convert:\n  tp: [2\n", ["not valid YAML"]),
])
def test_bad_values_name_key_and_allowed_values(tmp_path, text, parts):
    msg = error_of(tmp_path, text)
    for part in parts:
        assert part in msg, (part, msg)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        cfgmod.load_yaml(tmp_path / "nope.yaml")


# ---- precedence -----------------------------------------------------------------------------------

def test_resolve_precedence_cli_over_yaml_over_defaults(tmp_path):
    p = write(tmp_path, "convert:\n  tp: 4\n  moe_ep: 2\n  dtype: bfloat16\nbuild:\n  max_batch_size: 16\n")
    d = cfgmod.defaults()
    r = cfgmod.resolve(p, {"convert": {"tp": 2, "moe_ep": None, "dtype": None}, "build": {"max_batch_size": 3}})
    assert r["convert"]["tp"] == 2  # CLI beats YAML
    assert r["convert"]["moe_ep"] == 2 and r["convert"]["dtype"] == "bfloat16"  # YAML where CLI is silent
    assert r["build"]["max_batch_size"] == 3
    assert r["convert"]["pp"] == d["convert"]["pp"] == 1  # defaults where neither speaks
    assert r["build"]["max_input_len"] == d["build"]["max_input_len"]
    assert cfgmod.resolve(None, None) == d
    assert cfgmod.resolve(p)["convert"]["tp"] == 4


def test_resolve_checks_cli_values_too(tmp_path):
    with pytest.raises(ConfigError, match="--tp = 0 is below the minimum 1"):
        cfgmod.resolve(None, {"convert": {"tp": 0}})


@pytest.mark.parametrize("command, sections", [
    ("convert", ("convert", "quantize")), ("build", ("build",)), ("repo", ("repo",)), ("serve", ("serve",)),
    ("calibrate", ("calibrate",))])
def test_every_schema_key_is_an_option_of_its_command(command, sections):
    """Each stage's YAML keys are its command's options, with the schema's choices, and the option
    a user passes lands in the section `resolve` reads."""
    from trtmoe.cli import main

    params = {p.name: p for p in main.commands[command].params}
    for sec in sections:
        for name, key in cfgmod.SCHEMA[sec].items():
            assert name in params, f"`trtmoe {command}` has no option for {sec}.{name}"
            p = params[name]
            if key.type is bool:
                assert p.secondary_opts, (command, name)
            elif key.choices is not None and key.type is str:
                assert isinstance(p.type, click.Choice) and tuple(p.type.choices) == key.choices, (command, name)
            assert p.default is None, f"{command} --{name} has a default of its own; the schema's must apply"
    routed = cfgmod.from_cli({k: 1 for k in params}, *sections)
    for sec in sections:
        assert set(routed[sec]) == set(cfgmod.SCHEMA[sec]), sec


def test_convert_target_offers_the_build_backends():
    from trtmoe.cli import convert
    from trtmoe.targets import TARGETS, names

    # The build backends, then the unified-HF targets (no build step: the engines load the checkpoint).
    target = next(p for p in convert.params if p.name == "target")
    assert tuple(target.type.choices) == (*cfgmod.SCHEMA["build"]["backend"].choices, *names(unified=True))
    assert tuple(target.type.choices) == tuple(TARGETS)


def test_config_choices_are_the_registry_targets():
    """config.py sits below the targets registry (it names them for YAML validation): its lists are the
    targets with a build step and the targets calibration scores plans for."""
    from trtmoe.targets import TARGETS, names

    assert cfgmod.SCHEMA["build"]["backend"].choices == tuple(n for n, t in TARGETS.items() if t.build_backend == n)
    assert cfgmod.SCHEMA["calibrate"]["target"].choices == names(calibrates=True)


def test_format_choices_cover_the_format_registry():
    """Every quantized format the library implements can be chosen in YAML and on the CLI; the engine
    path's formats are calibrated by default."""
    from trtmoe.quant.calibrate import DEFAULT_FORMATS
    from trtmoe.quant.commands import DEFAULT_FORMATS as CLI_DEFAULT_FORMATS
    from trtmoe.quant.formats import FORMATS

    quantized = {n for n, f in FORMATS.items() if f.trtllm_quant_algo}
    assert {"int4_g64", "int4_g128"} <= quantized
    assert set(cfgmod.SCHEMA["quantize"]["format"].choices) == quantized
    assert quantized <= set(cfgmod.SCHEMA["quantize"]["formats"].choices)
    assert set(DEFAULT_FORMATS) == {n for n in quantized if FORMATS[n].engine_path}
    assert CLI_DEFAULT_FORMATS == DEFAULT_FORMATS


def test_convert_cli_records_precedence_in_manifest(tiny_model, tmp_path):
    p = write(tmp_path, "convert:\n  tp: 4\n  moe_ep: 2\n  dtype: bfloat16\n")
    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "trtmoe.cli", "convert", str(tiny_model("mixtral")), "-o", str(out),
                           "-c", str(p), "--tp", "2"], capture_output=True, text=True, env=ENV, cwd=REPO_ROOT,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    cv = manifest["resolved_config"]["convert"]
    assert (cv["tp"], cv["moe_ep"], cv["dtype"], cv["pp"]) == (2, 2, "bfloat16", 1)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    assert (cfg["mapping"]["tp_size"], cfg["mapping"]["moe_ep_size"], cfg["mapping"]["moe_tp_size"]) == (2, 2, 1)


def test_convert_cli_rejects_bad_yaml_with_exit_2(tiny_model, tmp_path):
    p = write(tmp_path, "convert:\n  tp: 2\n  moe_ep_sz: 2\n")
    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "trtmoe.cli", "convert", str(tiny_model("mixtral")), "-o", str(out),
                           "-c", str(p)], capture_output=True, text=True, env=ENV, cwd=REPO_ROOT, timeout=240)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "unknown key convert.moe_ep_sz" in lines[0] and "moe_ep" in lines[0]
    assert not out.exists()


def test_layout_error_is_not_a_config_error():
    # Layout problems surface as LayoutError (exit 2) from Mapping, not from the YAML schema.
    with pytest.raises(LayoutError, match=r"2 × 4 = 8 ≠ 4"):
        Mapping.create(4, 1, 2, 4)


def test_convert_never_replaces_a_calib_directory_named_in_yaml(tiny_model, tmp_path):
    """The calibration directory is one of convert's inputs wherever it was named (CLI or YAML), so
    `-o` pointing at it is refused and it is left as it was."""
    cal = tmp_path / "calib"
    cal.mkdir()
    (cal / "keep.txt").write_text("mine")
    p = write(tmp_path, f"quantize:\n  calib: {cal}\n")
    proc = subprocess.run([sys.executable, "-m", "trtmoe.cli", "convert", str(tiny_model("mixtral")), "-o", str(cal),
                           "-c", str(p), "--force"], capture_output=True, text=True, env=ENV, cwd=REPO_ROOT,
                          timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert "would replace one of this command's inputs" in proc.stderr
    assert sorted(x.name for x in cal.iterdir()) == ["keep.txt"] and (cal / "keep.txt").read_text() == "mine"


def test_calibrate_takes_its_options_from_yaml_and_the_command_line_overrides(tiny_model, tmp_path):
    from conftest import tokenized_tiny_mixtral

    model, text = tokenized_tiny_mixtral(tiny_model, tmp_path, "model")
    p = write(tmp_path, f"calibrate:\n  data: {text}\n  samples: 3\n  seq_len: 16\n  formats: [int8]\n")
    out = tmp_path / "calib"
    proc = subprocess.run([sys.executable, "-m", "trtmoe.cli", "calibrate", str(model), "-o", str(out), "-c", str(p),
                           "--samples", "2", "--json"], capture_output=True, text=True, env=ENV, cwd=REPO_ROOT,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    cal = json.loads((out / "calib.json").read_text())
    assert cal["formats"] == ["int8"]  # from YAML
    assert cal["data"]["samples"] == 2 and cal["data"]["seq_len"] == 16  # CLI over YAML; YAML over defaults
    assert Path(cal["data"]["path"]).resolve() == text.resolve()
    bad = write(tmp_path, "calibrate:\n  samples: 0\n")
    proc = subprocess.run([sys.executable, "-m", "trtmoe.cli", "calibrate", str(model), "-o", str(tmp_path / "c2"),
                           "-c", str(bad), "--data", str(text)], capture_output=True, text=True, env=ENV,
                          cwd=REPO_ROOT, timeout=240)
    assert proc.returncode == 2 and "calibrate.samples" in proc.stderr and "below the minimum 1" in proc.stderr


def test_convert_rounds_int4_as_the_calibration_measured_unless_told(tiny_model, tmp_path):
    from conftest import tokenized_tiny_mixtral

    model, text = tokenized_tiny_mixtral(tiny_model, tmp_path, "model")
    cal = tmp_path / "calib"
    run = dict(capture_output=True, text=True, env=ENV, cwd=REPO_ROOT, timeout=240)
    proc = subprocess.run([sys.executable, "-m", "trtmoe.cli", "calibrate", str(model), "--data", str(text), "-o",
                           str(cal), "--samples", "2", "--seq-len", "16", "--formats", "int8,int4",
                           "--rounding", "rtn"], **run)
    assert proc.returncode == 0, proc.stderr
    for extra, want in (([], "rtn"), (["--rounding", "awq"], "awq")):
        out = tmp_path / f"ck-{want}"
        proc = subprocess.run([sys.executable, "-m", "trtmoe.cli", "convert", str(model), "-o", str(out),
                               "--calib", str(cal), "--policy", "uniform", "--format", "int4", *extra], **run)
        assert proc.returncode == 0, proc.stderr
        m = json.loads((out / "manifest.json").read_text())
        assert m["quantization"]["rounding"] == want and m["resolved_config"]["quantize"]["rounding"] == want


def test_calibrate_gram_threshold_defaults_are_the_quantizers():
    from trtmoe.quant import awq

    c = cfgmod.SCHEMA["calibrate"]
    assert (c["max_gram_in"].default, c["max_input_tokens"].default) == (awq.MAX_GRAM_IN, awq.MAX_INPUT_TOKENS)
    assert c["rounding"].default == awq.DEFAULT_ROUNDING == "awq_gptq"


def test_calibrate_max_gram_in_from_the_command_line(tiny_model, tmp_path):
    """Every calibration stores the MoE layers' input rows (capped by ``--max-input-tokens``), which
    the activation statistics are rebuilt from; the default stores no Gram matrix and
    ``--max-gram-in 1024`` stores the tiny model's Gram matrices as well."""
    from conftest import tokenized_tiny_mixtral
    from safetensors import safe_open

    from trtmoe.quant import awq

    model, text = tokenized_tiny_mixtral(tiny_model, tmp_path, "model")
    run = dict(capture_output=True, text=True, env=ENV, cwd=REPO_ROOT, timeout=240)
    base = [sys.executable, "-m", "trtmoe.cli", "calibrate", str(model), "--data", str(text), "--samples", "2",
            "--seq-len", "16", "--formats", "int4", "--rounding", "gptq"]
    for name, extra in (("rows", ["--max-input-tokens", "20"]), ("gram", ["--max-gram-in", "1024"])):
        proc = subprocess.run([*base, "-o", str(tmp_path / name), *extra], **run)
        assert proc.returncode == 0, proc.stderr
    rows = sorted((tmp_path / "rows" / awq.INPUTS_DIR).glob("*.safetensors"))
    assert rows and sorted((tmp_path / "gram" / awq.INPUTS_DIR).glob("*.safetensors"))
    with safe_open(str(rows[0]), "pt") as f:
        assert max(f.get_slice(k).get_shape()[0] for k in f.keys()) == 20
    a, b = (json.loads((tmp_path / n / "calib.json").read_text())["activations"] for n in ("rows", "gram"))
    assert a["gram_from_inputs"] == b["gram_matrices"] and "gram_matrices" not in a and "gram_from_inputs" not in b
    assert a["rows_from_inputs"] == b["rows_from_inputs"] == a["matrices"]
    assert a["inputs"]["max_rows_per_layer"] == 20 and b["inputs"]["max_rows_per_layer"] == 32768
    proc = subprocess.run([*base, "-o", str(tmp_path / "bad"), "--max-input-tokens", "0"], **run)
    assert proc.returncode == 2 and "--max-input-tokens = 0 is below the minimum 1" in proc.stderr
