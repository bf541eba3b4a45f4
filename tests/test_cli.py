"""The ``trtmoe`` command line as a user meets it: help with examples, ``inspect`` numbers checked
against an independent count, exit codes, and tracebacks only with ``--debug``.

Commands run as real subprocesses; independent ones run concurrently (each pays the torch import).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import pytest
from safetensors import safe_open

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v1")


def run_cli(args, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trtmoe.cli", *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=REPO_ROOT, timeout=timeout)


def run_many(arg_lists: list[list]) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(run_cli, arg_lists))


def all_commands() -> list[tuple[str, ...]]:
    """Every command path, subcommands of groups included."""
    from trtmoe.cli import main

    out = []

    def walk(group: click.Group, prefix: tuple[str, ...]):
        for name, cmd in sorted(group.commands.items()):
            out.append(prefix + (name,))
            if isinstance(cmd, click.Group):
                walk(cmd, prefix + (name,))

    walk(main, ())
    return out


# ---- help --------------------------------------------------------------------------------------------

def test_every_help_has_an_example():
    cmds = all_commands()
    assert {("inspect",), ("convert",), ("verify",), ("run",)} <= set(cmds)
    procs = run_many([[*c, "--help"] for c in cmds] + [["--help"]])
    for cmd, proc in zip(cmds + [()], procs):
        where = "trtmoe " + " ".join(cmd)
        assert proc.returncode == 0, (where, proc.stderr)
        # An example is a runnable line of this very command, shown in the help text.
        invocation = " ".join(("trtmoe", *cmd))
        examples = [l.strip() for l in proc.stdout.splitlines() if l.strip().startswith(invocation + " ")]
        assert examples, f"`{where} --help` shows no example starting with `{invocation} `:\n{proc.stdout}"
        assert "Traceback" not in proc.stderr


# ---- inspect: the numbers against an independent count ------------------------------------------------

def hf_total_params(model_dir: Path, arch: str) -> int:
    """Total parameters as the model itself counts them: transformers' ``named_parameters()``
    (a tied lm_head counted once); DeepSeek-V1 has no transformers class, so its stored tensors."""
    if arch == "deepseek_v1":
        n = 0
        for f in model_dir.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as fh:
                n += sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
        return n
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    return sum(p.numel() for _, p in model.named_parameters())


def active_per_token(cfg: dict, arch: str) -> int:
    """Parameters one token's forward pass multiplies with, from the HF config alone: one embedding
    row; per layer both norms, all of attention (+ q/k/v biases, + q/k norms), and either the router,
    top_k routed experts, the shared expert(s) and their gate, or the dense MLP; the final norm; the
    whole lm_head (every logit is computed)."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    k = cfg["num_experts_per_tok"]
    if arch == "mixtral":
        E, I = cfg["num_local_experts"], cfg["intermediate_size"]
    elif arch == "deepseek_v1":
        E, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    else:
        E, I = cfg.get("num_experts") or cfg["num_local_experts"], cfg["moe_intermediate_size"]
    shared = {"qwen2_moe": cfg.get("shared_expert_intermediate_size", 0),
              "deepseek_v1": cfg.get("n_shared_experts", 0) * cfg.get("moe_intermediate_size", 0)}.get(arch, 0)

    def is_moe(l):
        if arch == "mixtral":
            return True
        if arch == "deepseek_v1":
            return l >= cfg["first_k_dense_replace"] and l % cfg["moe_layer_freq"] == 0
        return l not in (cfg.get("mlp_only_layers") or []) and (l + 1) % cfg.get("decoder_sparse_step", 1) == 0

    n = H + H + V * H  # embedding row, final norm, lm_head
    for l in range(L):
        n += 2 * H
        n += H * nh * hd + 2 * H * nkv * hd + nh * hd * H
        if arch == "qwen2_moe":
            n += nh * hd + 2 * nkv * hd
        if arch == "qwen3_moe":
            n += 2 * hd
        if is_moe(l):
            n += E * H + k * 3 * H * I + 3 * H * shared + (H if arch == "qwen2_moe" else 0)
        else:
            n += 3 * H * cfg["intermediate_size"]
    return n


def fmt_count(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


@pytest.fixture(scope="module")
def inspect_runs(tiny_model):
    models = {a: tiny_model(a) for a in ARCHS}
    args = [["inspect", models[a], "--json"] for a in ARCHS] + [
        ["inspect", models["qwen2_moe"], "--tp", 2, "--moe-ep", 2],
        ["inspect", models["mixtral"], "--tp", 3],
        ["inspect", models["mixtral"], "--tp", 4, "--moe-tp", 2, "--moe-ep", 4, "--json"],
    ]
    procs = run_many(args)
    return models, dict(zip(ARCHS, procs[:4])), procs[4], procs[5], procs[6]


@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_json_matches_independent_count(inspect_runs, arch):
    models, json_runs, *_ = inspect_runs
    proc = json_runs[arch]
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    cfg = json.loads((models[arch] / "config.json").read_text())
    p = rep["parameters"]
    assert p["total"] == hf_total_params(models[arch], arch)
    assert p["active_per_token"] == active_per_token(cfg, arch)
    assert p["active_share"] == pytest.approx(p["active_per_token"] / p["total"])
    assert sum(c["total"] for c in p["components"].values()) == p["total"]
    assert rep["layout"]["ok"] is True
    # Bytes per rank at tp=1 = every parameter once, in the source dtype (fp32 fixtures).
    assert rep["ranks"][0]["bytes"] == 4 * p["total"]


def test_inspect_human_output_shows_totals_and_share(inspect_runs):
    models, json_runs, human, *_ = inspect_runs
    assert human.returncode == 0, human.stderr
    rep = json.loads(json_runs["qwen2_moe"].stdout)
    total, active = rep["parameters"]["total"], rep["parameters"]["active_per_token"]
    text = " ".join(human.stdout.split())
    assert f"A token touches {fmt_count(active)} of {fmt_count(total)} parameters = {100 * active / total:.2f}%" \
        in text, human.stdout
    assert "Weights per rank" in text and "layout checks: ok" in text
    assert "4–7" in text  # rank 1 holds the second expert block


def test_inspect_bad_layout_exits_2_with_numbers(inspect_runs):
    *_, bad, bad_json = inspect_runs
    assert bad.returncode == 2
    assert "num_attention_heads=4 is not divisible by tp=3" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert bad_json.returncode == 2
    lay = json.loads(bad_json.stdout)["layout"]
    assert lay["ok"] is False
    assert any("2 × 4 = 8 ≠ 4" in p for p in lay["problems"]), lay["problems"]


def test_inspect_reads_a_build_config_and_shows_checkpoint_and_engine_bytes(tmp_path):
    """``-c`` sets the layout as convert reads it (options override it); a weight-only per-channel format
    shows the engine's bytes and the checkpoint file's (float experts) apart, the latter equal to what
    convert writes; a group-wise format's are the same."""
    from click.testing import CliRunner

    from trtmoe.checkpoint.writer import convert
    from trtmoe.cli import main
    from trtmoe.quant.plan import uniform_plan
    from trtmoe.hf.reader import HFCheckpoint

    fx = Path(__file__).parent / "fixtures" / "trained_mixtral"
    y = tmp_path / "cfg.yaml"
    y.write_text("convert:\n  tp: 2\n  moe_ep: 2\n")

    def inspect(*args):
        r = CliRunner().invoke(main, ["inspect", str(fx), "--json", *map(str, args)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    rep = inspect("-c", y, "--format", "int8")
    assert (rep["layout"]["tp"], rep["layout"]["moe_ep"], rep["layout"]["moe_tp"]) == (2, 2, 1)
    assert inspect("-c", y, "--moe-ep", 1)["layout"]["moe_tp"] == 2  # the option wins
    with HFCheckpoint(fx) as src:
        m = src.model
    ck = convert(fx, tmp_path / "ck", tp=2, moe_ep=2, quant=uniform_plan(m, "int8")).out_dir
    for r in rep["ranks"]:
        assert r["checkpoint_bytes"] > r["bytes"]
        f = ck / f"rank{r['rank']}.safetensors"
        header = 8 + int.from_bytes(f.read_bytes()[:8], "little")
        assert r["checkpoint_bytes"] == f.stat().st_size - header
    g = inspect("-c", y, "--format", "int4_g128")
    assert all(r["checkpoint_bytes"] == r["bytes"] for r in g["ranks"])
    text = " ".join(CliRunner().invoke(main, ["inspect", str(fx), "--format", "int8"]).stdout.split())
    assert "ckpt file" in text and "engine" in text


# ---- errors and --debug --------------------------------------------------------------------------------

def test_debug_shows_traceback_only_when_asked(tmp_path):
    missing = tmp_path / "no-such-model"
    plain, debug = run_many([["convert", missing, "-o", tmp_path / "out"],
                             ["--debug", "convert", missing, "-o", tmp_path / "out"]])
    for proc in (plain, debug):
        assert proc.returncode == 2
        assert f"error: {missing}: no such directory" in proc.stderr
    assert "Traceback" not in plain.stderr
    assert len([l for l in plain.stderr.splitlines() if l.strip()]) == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert "resolve_model_path" in debug.stderr  # the frame that raised
    assert not (tmp_path / "out").exists()


def test_version_and_console_script():
    import shutil

    proc = run_cli(["--version"])
    assert proc.returncode == 0 and "trtmoe" in proc.stdout
    exe = shutil.which("trtmoe")
    if exe is None:
        pytest.skip("the trtmoe console script is not on PATH (package not installed)")
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0 and proc.stdout == run_cli(["--version"]).stdout
