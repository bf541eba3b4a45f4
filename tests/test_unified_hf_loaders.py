"""What TensorRT-LLM's PyTorch backend and vLLM read from a unified-HF checkpoint, restated as small
loader rules and applied to checkpoints trtmoe writes (no ModelOpt needed; independent of the writer's
code). Rules restated from TensorRT-LLM ``_torch/model_config.py`` (``load_hf_quant_config``: the
``quantization`` block of hf_quant_config.json, ``exclude_modules`` as fnmatch patterns, MIXED_PRECISION
per-prefix ``quantized_layers``), ``_torch/modules/fused_moe/quantization.py`` (per expert ``w1``/``w3``
fused into one gate_up GEMM, so the two share a global weight scale for FP8 / NVFP4; one input scale per
layer's experts, the max over experts) and vLLM ``layers/quantization/modelopt.py`` (the same names;
``modelopt_mixed`` resolves a module's format by the longest quantized_layers prefix).
"""

from __future__ import annotations

import fnmatch
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trtmoe.checkpoint import unified_hf as U

REPO = Path(__file__).resolve().parents[1]

# What a loader expects per quant_algo: tensor suffix -> (dtype, shape rule on [out, in]).
EXPECT = {
    None: {"weight": ("BF16", lambda o, i: [o, i])},
    "FP8": {"weight": ("F8_E4M3", lambda o, i: [o, i]), "weight_scale": ("F32", lambda o, i: []),
            "input_scale": ("F32", lambda o, i: [])},
    "NVFP4": {"weight": ("U8", lambda o, i: [o, i // 2]), "weight_scale": ("F8_E4M3", lambda o, i: [o, i // 16]),
              "weight_scale_2": ("F32", lambda o, i: []), "input_scale": ("F32", lambda o, i: [])},
    "W8A16": {"weight": ("I8", lambda o, i: [o, i]), "weight_scale": ("F32", lambda o, i: [o])},
    "mxfp4": {"weight": ("U8", lambda o, i: [o, i // 2]), "weight_scale": ("U8", lambda o, i: [o, i // 32])},
}


def header(ckpt: Path) -> dict[str, dict]:
    out = {}
    for f in sorted(ckpt.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                out[k] = {"dtype": sl.get_dtype(), "shape": list(sl.get_shape()), "file": f.name}
    return out


def algo_of(q: dict, module: str) -> str | None:
    """The quant_algo a loader gives ``module``: MIXED -> longest quantized_layers prefix (else none);
    uniform -> the checkpoint's, unless an exclude_modules pattern matches."""
    if q["quant_algo"] == "MIXED_PRECISION":
        hits = [p for p in q["quantized_layers"] if module == p or module.startswith(p + ".")]
        return q["quantized_layers"][max(hits, key=len)]["quant_algo"] if hits else None
    if any(fnmatch.fnmatch(module, pat) or module == pat for pat in q.get("exclude_modules", [])):
        return None
    return q["quant_algo"]


def check_loadable(ckpt: Path, source: Path) -> dict[str, str | None]:
    q = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    assert cfg["quantization_config"]["quant_algo"] == q["quant_algo"]
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    h = header(ckpt)
    assert index["weight_map"] == {k: v["file"] for k, v in h.items()}
    src = {}
    with safe_open(str(next(source.glob("*.safetensors"))), "pt") as fh:
        for k in fh.keys():
            src[k] = list(fh.get_slice(k).get_shape())
    linears = {k[: -len(".weight")]: s for k, s in src.items() if k.endswith(".weight") and len(s) == 2}
    chosen = {}
    for mod, (o, i) in linears.items():
        algo = algo_of(q, mod)
        if mod.endswith((".gate", ".shared_expert_gate")) or mod in ("lm_head", "model.embed_tokens"):
            assert algo is None, f"{mod}: routers, embeddings and lm_head stay unquantized"
        chosen[mod] = algo
        want = EXPECT[algo]
        have = {k[len(mod) + 1:]: v for k, v in h.items() if k.startswith(mod + ".") and k.count(".") == mod.count(".") + 1}
        have.pop("bias", None)
        assert set(have) == set(want), (mod, algo, sorted(have))
        for suffix, (dt, shape) in want.items():
            assert (have[suffix]["dtype"], have[suffix]["shape"]) == (dt, shape(o, i)), (mod, suffix)
    # Fused gate_up: w1 and w3 (gate_proj and up_proj) of one expert share the global weight scale.
    t = {}
    for f in sorted(ckpt.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k.endswith(("weight_scale", "weight_scale_2", "input_scale")) and ".experts." in k:
                    t[k] = fh.get_tensor(k)
    for k, v in t.items():
        for a, b in ((".w1.", ".w3."), (".gate_proj.", ".up_proj.")):
            if a in k and (chosen[k.rsplit(".", 1)[0]] in ("FP8", "NVFP4")) and (
                    k.endswith("weight_scale") and chosen[k.rsplit(".", 1)[0]] == "FP8" or k.endswith("weight_scale_2")):
                assert torch.equal(v, t[k.replace(a, b)]), k
        if k.endswith("input_scale"):  # one input scale per layer's experts and projection kind
            e = k.split(".experts.")[1].split(".")[0]
            for other in (k.replace(f".experts.{e}.", f".experts.{x}.") for x in range(4)):
                if other in t:
                    assert torch.equal(v, t[other]), (k, other)
    return chosen


@pytest.fixture(scope="module")
def ids():
    rng = random.Random(1)
    return [[rng.randrange(250) for _ in range(24)] for _ in range(3)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "int8", "mxfp4"])
def test_uniform_checkpoint_reads_as_the_loaders_read_it(arch, fmt, tiny_model, ids, tmp_path):
    width = {"intermediate_size": 64} if arch == "mixtral" else {"moe_intermediate_size": 64}
    model = tiny_model(arch, dtype="bfloat16", **width)
    from trtmoe.hf.reader import HFCheckpoint

    with HFCheckpoint(model) as ck:
        moe = [l for l, m in enumerate(ck.model.moe_layers) if m]
    amax = U.measure_input_amax(model, ids) if U.FORMATS[fmt].activations else None
    U.write_unified_checkpoint(model, tmp_path / "ck", U.UnifiedPlan.uniform(fmt, moe), input_amax=amax,
                               shard_bytes=100_000)
    chosen = check_loadable(tmp_path / "ck", model)
    algo = U.FORMATS[fmt].quant_algo
    assert {a for m, a in chosen.items() if ".experts." in m} == {algo}


def test_graded_checkpoint_gives_each_layer_its_own_method(tiny_model, ids, tmp_path):
    model = tiny_model("qwen3_moe", dtype="bfloat16", moe_intermediate_size=64)
    plan = U.UnifiedPlan({0: "nvfp4", 1: "fp8", 2: "int8"}, {"attention": "fp8"})
    U.write_unified_checkpoint(model, tmp_path / "ck", plan, input_amax=U.measure_input_amax(model, ids))
    chosen = check_loadable(tmp_path / "ck", model)
    per_layer = {l: {a for m, a in chosen.items() if f"layers.{l}.mlp.experts." in m} for l in range(3)}
    assert per_layer == {0: {"NVFP4"}, 1: {"FP8"}, 2: {"W8A16"}}
    assert {a for m, a in chosen.items() if ".self_attn." in m} == {"FP8"}
    q = json.loads((tmp_path / "ck" / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION" and "model.layers.0.mlp.experts" in q["quantized_layers"]
