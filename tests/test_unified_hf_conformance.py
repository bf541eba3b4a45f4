"""trtmoe's unified-HF export against NVIDIA ModelOpt 0.47's own export of the same tiny model.

ModelOpt runs in its own environment (scripts/modelopt_env.sh makes it; TRTMOE_MODELOPT_PYTHON names its
interpreter, default /work/venvs/modelopt/bin/python) through scripts/modelopt_export.py; these tests skip
with the reason when it is absent. For each uniform format ModelOpt exports on CPU and each architecture:
the same tensor names, dtypes and shapes, the same hf_quant_config.json and config.json
quantization_config, weights and weight scales bit-identical (dequantized weights equal), and input
scales within one rounding step of the model dtype (the activations come from two transformers
releases). A graded checkpoint's MIXED_PRECISION quantized_layers equals what ModelOpt writes for the
same per-layer choice.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trtmoe.checkpoint import unified_hf as U
from trtmoe.checkpoint.verify import verify_artifact
from trtmoe.hf.reader import HFCheckpoint

REPO = Path(__file__).resolve().parents[1]
MODELOPT_PYTHON = os.environ.get("TRTMOE_MODELOPT_PYTHON", "/work/venvs/modelopt/bin/python")


def _modelopt_problem() -> str | None:
    if not Path(MODELOPT_PYTHON).is_file():
        return f"ModelOpt environment not found at {MODELOPT_PYTHON} (make it with scripts/modelopt_env.sh)"
    try:
        p = subprocess.run([MODELOPT_PYTHON, "-c", "import modelopt.torch.export, transformers"],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"ModelOpt environment unusable: {e}"
    return None if p.returncode == 0 else f"ModelOpt does not import there: {p.stderr.strip()[-200:]}"


_PROBLEM = _modelopt_problem()
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")

ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")
FORMATS = ("fp8", "nvfp4", "int8", "fp8_block_wo", "mxfp4")
# Expert FFN 64 so every format's block (16, 32) divides every input width.
WIDTH = {"mixtral": {"intermediate_size": 64}, "qwen3_moe": {"moe_intermediate_size": 64},
         "qwen2_moe": {"moe_intermediate_size": 64}}


@pytest.fixture(scope="module")
def calib_ids(tmp_path_factory) -> tuple[list[list[int]], Path]:
    rng = random.Random(0)
    ids = [[rng.randrange(250) for _ in range(32)] for _ in range(4)]
    path = tmp_path_factory.mktemp("calib") / "ids.json"
    path.write_text(json.dumps(ids))
    return ids, path


@pytest.fixture(scope="module")
def models(tiny_model):
    return {a: tiny_model(a, dtype="bfloat16", **WIDTH[a]) for a in ARCHS}


def modelopt_export(model: Path, out: Path, ids_path: Path, fmt: str, layer_formats: dict[int, str] = None) -> Path:
    argv = [MODELOPT_PYTHON, str(REPO / "scripts" / "modelopt_export.py"), str(model), str(out), "--format", fmt,
            "--calib-ids", str(ids_path)]
    for l, f in (layer_formats or {}).items():
        argv += ["--layer-format", f"{l}={f}"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd="/tmp")
    assert p.returncode == 0, p.stderr[-2000:]
    return out


def tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def moe_layers(model: Path) -> list[int]:
    with HFCheckpoint(model) as ck:
        return [l for l, m in enumerate(ck.model.moe_layers) if m]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_uniform_export_matches_modelopt(arch, fmt, models, calib_ids, tmp_path):
    ids, ids_path = calib_ids
    model = models[arch]
    ref = modelopt_export(model, tmp_path / "modelopt", ids_path, fmt)
    amax = U.measure_input_amax(model, ids) if U.FORMATS[fmt].activations else None
    ours = tmp_path / "trtmoe"
    U.write_unified_checkpoint(model, ours, U.UnifiedPlan.uniform(fmt, moe_layers(model)), input_amax=amax,
                               shard_bytes=150_000)
    verify_artifact(ours)
    a, b = tensors(ours), tensors(ref)
    assert sorted(a) == sorted(b)
    for k in sorted(a):
        assert (a[k].dtype, tuple(a[k].shape)) == (b[k].dtype, tuple(b[k].shape)), k
        if k.endswith("input_scale"):
            # One rounding step of the model dtype (bf16: 2**-8 relative) on the calibrated activations.
            assert torch.allclose(a[k], b[k], rtol=2 ** -7, atol=0), (k, a[k].item(), b[k].item())
        else:
            assert torch.equal(bits(a[k]), bits(b[k])), k
    for name in ("hf_quant_config.json",):
        assert json.loads((ours / name).read_text()) == json.loads((ref / name).read_text())
    assert (json.loads((ours / "config.json").read_text())["quantization_config"]
            == json.loads((ref / "config.json").read_text())["quantization_config"])
    # The index names every tensor and shard; dequantizing the experts gives the same weights.
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(a) and len(set(index["weight_map"].values())) > 1
    f = U.FORMATS[fmt]
    for k in [k for k in a if k.endswith(".weight") and ".experts.0." in k]:
        p = k[: -len("weight")]
        mine = {s[len(p):]: t for s, t in a.items() if s.startswith(p)}
        theirs = {s[len(p):]: t for s, t in b.items() if s.startswith(p)}
        assert torch.equal(f.dequantize(mine), f.dequantize(theirs)), k


@pytest.mark.slow
@pytest.mark.parametrize("arch", ("mixtral", "qwen3_moe"))
def test_graded_quantized_layers_match_modelopt(arch, models, calib_ids, tmp_path):
    """Routed experts per MoE layer (fp8, nvfp4, left bf16), the rest unquantized: ModelOpt writes
    MIXED_PRECISION with one quantized_layers entry per layer's experts block."""
    ids, ids_path = calib_ids
    model = models[arch]
    choice = {0: "fp8", 1: "nvfp4", 2: "bf16"}
    ref = modelopt_export(model, tmp_path / "modelopt", ids_path, "bf16", choice)
    ours = tmp_path / "trtmoe"
    U.write_unified_checkpoint(model, ours, U.UnifiedPlan(choice), input_amax=U.measure_input_amax(model, ids))
    qa = json.loads((ours / "hf_quant_config.json").read_text())
    assert qa == json.loads((ref / "hf_quant_config.json").read_text())
    assert qa["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert len(qa["quantization"]["quantized_layers"]) == 2
    assert (json.loads((ours / "config.json").read_text())["quantization_config"]
            == json.loads((ref / "config.json").read_text())["quantization_config"])
    a, b = tensors(ours), tensors(ref)
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}


@pytest.mark.slow
def test_single_quantized_layer_lists_the_rest_as_modelopt_does(models, calib_ids, tmp_path):
    """One format in one layer: a uniform quant_algo whose exclude_modules collapse the unquantized
    subtrees (``model.layers.1*``) exactly as ModelOpt writes them."""
    ids, ids_path = calib_ids
    model = models["mixtral"]
    ref = modelopt_export(model, tmp_path / "modelopt", ids_path, "bf16", {0: "fp8"})
    ours = tmp_path / "trtmoe"
    U.write_unified_checkpoint(model, ours, U.UnifiedPlan({0: "fp8"}), input_amax=U.measure_input_amax(model, ids))
    assert (json.loads((ours / "hf_quant_config.json").read_text())
            == json.loads((ref / "hf_quant_config.json").read_text()))
