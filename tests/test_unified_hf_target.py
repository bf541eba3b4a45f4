"""The unified-HF target end to end without ModelOpt: support table, convert's refusals, verify, the
llmapi repository and the GPU command lines; and the formats' numerics against hand-computed values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from trtmoe import cli
from trtmoe.checkpoint import unified_hf as U
from trtmoe.checkpoint import unified_support as S
from trtmoe.quant import formats as QF
from trtmoe.errors import UnsupportedError

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, env_extra=None):
    import os

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "trtmoe.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=env)


# ---- support table -------------------------------------------------------------------------------

def test_every_cell_names_its_source_and_why_it_is_not_a_plain_yes():
    for e in S.ENGINES:
        for fam in S.FAMILIES:
            for f in S.FORMATS:
                for layout in S.LAYOUTS:
                    for sm in S.SMS:
                        c = S.cell(e, fam, f, layout, sm)
                        assert c.source, (e, fam, f, layout, sm)
                        assert (c.status == S.SUPPORTED) == (c.reason == ""), (e, fam, f, layout, sm)


def test_cells_restate_the_capability_matrix():
    assert S.cell("trtllm-1.2.1", "qwen3_moe", "fp8", "uniform", 89).status == S.SUPPORTED
    assert S.cell("trtllm-1.2.1", "qwen3_moe", "nvfp4", "uniform", 100).status == S.SUPPORTED
    assert S.cell("trtllm-1.2.1", "qwen3_moe", "nvfp4", "uniform", 90).status == S.UNLISTED  # Marlin W4A16
    assert S.cell("trtllm-1.4", "mixtral", "mxfp4", "uniform", 89).status == S.REFUSED
    assert S.cell("trtllm-1.4", "qwen3_moe", "fp8", "mixed", 100).status == S.REFUSED  # PR #15485 open
    assert S.cell("trtllm-1.2.1", "phimoe", "bf16", "uniform", 90).status == S.REFUSED  # no PyTorch class
    assert S.cell("vllm-0.33", "qwen3_moe", "nvfp4", "mixed", 100).status == S.SUPPORTED  # modelopt_mixed
    assert S.cell("sglang-0.5", "mixtral", "fp8", "mixed", 90).status == S.SUPPORTED


def test_a_refusal_names_the_cell_and_what_works():
    v = S.check("trtllm-1.2.1", "qwen3_moe", {"fp8", "nvfp4"}, 100)
    assert not v.ok
    with pytest.raises(UnsupportedError) as e:
        v.raise_if_refused()
    text = e.value.render()
    assert "TensorRT-LLM 1.2.1 (PyTorch backend) x Qwen3-MoE x FP8 x mixed x SM100" in text
    assert "modeling_qwen3_moe.py" in text and "vLLM 0.33" in text  # where per-layer plans do work
    assert S.check("vllm-0.33", "qwen3_moe", {"fp8", "nvfp4"}, 100).ok


def test_docs_hold_the_generated_table():
    doc = (REPO / "docs" / "deploy-gpu.md").read_text()
    assert S.markdown_table() in doc


def test_the_registry_has_the_writers_targets():
    from trtmoe.targets import TARGETS, names

    assert names(unified=True) == U.TARGETS
    assert all(TARGETS[n].releases == tuple(e for e, (_, t) in S.ENGINES.items() if t == n) for n in U.TARGETS)
    assert all(TARGETS[n].default_engine == S.DEFAULT_ENGINE[n] for n in U.TARGETS)


# ---- numerics (hand-computed) ----------------------------------------------------------------------

def test_e2m1_rounding_rules():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, 0.0])
    v = QF.e2m1_values(QF.e2m1_codes(x))  # NVFP4: ties to the even code
    assert v.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, 0.0]
    m = QF.e2m1_codes(x, ties="down")  # MXFP4: ties down, zero stored as -0
    assert QF.e2m1_values(m).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, 0.0]
    assert int(m[-1]) == 8


def test_nibble_order_low_first():
    packed = QF.pack_nibbles(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x43]]
    assert QF.unpack_nibbles(packed).tolist() == [[1, 2, 3, 4]]


@pytest.mark.parametrize("fmt,rel", [("fp8", 2 ** -3), ("int8", 2 ** -7), ("fp8_block_wo", 2 ** -3),
                                     ("nvfp4", 0.5), ("mxfp4", 1.0)])
def test_dequantized_weights_are_within_one_rounding_step(fmt, rel):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 0.05).to(torch.bfloat16)
    f = U.FORMATS[fmt]
    t = f.quantize(w, 1.0)
    d = f.dequantize(t)
    assert d.shape == w.shape
    # Error per element at most one step of the format at that element's scale.
    assert bool(((d - w.float()).abs() <= rel * w.float().abs().amax(-1, keepdim=True) + 1e-6).all())
    if fmt == "int8":  # exactly ModelOpt's rule: amax/127 per row, round half to even
        s = w.float().abs().amax(-1) / 127
        assert torch.equal(t["weight"], (w.float() / s[:, None]).round().clamp(-128, 127).to(torch.int8))


# ---- CLI end to end --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_with_ids):
    return tiny_qwen3_with_ids


def test_convert_refuses_a_graded_plan_trtllm_cannot_load_before_any_work(qwen3):
    model, d = qwen3
    p = run_cli("convert", model, "-o", d / "refused", "--target", "trtllm-pytorch", "--layer-format", "0=fp8",
                "--layer-format", "1=nvfp4", "--calib-ids", d / "ids.json")
    assert p.returncode == 2, p.stderr
    assert "x mixed x SM90: refused" in p.stderr and "Traceback" not in p.stderr
    assert not (d / "refused").exists()


def test_convert_repo_serve_for_vllm_and_trtllm(qwen3):
    model, d = qwen3
    p = run_cli("convert", model, "-o", d / "mixed", "--target", "vllm", "--layer-format", "0=fp8",
                "--layer-format", "1=nvfp4", "--layer-format", "2=int8", "--calib-ids", d / "ids.json", "--sm", "100",
                "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["quant_algo"] == "MIXED_PRECISION" and len(s["quantized_layers"]) == 3
    assert run_cli("verify", d / "mixed").returncode == 0
    p = run_cli("convert", model, "-o", d / "fp8", "--target", "trtllm-pytorch", "--layer-format", "*=fp8",
                "--calib-ids", d / "ids.json")
    assert p.returncode == 0, p.stderr
    p = run_cli("repo", d / "fp8", "-o", d / "repo")
    assert p.returncode == 0, p.stderr
    y = yaml.safe_load((d / "repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert y["model"] == str((d / "fp8").absolute()) and y["backend"] == "pytorch"
    assert y["tensor_parallel_size"] == 1 and y["moe_expert_parallel_size"] == 1
    assert y["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    assert "free_gpu_memory_fraction" in y["kv_cache_config"]
    # config.pbtxt parses as Triton's ModelConfig, takes the inputs upstream's llmapi guide sends, and says
    # what model.yaml's triton_config says (upstream's launch script disables auto-complete).
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    pb = text_format.Parse((d / "repo" / "tensorrt_llm" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    names = {i.name for i in pb.input}
    assert {"text_input", "streaming", "sampling_param_max_tokens", "sampling_param_exclude_input_from_output",
            "sampling_param_return_perf_metrics"} <= names
    assert [i.name for i in pb.input if not i.optional] == ["text_input"]
    assert {"text_output", "finish_reason", "kv_cache_hit_rate"} <= {o.name for o in pb.output}
    assert pb.model_transaction_policy.decoupled == y["triton_config"]["decoupled"]
    assert pb.max_batch_size == y["triton_config"]["max_batch_size"]
    assert run_cli("verify", d / "repo").returncode == 0
    p = run_cli("serve", d / "repo", "--print-command")
    assert p.returncode == 0, p.stderr
    assert f"trtllm-serve {(d / 'fp8').absolute()} --host 0.0.0.0 --backend pytorch" in p.stdout
    assert "vllm serve" in p.stdout and "sglang.launch_server" in p.stdout
    # Every option printed is one the engines' own command lines define (restated from
    # tensorrt_llm/commands/serve.py, vLLM's and SGLang's server arguments, and TensorRT-LLM's
    # triton_backend/scripts/launch_triton_server.py), and the llmapi backend's model.py comes with
    # the helpers.py it imports.
    known = {
        "trtllm-serve": {"--host", "--port", "--backend", "--tp_size", "--pp_size", "--ep_size", "--max_batch_size",
                         "--max_num_tokens", "--max_seq_len", "--kv_cache_free_gpu_memory_fraction"},
        "vllm": {"--quantization", "--tensor-parallel-size", "--enable-expert-parallel", "--max-num-seqs",
                 "--max-model-len", "--gpu-memory-utilization", "--port", "--host"},
        "sglang.launch_server": {"--model-path", "--host", "--quantization", "--tp", "--ep-size",
                                 "--max-running-requests", "--context-length", "--mem-fraction-static", "--port"},
        "launch_triton_server.py": {"--model_repo", "--http_port", "--grpc_port", "--world_size"},
    }
    seen = set()
    for line in p.stdout.splitlines():
        for name, opts in known.items():
            if name in line:
                seen.add(name)
                tail = line[line.index(name):]
                used = {w.split("=")[0] for w in tail.split() if w.startswith("--")}
                assert used <= opts, (name, used - opts)
    assert seen == set(known), seen
    assert "helpers.py" in p.stdout and "--depth 1 --branch v$(python3" in p.stdout
    p = run_cli("build", d / "fp8", "-o", d / "engine")
    assert p.returncode == 2 and "no build step" in p.stderr and not (d / "engine").exists()
    # An edited shard fails verify.
    shard = next((d / "fp8").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    p = run_cli("verify", d / "fp8")
    assert p.returncode != 0 and "sha256" in p.stderr


def test_activation_formats_need_calibration_ids(qwen3):
    model, d = qwen3
    p = run_cli("convert", model, "-o", d / "noids", "--target", "sglang", "--layer-format", "*=nvfp4", "--sm", "100")
    assert p.returncode == 2 and "--calib-ids" in p.stderr
    p = run_cli("convert", model, "-o", d / "wo", "--target", "sglang", "--layer-format", "*=mxfp4", "--sm", "100")
    assert p.returncode == 0, p.stderr


# ---- graded plan from a calibration -----------------------------------------------------------------

@pytest.mark.slow
def test_budgeted_plan_is_per_layer_and_follows_the_support_cell(tmp_path):
    """calibrate (fp8, nvfp4 measured) -> convert --budget: vLLM on SM100 takes a per-layer plan within
    the budget; TensorRT-LLM (no MIXED_PRECISION for Qwen3-MoE) one uniform format; the input scales come
    from the calibration's per-layer input amax."""
    from trtmoe.build.unified_hf import convert_unified, plan_from_calibration
    from trtmoe.data import write_split_text
    from trtmoe.quant.calibrate import calibrate

    model = REPO / "tests" / "fixtures" / "trained_qwen3_moe"
    if not model.is_dir():
        pytest.skip("tests/fixtures/trained_qwen3_moe is missing (scripts/make_trained_fixture.py)")
    write_split_text("calib", tmp_path / "calib.txt", max_bytes=60_000)
    calibrate(model, tmp_path / "calib.txt", tmp_path / "calib", samples=4, seq_len=64, formats=("fp8", "nvfp4"))
    plan, amax = plan_from_calibration(model, tmp_path / "calib", 6.0, engine="vllm-0.33", sm=100)
    assert set(plan.expert_formats.values()) <= {"bf16", "fp8", "nvfp4"}
    assert plan.meta["avg_bpw"] <= 6.0 + 1e-9
    assert amax and all(v > 0 for v in amax.values())
    uni, _ = plan_from_calibration(model, tmp_path / "calib", 6.0, engine="trtllm-1.2.1", sm=100)
    assert len(set(uni.expert_formats.values())) == 1
    r = convert_unified(model, tmp_path / "ck", target="vllm", layer_formats=(), engine="vllm-0.33", sm=100,
                        calib=tmp_path / "calib", budget_bpw=6.0)
    q = r.result.hf_quant_config["quantization"]
    assert q["quant_algo"] in ("MIXED_PRECISION", "FP8", "NVFP4")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4", "fp8_block_wo"])
def test_export_numerics_equal_the_format_classes(fmt):
    """The exporter's ModelOpt-form tensors and trtmoe's format classes (quant/formats.py) agree bit for bit
    on a matrix with several blocks, so the checkpoint and the embedded engine's kernels share one rule."""
    from trtmoe.quant.formats import FORMATS as QF

    w = (torch.randn(256, 256, generator=torch.Generator().manual_seed(1)) * 0.05).to(torch.bfloat16)
    f = QF[fmt]
    ours = f.quantize(w, dtype=torch.bfloat16, **({"input_amax": torch.tensor(3.0)} if f.needs_input_amax else {}))
    exp = U.FORMATS[fmt].quantize(w, 3.0)
    assert set(exp) <= set(ours)
    for k, t in exp.items():
        a, b = ours[k], t
        assert (a.dtype, a.shape) == (b.dtype, b.shape), k
        view = (lambda x: x.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda x: x)
        assert torch.equal(view(a), view(b)), k
