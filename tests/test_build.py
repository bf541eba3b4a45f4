"""``trtmoe build``: the exact trtllm-build command, every preflight refusal, the ``--dry-run``
memory estimate against a hand computation, and the embedded engine directory round trip.

TensorRT-LLM, a GPU and ``nvidia-smi`` do not exist on the CPU machines these tests run on. The
"missing TensorRT-LLM" and "no GPU" errors are therefore tested for real. The paths behind them
(wrong TensorRT-LLM release, too few GPUs, a failing ``import tensorrt_llm``, running
``trtllm-build`` and recording its engine) are tested with small stand-ins for those three external
NVIDIA programs, placed on PATH / PYTHONPATH of a ``trtmoe`` subprocess; everything of ours runs for
real. The real ``trtllm-build`` run is ``scripts/gpu_smoke.sh`` on a GPU host.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from trtmoe.build.estimate import KV_FORMULA, estimate_memory
from trtmoe.build.preflight import (GpuInfo, check_gpus, read_checkpoint, resolve_limits,
                                    version_matches, visible_gpu_count)
from trtmoe.build.tensorrt_llm import plan_tensorrt_llm, trtllm_build_argv
from trtmoe.checkpoint.writer import convert
from trtmoe.cli import main
from trtmoe.config import defaults, resolve
from trtmoe.errors import BackendUnavailable, ConfigError, InputError
from trtmoe.hf.reader import HFCheckpoint
from trtmoe.hf.safetensors_io import SafetensorsFile
from trtmoe.quant.plan import QuantPlan, uniform_plan
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams
from trtmoe.runtime.load import load_engine

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None

# The tiny Mixtral fixture's shapes (scripts/make_tiny_models.py): what the hand computations use.
H, I, E, L, NKV, HD, MPE = 64, 48, 4, 3, 2, 16, 256


def cli(args: list) -> Result:
    """Run the real CLI in this process (fast: no torch import per call)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def cli_proc(args: list, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real CLI as a subprocess (needed where PATH / PYTHONPATH differ)."""
    return subprocess.run([sys.executable, "-m", "trtmoe.cli", *map(str, args)], capture_output=True, text=True,
                          env=env or ENV, cwd=REPO_ROOT, timeout=timeout)


def one_line(text: str) -> str:
    lines = [l for l in text.splitlines() if l.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# ---- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral_hf(tiny_model):
    return tiny_model("mixtral")


@pytest.fixture(scope="module")
def ckpt_fp16(mixtral_hf, tmp_path_factory):
    """tp=2 with moe_ep=2 (world size 2), float16."""
    return convert(mixtral_hf, tmp_path_factory.mktemp("ck") / "fp16", tp=2, moe_ep=2, dtype="float16").out_dir


@pytest.fixture(scope="module")
def ckpt_fp32(mixtral_hf, tmp_path_factory):
    return convert(mixtral_hf, tmp_path_factory.mktemp("ck") / "fp32", tp=2, moe_ep=2, dtype="float32").out_dir


def _quantized(hf, out, plan_of, **kw):
    with HFCheckpoint(hf) as src:
        plan = plan_of(src.model)
    return convert(hf, out, quant=plan, **kw).out_dir


@pytest.fixture(scope="module")
def ckpt_w8(mixtral_hf, tmp_path_factory):
    """Layer-uniform int8: quant_algo W8A16 with float expert weights that trtllm-build quantizes."""
    return _quantized(mixtral_hf, tmp_path_factory.mktemp("ck") / "w8", lambda m: uniform_plan(m, "int8", "layer"),
                      tp=2, moe_ep=2, dtype="float16")


@pytest.fixture(scope="module")
def ckpt_w4(mixtral_hf, tmp_path_factory):
    return _quantized(mixtral_hf, tmp_path_factory.mktemp("ck") / "w4", lambda m: uniform_plan(m, "int4", "layer"),
                      tp=1, dtype="float16")


@pytest.fixture(scope="module")
def ckpt_per_expert(mixtral_hf, tmp_path_factory):
    def plan(m):
        fmts = ["int8", "float", "int4", "float"]
        return QuantPlan({l: fmts for l in range(m.num_layers) if m.moe_layers[l]}, granularity="expert")
    return _quantized(mixtral_hf, tmp_path_factory.mktemp("ck") / "pe", plan, tp=1, dtype="float16")


@pytest.fixture(scope="module")
def ckpt_per_matrix(mixtral_hf, tmp_path_factory):
    """Per-matrix formats: an expert's fc and proj differ (same per-expert tensor layout)."""
    def plan(m):
        layers = [l for l in range(m.num_layers) if m.moe_layers[l]]
        return QuantPlan({l: ["int8", "float", "int4", "int4"] for l in layers}, granularity="matrix",
                         proj_formats={l: ["int4", "int8", "float", "int4"] for l in layers})
    return _quantized(mixtral_hf, tmp_path_factory.mktemp("ck") / "pm", plan, tp=1, dtype="float16")


def build_yaml(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "build.yaml"
    p.write_text(textwrap.dedent(body))
    return p


# ---- command construction --------------------------------------------------------------------------
YAML = """\
    build:
      backend: tensorrt-llm
      max_batch_size: 3
      max_input_len: 100
      max_seq_len: 200
      max_num_tokens: 512
      tokens_per_block: 64
      gemm_plugin: float16
      gpt_attention_plugin: auto
      moe_plugin: float16
      context_fmha: true
      use_paged_context_fmha: false
      remove_input_padding: true
      workers: 2
    """


def expected_argv(ck: Path, out: Path, max_batch_size: int = 3) -> list[str]:
    return ["trtllm-build", "--checkpoint_dir", str(ck.absolute()), "--output_dir", str(out.absolute()),
            "--gemm_plugin", "float16", "--gpt_attention_plugin", "auto", "--moe_plugin", "float16",
            "--max_batch_size", str(max_batch_size), "--max_input_len", "100", "--max_seq_len", "200",
            "--max_num_tokens", "512", "--max_beam_width", "1", "--kv_cache_type", "paged",
            "--tokens_per_block", "64", "--context_fmha", "enable", "--use_paged_context_fmha", "disable",
            "--remove_input_padding", "enable", "--workers", "2", "--log_level", "info"]


def test_command_for_a_yaml_is_exact(ckpt_fp16, tmp_path):
    y = build_yaml(tmp_path, YAML)
    out = tmp_path / "engine"
    plan = plan_tensorrt_llm(ckpt_fp16, out, resolve(y)["build"])
    assert plan.argv == expected_argv(ckpt_fp16, out)
    # Through the CLI, without a GPU or TensorRT-LLM, and CLI > YAML.
    r = cli(["build", ckpt_fp16, "-o", out, "-c", y, "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["command"] == expected_argv(ckpt_fp16, out)
    r = cli(["build", ckpt_fp16, "-o", out, "-c", y, "--dry-run", "--json", "--max-batch-size", "5"])
    assert json.loads(r.stdout)["command"] == expected_argv(ckpt_fp16, out, max_batch_size=5)
    assert not out.exists()


def test_gather_flags_reach_trtllm_build_only_when_set(ckpt_fp16, tmp_path):
    y = build_yaml(tmp_path, YAML)
    out = tmp_path / "engine"
    r = cli(["build", ckpt_fp16, "-o", out, "-c", y, "--dry-run", "--json", "--gather-context-logits",
             "--gather-generation-logits"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["command"] == [*expected_argv(ckpt_fp16, out), "--gather_context_logits",
                                               "--gather_generation_logits"]
    r = cli(["build", ckpt_fp16, "-o", out, "-c", y, "--dry-run", "--json", "--gather-generation-logits"])
    assert json.loads(r.stdout)["command"] == [*expected_argv(ckpt_fp16, out), "--gather_generation_logits"]


def test_defaults_fill_max_seq_len_from_the_model(ckpt_fp16, tmp_path):
    b = defaults()["build"] | {"max_input_len": 64}
    argv = plan_tensorrt_llm(ckpt_fp16, tmp_path / "e", b).argv
    assert argv[argv.index("--max_seq_len") + 1] == str(MPE)
    # Every setting is explicit, so the engine never depends on the installed release's defaults.
    for flag in ("--gemm_plugin", "--gpt_attention_plugin", "--moe_plugin", "--kv_cache_type", "--tokens_per_block",
                 "--context_fmha", "--use_paged_context_fmha", "--remove_input_padding", "--max_num_tokens",
                 "--max_beam_width", "--workers"):
        assert flag in argv
    assert not any(f in argv for f in ("--tp_size", "--moe_ep_size", "--pp_size"))  # parallelism: the mapping


def test_default_limits_fit_a_short_model(ckpt_fp16, tmp_path):
    """Nothing given: the defaults agree with each other on a model of MPE (256) positions, for both
    backends (max_input_len half of max_seq_len there, 1024 where the model is long enough)."""
    argv = plan_tensorrt_llm(ckpt_fp16, tmp_path / "e", defaults()["build"]).argv
    assert argv[argv.index("--max_seq_len") + 1] == str(MPE)
    assert argv[argv.index("--max_input_len") + 1] == str(MPE // 2)
    r = CliRunner().invoke(main, ["build", str(ckpt_fp16), "-o", str(tmp_path / "emb"), "--backend", "embedded"])
    assert r.exit_code == 0, r.output
    bc = json.loads((tmp_path / "emb" / "config.json").read_text())["build_config"]
    assert (bc["max_input_len"], bc["max_seq_len"]) == (MPE // 2, MPE)
    facts = read_checkpoint(ckpt_fp16)
    long = replace(facts, seq_len_limit=32768)
    assert resolve_limits(defaults()["build"], long, "embedded").build["max_input_len"] == 1024


def test_help_has_examples():
    r = cli(["build", "--help"])
    assert r.exit_code == 0
    assert "Examples:" in r.output and "--dry-run" in r.output and "tensorrt-llm" in r.output


# ---- dry-run estimate ------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture,bits,tp", [("ckpt_fp16", None, 2), ("ckpt_w8", 8, 2), ("ckpt_w4", 4, 1)])
def test_dry_run_estimate_equals_hand_computation(request, fixture, bits, tp, tmp_path):
    ck = request.getfixturevalue(fixture)
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == {None: None, 8: "W8A16", 4: "W4A16"}[bits]
    r = cli(["build", ck, "-o", tmp_path / "e", "--backend", "tensorrt-llm", "--dry-run", "--json",
             "--max-batch-size", 3, "--max-input-len", 100, "--max-seq-len", 200, "--tokens-per-block", 64])
    assert r.exit_code == 0, r.output
    est = json.loads(r.stdout)["estimate"]
    e_loc = E // tp  # moe_ep = tp here
    for rank in range(tp):
        f = ck / f"rank{rank}.safetensors"
        want = f.stat().st_size
        if bits:
            # Float expert fc [E_loc, 2I, H] and proj [E_loc, H, I] per layer, stored as fp16, become
            # bits-wide integers plus one fp16 scale per output row and expert.
            with SafetensorsFile(f) as sf:
                assert sf.tensors["transformer.layers.0.mlp.fc.weight"].dtype == torch.float16
            fc, proj = e_loc * 2 * I * H, e_loc * H * I
            want += L * ((fc + proj) * bits // 8 + (e_loc * 2 * I + e_loc * H) * 2 - (fc + proj) * 2)
        got = est["ranks"][rank]
        assert got["file_bytes"] == f.stat().st_size
        assert got["weight_bytes"] == want
        assert sorted(got["quantized_by_build"]) == (sorted(f"transformer.layers.{l}.mlp.{m}.weight"
                                                            for l in range(L) for m in ("fc", "proj"))
                                                     if bits else [])
        # 2 × layers × KV heads per rank × head size × 2 bytes × batch 3 × (200 tokens → 4 blocks of 64)
        assert got["kv_bytes"] == 2 * L * (NKV // tp) * HD * 2 * 3 * 256
    assert est["formula"] == KV_FORMULA and est["kv_tokens_per_sequence"] == 256
    r = cli(["build", ck, "-o", tmp_path / "e", "--backend", "tensorrt-llm", "--dry-run", "--max-input-len", 100])
    assert "ESTIMATE" in r.stdout and "ceil(max_seq_len / tokens_per_block)" in r.stdout
    assert "trtllm-build --checkpoint_dir" in r.stdout and not (tmp_path / "e").exists()


def test_pipeline_parallel_estimate_counts_each_ranks_layers(mixtral_hf, tmp_path):
    ck = convert(mixtral_hf, tmp_path / "pp", tp=1, pp=2, dtype="float16").out_dir
    facts = read_checkpoint(ck)
    b = resolve_limits(defaults()["build"] | {"max_input_len": 10, "max_seq_len": 33, "max_batch_size": 1,
                                              "tokens_per_block": 32}, facts, "tensorrt-llm").build
    est = estimate_memory(facts, b, "tensorrt-llm")
    # 3 layers over 2 stages: the first stage takes the extra layer; 33 tokens need 2 blocks of 32.
    assert [r.layers for r in est.ranks] == [2, 1]
    assert [r.kv_bytes for r in est.ranks] == [2 * n * NKV * HD * 2 * 1 * 64 for n in (2, 1)]
    # Every beam of a request keeps a cache of its own: max_beam_width 3 triples it, on both backends.
    b3 = resolve_limits(b | {"max_beam_width": 3}, facts, "tensorrt-llm").build
    assert [r.kv_bytes for r in estimate_memory(facts, b3, "tensorrt-llm").ranks] == [3 * 2 * n * NKV * HD * 2 * 64
                                                                                      for n in (2, 1)]
    one, three = (estimate_memory(facts, resolve_limits(b | {"max_beam_width": w}, facts, "embedded").build, "embedded")
                  for w in (1, 3))
    assert three.ranks[0].kv_bytes == 3 * one.ranks[0].kv_bytes > 0
    assert "max_beam_width" in three.formula


# ---- preflight refusals ----------------------------------------------------------------------------
@pytest.mark.skipif(HAVE_TRTLLM, reason="TensorRT-LLM is installed here; this checks the message for its absence")
def test_missing_tensorrt_llm_is_one_clear_line_exit_1(ckpt_fp16, tmp_path):
    out = tmp_path / "engine"
    r = cli(["build", ckpt_fp16, "-o", out, "--backend", "tensorrt-llm", "--max-input-len", 100])
    assert r.exit_code == 1
    line = one_line(r.stderr)
    assert "TensorRT-LLM is not installed" in line and "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3" in line
    assert "tensorrt_llm==1.2.1" in line
    assert not out.exists() and not list(tmp_path.glob(".engine*"))


@pytest.mark.parametrize("which,gran", [("ckpt_per_expert", "expert"), ("ckpt_per_matrix", "matrix")])
def test_per_expert_checkpoint_refused_with_layer_granularity_hint(request, tmp_path, which, gran):
    ck = request.getfixturevalue(which)
    qc = json.loads((ck / "quant_cfg.json").read_text())
    assert qc["trtmoe_granularity"] == "trtmoe-per-expert"
    for extra in ([], ["--dry-run"]):
        r = cli(["build", ck, "-o", tmp_path / "e", "--backend", "tensorrt-llm",
                 "--max-input-len", 100, *extra])
        assert r.exit_code == 2
        line = one_line(r.stderr)
        assert "per expert" in line and "layer granularity" in line and "--target tensorrt-llm" in line
        assert f"granularity '{gran}'" in line
    # The embedded engine runs it.
    r = cli(["build", ck, "-o", tmp_path / "e", "--backend", "embedded", "--max-input-len", 100])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("arch,overrides,dense,ok", [
    ("qwen2_moe", {}, [2], False),  # the fixture's mlp_only_layers = [2]
    ("qwen3_moe", {}, [], True),
    ("deepseek_v1", {}, [0], True),  # first_k_dense_replace = 1: exactly what TensorRT-LLM hard-codes
    ("deepseek_v1", {"first_k_dense_replace": 2}, [0, 1], False),
])
def test_dense_layer_rules(tiny_model, tmp_path, arch, overrides, dense, ok):
    ck = convert(tiny_model(arch, **overrides), tmp_path / "ck", dtype="float16").out_dir
    assert read_checkpoint(ck).dense_layers == dense
    r = cli(["build", ck, "-o", tmp_path / "e", "--backend", "tensorrt-llm", "--dry-run", "--max-input-len", 100])
    if ok:
        assert r.exit_code == 0, r.output
        return
    assert r.exit_code == 2
    line = one_line(r.stderr)
    assert f"dense layers {dense}" in line and "--backend embedded" in line
    assert ("mlp_only_layers" in line) if arch.startswith("qwen") else ("exactly layer 0" in line)


def test_byte_flip_fails_verification_before_any_write(ckpt_fp16, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(ckpt_fp16, ck)
    f = ck / "rank1.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # one bit inside the last tensor's bytes: the header still parses
    f.write_bytes(bytes(data))
    for backend in ("tensorrt-llm", "embedded"):
        out = tmp_path / f"engine-{backend}"
        args = ["build", ck, "-o", out, "--backend", backend, "--max-input-len", 100]
        r = cli(args + (["--dry-run"] if backend == "tensorrt-llm" else []))
        assert r.exit_code == 1, r.output
        line = one_line(r.stderr)
        assert "rank1.safetensors" in line and "sha256" in line
        assert not out.exists() and not list(tmp_path.glob(f".{out.name}*"))


def test_existing_output_refused_before_work(ckpt_fp16, tmp_path):
    out = tmp_path / "engine"
    out.mkdir()
    r = cli(["build", ckpt_fp16, "-o", out, "--backend", "embedded", "--max-input-len", 100])
    assert r.exit_code == 2 and "already exists" in r.stderr and "--force" in r.stderr


def test_an_engine_dir_is_not_a_checkpoint(ckpt_fp32, tmp_path):
    eng = tmp_path / "eng"
    assert cli(["build", ckpt_fp32, "-o", eng, "--max-input-len", 100]).exit_code == 0
    r = cli(["build", eng, "-o", tmp_path / "again", "--max-input-len", 100])
    assert r.exit_code == 2 and "engine directory, not a checkpoint" in r.stderr


# ---- contradictions, each named ----------------------------------------------------------------------
BOTH = ("embedded", "tensorrt-llm")


@pytest.mark.parametrize("args,named,backends", [
    (["--max-input-len", 128, "--max-seq-len", 128], ["max_input_len 128 ≥ max_seq_len 128"], BOTH),
    (["--max-input-len", 100, "--max-seq-len", 300], ["max_seq_len 300 exceeds the model's limit 256"], BOTH),
    (["--max-input-len", 300, "--max-seq-len", 300],
     ["max_seq_len 300 exceeds the model's limit 256", "max_input_len 300 ≥ max_seq_len 300"], BOTH),
    (["--max-input-len", 100, "--max-num-tokens", 50], ["max_num_tokens 50 < max_input_len 100"], ("embedded",)),
    (["--max-input-len", 100, "--max-num-tokens", 50, "--no-use-paged-context-fmha"],
     ["max_num_tokens 50 < max_input_len 100", "chunked context needs use_paged_context_fmha"], ("tensorrt-llm",)),
    (["--max-input-len", 100, "--max-beam-width", 9], ["--max-beam-width = 9 is above the maximum 8"], BOTH),
])
def test_contradictions_are_named(ckpt_fp16, tmp_path, args, named, backends):
    for backend in backends:
        r = cli(["build", ckpt_fp16, "-o", tmp_path / "e", "--backend", backend, "--dry-run", *args])
        assert r.exit_code == 2, r.output
        line = one_line(r.stderr)
        for n in named:
            assert n in line, line


def test_beam_width_from_yaml_and_from_code_is_named(ckpt_fp16, tmp_path):
    y = build_yaml(tmp_path, "build:\n  max_beam_width: 9\n  max_input_len: 100\n")
    r = cli(["build", ckpt_fp16, "-o", tmp_path / "e", "-c", y, "--dry-run"])
    assert r.exit_code == 2 and "build.max_beam_width = 9 is above the maximum 8" in r.stderr
    # Settings built in code skip the YAML schema; the build's own check still names it.
    facts = read_checkpoint(ckpt_fp16)
    with pytest.raises(ConfigError, match="max_beam_width 9 is outside 1..8"):
        resolve_limits(defaults()["build"] | {"max_input_len": 100, "max_beam_width": 9}, facts, "embedded")
    # Beam search itself is built: a width of 4 passes both ways.
    resolve_limits(defaults()["build"] | {"max_input_len": 100, "max_beam_width": 4}, facts, "embedded")
    y = build_yaml(tmp_path, "build:\n  max_beam_width: 4\n  max_input_len: 100\n")
    assert cli(["build", ckpt_fp16, "-o", tmp_path / "e", "-c", y, "--dry-run"]).exit_code == 0


def test_tensorrt_llm_specific_contradictions(ckpt_fp16, tmp_path):
    base = ["build", ckpt_fp16, "-o", tmp_path / "e", "--backend", "tensorrt-llm", "--dry-run", "--max-input-len", 100]
    r = cli(base + ["--no-context-fmha"])
    assert r.exit_code == 2 and "use_paged_context_fmha needs context_fmha" in r.stderr
    r = cli(base + ["--kv-cache-type", "continuous"])
    assert r.exit_code == 2 and "use_paged_context_fmha needs kv_cache_type paged" in r.stderr
    r = cli(base + ["--gemm-plugin", "bfloat16"])
    assert r.exit_code == 2 and "gemm_plugin bfloat16 differs from the checkpoint dtype float16" in r.stderr
    # Chunked context (paged context FMHA) lets TensorRT-LLM take prompts longer than max_num_tokens.
    assert cli(base + ["--max-num-tokens", 64]).exit_code == 0


# ---- environment checks --------------------------------------------------------------------------------
SMI = """GPU 0: NVIDIA H200 (UUID: GPU-11111111-aaaa-bbbb-cccc-000000000000)
GPU 1: NVIDIA H200 (UUID: GPU-22222222-aaaa-bbbb-cccc-000000000000)
  MIG 3g.71gb     Device  0: (UUID: MIG-33333333-aaaa-bbbb-cccc-000000000000)
GPU 2: NVIDIA H200 (UUID: GPU-44444444-aaaa-bbbb-cccc-000000000000)
GPU 3: NVIDIA H200 (UUID: GPU-55555555-aaaa-bbbb-cccc-000000000000)
"""


@pytest.mark.parametrize("cvd,n", [(None, 4), ("", 0), ("0,2", 2), ("3", 1), ("1,7,2", 1), ("0,0", 1),
                                   ("GPU-4444", 1), ("GPU-44444444,0", 2), ("44444444,0", 0),
                                   ("MIG-3333", 1), ("GPU-9", 0), ("0,GPU-1111", 1), ("-1", 0), ("2,1,0,3", 4)])
def test_visible_gpus_follow_cuda_visible_devices(cvd, n):
    assert visible_gpu_count(SMI, cvd) == n


def test_gpu_count_check_messages():
    with pytest.raises(BackendUnavailable, match="no GPU visible"):
        check_gpus(1, GpuInfo(0, [], "nvidia-smi not found"))
    with pytest.raises(BackendUnavailable, match=r"world size 4 .* 2 GPU\(s\) are visible.*--allow-fewer-gpus"):
        check_gpus(4, GpuInfo(2, ["H200"] * 2, "nvidia-smi -L"))
    check_gpus(4, GpuInfo(1, ["H200"], "nvidia-smi -L"), allow_fewer=True)
    check_gpus(2, GpuInfo(2, ["H200"] * 2, "nvidia-smi -L"))


@pytest.mark.parametrize("installed,target,ok", [("1.2.1", "1.2", True), ("1.2.0rc2", "1.2", True),
                                                 ("1.2.1", "1.2.1", True), ("1.2.1", "1.2.0", False),
                                                 ("1.1.0", "1.2", False), ("1.20.0", "1.2", False)])
def test_version_matching(installed, target, ok):
    assert version_matches(installed, target) is ok


# ---- stand-ins for TensorRT-LLM, trtllm-build and nvidia-smi ------------------------------------------
STANDIN_BUILD = r'''#!{python}
"""Stand-in trtllm-build: writes the engine-dir layout of TensorRT-LLM 1.2 with dummy engines."""
import json, os, sys
a = sys.argv[1:]
opt = {{a[i][2:]: a[i + 1] for i in range(0, len(a) - 1, 2) if a[i].startswith("--")}}
print("[TensorRT-LLM] stand-in builder: argv", " ".join(a), flush=True)
if os.environ.get("STANDIN_FAIL"):
    print("[TensorRT-LLM][ERROR] stand-in failure", flush=True)
    sys.exit(3)
cfg = json.load(open(os.path.join(opt["checkpoint_dir"], "config.json")))
out = opt["output_dir"]
os.makedirs(out, exist_ok=True)
keys = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width")
json.dump({{"version": "1.2.1", "pretrained_config": cfg,
           "build_config": {{k: int(opt[k]) for k in keys}}}}, open(os.path.join(out, "config.json"), "w"))
for r in range(cfg["mapping"]["world_size"]):
    print(f"[TensorRT-LLM] building rank {{r}}", flush=True)
    open(os.path.join(out, f"rank{{r}}.engine"), "wb").write(bytes([r]) * 64)
'''
STANDIN_SMI = """#!/bin/sh
case "$1" in
  -L) i=0; while [ "$i" -lt "${STANDIN_GPUS:-0}" ]; do
        echo "GPU $i: NVIDIA Stand-in (UUID: GPU-0000000$i-0000-0000-0000-000000000000)"; i=$((i + 1)); done ;;
  *) echo "590.44.01" ;;
esac
"""


def standin_env(tmp_path: Path, *, version: str = "1.2.1", gpus: int | None = None, import_error: bool = False,
                build: bool = False) -> dict:
    root = tmp_path / "standin"
    pkg = root / "site" / "tensorrt_llm"
    pkg.mkdir(parents=True)
    pkg.joinpath("__init__.py").write_text(
        'raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")\n'
        if import_error else f'__version__ = "{version}"\n')
    dist = root / "site" / f"tensorrt_llm-{version}.dist-info"
    dist.mkdir()
    dist.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: {version}\n")
    path = [p for p in ENV["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()]
    bin_dir = root / "bin"
    bin_dir.mkdir()
    if gpus is not None:
        bin_dir.joinpath("nvidia-smi").write_text(STANDIN_SMI)
        bin_dir.joinpath("nvidia-smi").chmod(0o755)
    if build:
        bin_dir.joinpath("trtllm-build").write_text(STANDIN_BUILD.format(python=sys.executable))
        bin_dir.joinpath("trtllm-build").chmod(0o755)
    return {**ENV, "PATH": os.pathsep.join([str(bin_dir), *path]), "STANDIN_GPUS": str(gpus or 0),
            "PYTHONPATH": os.pathsep.join([str(root / "site"), str(REPO_ROOT)])}


def test_wrong_tensorrt_llm_release_refused(ckpt_fp16, tmp_path):
    env = standin_env(tmp_path, version="1.1.0", gpus=2)
    r = cli_proc(["build", ckpt_fp16, "-o", tmp_path / "e", "--backend", "tensorrt-llm", "--max-input-len", 100], env)
    assert r.returncode == 1, r.stderr
    line = one_line(r.stderr)
    assert "TensorRT-LLM 1.1.0 is installed but the checkpoint targets 1.2" in line


def test_too_few_gpus_refused(ckpt_fp16, tmp_path):
    args = ["build", ckpt_fp16, "-o", tmp_path / "e", "--backend", "tensorrt-llm", "--max-input-len", 100]
    r = cli_proc(args, standin_env(tmp_path / "none"))  # no nvidia-smi at all
    assert r.returncode == 1 and "no GPU visible (nvidia-smi not found)" in one_line(r.stderr)
    r = cli_proc(args, standin_env(tmp_path / "one", gpus=1))
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert "world size 2" in line and "1 GPU(s) are visible" in line and "--allow-fewer-gpus" in line
    env = standin_env(tmp_path / "masked", gpus=2)
    r = cli_proc(args, {**env, "CUDA_VISIBLE_DEVICES": "1"})
    assert r.returncode == 1 and "CUDA_VISIBLE_DEVICES='1'" in one_line(r.stderr)
    assert not (tmp_path / "e").exists()


def test_failing_import_is_reported_with_its_cause(ckpt_fp16, tmp_path):
    env = standin_env(tmp_path, gpus=2, import_error=True)
    r = cli_proc(["build", ckpt_fp16, "-o", tmp_path / "e", "--backend", "tensorrt-llm", "--max-input-len", 100], env)
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert "cannot be imported here: OSError: libcuda.so.1" in line and "--gpus all" in line


def test_build_run_writes_engine_dir_atomically_with_manifest(ckpt_fp16, tmp_path):
    env = standin_env(tmp_path, gpus=2, build=True)
    out = tmp_path / "engine"
    args = ["build", ckpt_fp16, "-o", out, "--backend", "tensorrt-llm", "--max-input-len", 100]
    r = cli_proc(args, env)
    assert r.returncode == 0, r.stderr
    assert "building rank 1" in r.stderr  # the builder's log is streamed
    assert sorted(p.name for p in out.iterdir()) == ["build.log", "config.json", "manifest.json", "rank0.engine",
                                                    "rank1.engine"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["kind"] == "trtllm-engine"
    b = defaults()["build"] | {"backend": "tensorrt-llm", "max_input_len": 100, "max_seq_len": MPE}
    assert m["command"] == trtllm_build_argv(ckpt_fp16, out, b)
    assert m["versions"]["tensorrt_llm"] == "1.2.1" and m["versions"]["driver"] == "590.44.01"
    assert m["versions"]["torch"] == torch.__version__
    assert m["source_checkpoint"]["manifest_sha256"] == hashlib.sha256(
        (ckpt_fp16 / "manifest.json").read_bytes()).hexdigest()
    assert m["build_config"]["max_seq_len"] == MPE and m["gpus"]["count"] == 2
    # The builder was pointed at a temporary sibling, not at the final directory.
    built_into = (out / "build.log").read_text().split("--output_dir ")[1].split()[0]
    assert built_into != str(out) and Path(built_into).parent == out.parent
    assert cli(["verify", out]).exit_code == 0
    # A failing builder leaves nothing behind.
    r = cli_proc([*args[:3], tmp_path / "engine2", *args[4:]], {**env, "STANDIN_FAIL": "1"})
    assert r.returncode == 1 and "trtllm-build failed with exit code 3" in r.stderr
    assert not (tmp_path / "engine2").exists() and not list(tmp_path.glob(".engine2*"))


# ---- embedded engine directory ---------------------------------------------------------------------------
PROMPTS = [[1, 5, 9, 33], [7, 7, 7], list(range(10, 40))]


def test_embedded_engine_records_its_cpu_matmul(ckpt_fp32, tmp_path):
    """--cpu-matmul is recorded in the engine dir and the loaded engine runs with it; an engine dir
    written before the key existed loads with the default."""
    eng = tmp_path / "engine"
    r = cli(["build", ckpt_fp32, "-o", eng, "--backend", "embedded", "--max-input-len", 64, "--cpu-matmul", "blas"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((eng / "config.json").read_text())
    assert cfg["build_config"]["cpu_matmul"] == "blas"
    assert load_engine(eng, "cpu").cpu_matmul == "blas"
    from trtmoe.triton.engine_dir import read_engine_dir  # what the served model loads by

    assert read_engine_dir(eng).cpu_matmul == "blas"
    del cfg["build_config"]["cpu_matmul"]
    (eng / "config.json").write_text(json.dumps(cfg))
    assert load_engine(eng, "cpu").cpu_matmul == "auto" and read_engine_dir(eng).cpu_matmul == "auto"
    cfg["build_config"]["cpu_matmul"] = "mkl"
    (eng / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="build_config.cpu_matmul is 'mkl'"):
        read_engine_dir(eng)
    r = cli(["build", ckpt_fp32, "-o", tmp_path / "e2", "--backend", "embedded", "--max-input-len", 64,
             "--cpu-matmul", "mkl"])
    assert r.exit_code == 2 and "mkl" in r.output and not (tmp_path / "e2").exists()


def test_embedded_round_trip(ckpt_fp32, tmp_path):
    eng = tmp_path / "engine"
    r = cli(["build", ckpt_fp32, "-o", eng, "--backend", "embedded", "--max-batch-size", 4, "--max-input-len", 64,
             "--max-seq-len", 128, "--tokens-per-block", 16, "--json"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((eng / "config.json").read_text())
    assert cfg["backend"] == "embedded" and cfg["checkpoint"] == "checkpoint"
    assert cfg["build_config"] == {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128,
                                   "max_num_tokens": 8192, "max_beam_width": 1, "tokens_per_block": 16,
                                   "device": "auto", "cpu_matmul": "auto", "cpu_activations": "float32"}
    assert cfg["pretrained_config"] == json.loads((ckpt_fp32 / "config.json").read_text())
    # Same filesystem: the rank files are hard links, not copies.
    for name in ("rank0.safetensors", "rank1.safetensors", "config.json"):
        assert (eng / "checkpoint" / name).stat().st_ino == (ckpt_fp32 / name).stat().st_ino
    assert cli(["verify", eng]).exit_code == 0
    assert cli(["verify", eng / "checkpoint"]).exit_code == 0  # still a valid checkpoint on its own
    m = json.loads((eng / "manifest.json").read_text())
    assert m["kind"] == "embedded-engine" and m["checkpoint_placement"] == "hard links"
    assert m["source_checkpoint"]["manifest_sha256"] == hashlib.sha256(
        (ckpt_fp32 / "manifest.json").read_bytes()).hexdigest()
    # The engine dir generates exactly what the checkpoint does, within its build limits.
    # Load time (median of 5, one CPU thread, 222 MB fp16 Mixtral-shaped checkpoint): load_engine(engine_dir)
    # 0.27 s vs EmbeddedEngine.from_checkpoint(ckpt) 0.29 s at tp=1 — the same bytes through the same reader.
    a = load_engine(eng, "cpu")
    b = EmbeddedEngine.from_checkpoint(ckpt_fp32, device="cpu")
    assert a.max_seq_len == 128 and b.max_seq_len == MPE
    for p in PROMPTS:
        params = SamplingParams(max_new_tokens=12)
        assert a.generate(p, params) == b.generate(p, params)
    with pytest.raises(Exception, match="max_seq_len 128"):
        a.generate(list(range(100)), SamplingParams(max_new_tokens=40))
    # The Triton repository generator reads the same layout.
    from trtmoe.triton.engine_dir import read_engine_dir
    info = read_engine_dir(eng)
    assert (info.backend, info.max_batch_size, info.max_input_len, info.max_seq_len, info.tokens_per_block,
            info.mapping.world_size) == ("embedded", 4, 64, 128, 16, 2)


def test_embedded_copy_mode_and_tokenizer(tiny_model, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_model("mixtral"), hf)
    # A minimal tokenizer.json so the checkpoint carries a tokenizer/ folder.
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(hf / "tokenizer.json"))
    ck = convert(hf, tmp_path / "ck", dtype="float32").out_dir
    assert (ck / "tokenizer" / "tokenizer.json").is_file()
    eng = tmp_path / "eng"
    r = cli(["build", ck, "-o", eng, "--max-input-len", 100, "--copy"])
    assert r.exit_code == 0, r.output
    assert (eng / "checkpoint" / "tokenizer" / "tokenizer.json").read_bytes() == (
        ck / "tokenizer" / "tokenizer.json").read_bytes()
    assert (eng / "checkpoint" / "rank0.safetensors").stat().st_ino != (ck / "rank0.safetensors").stat().st_ino
    assert json.loads((eng / "manifest.json").read_text())["checkpoint_placement"] == "copies"
    assert cli(["verify", eng]).exit_code == 0
    # --force replaces it; without --force the existing one is kept.
    assert cli(["build", ck, "-o", eng, "--max-input-len", 50, "--force"]).exit_code == 0
    assert json.loads((eng / "config.json").read_text())["build_config"]["max_input_len"] == 50


def test_embedded_dry_run_writes_nothing(ckpt_fp16, tmp_path):
    out = tmp_path / "e"
    r = cli(["build", ckpt_fp16, "-o", out, "--dry-run", "--json", "--max-input-len", 100, "--max-batch-size", 2])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["build_config"]["max_seq_len"] == MPE and not out.exists()
    # One process holds every rank: weights are all rank files; KV covers all layers and KV heads.
    files = sum((ckpt_fp16 / f"rank{i}.safetensors").stat().st_size for i in range(2))
    assert d["estimate"]["ranks"][0]["weight_bytes"] == files
    assert d["estimate"]["ranks"][0]["kv_bytes"] == 2 * L * NKV * HD * 2 * 2 * MPE


def test_mixed_precision_layers_shrink_by_their_own_format(mixtral_hf, tmp_path):
    """Layer-granular MIXED_PRECISION: quant_cfg.json names each MoE layer's format; the estimate
    applies int8 to layer 0, nothing to layer 1 and int4 to layer 2."""
    bits = {0: 8, 1: None, 2: 4}
    fmt = {8: "int8", None: "float", 4: "int4"}
    ck = _quantized(mixtral_hf, tmp_path / "mixed",
                    lambda m: QuantPlan({l: [fmt[bits[l]]] * E for l in range(L)}, granularity="layer"),
                    tp=1, dtype="float16")
    assert json.loads((ck / "config.json").read_text())["quantization"]["quant_algo"] == "MIXED_PRECISION"
    facts = read_checkpoint(ck)
    b = resolve_limits(defaults()["build"] | {"max_input_len": 100}, facts, "tensorrt-llm").build
    (rank,) = estimate_memory(facts, b, "tensorrt-llm").ranks
    fc, proj = E * 2 * I * H, E * H * I
    want = (ck / "rank0.safetensors").stat().st_size + sum(
        (fc + proj) * n // 8 + (E * 2 * I + E * H) * 2 - (fc + proj) * 2 for n in bits.values() if n)
    assert rank.weight_bytes == want
    assert sorted(rank.quantized_by_build) == sorted(f"transformer.layers.{l}.mlp.{m}.weight"
                                                     for l in (0, 2) for m in ("fc", "proj"))
