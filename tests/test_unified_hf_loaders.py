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
    "W4A16_NVFP4": {"weight": ("U8", lambda o, i: [o, i // 2]), "weight_scale": ("F8_E4M3", lambda o, i: [o, i // 16]),
                    "weight_scale_2": ("F32", lambda o, i: [])},
    # TensorRT-LLM WInt4AFP8FusedMoEMethod (ModelOpt "vanilla" checkpoints): two INT4 codes of adjacent output
    # rows per byte [(N/2), K]; per-group weight_scale [N, K/128]; per-tensor weight_scale_2 and input_scale;
    # per-channel pre_quant_scale [K].
    "W4A8_AWQ": {"weight": ("U8", lambda o, i: [o // 2, i]), "weight_scale": ("F32", lambda o, i: [o, i // 128]),
                 "weight_scale_2": ("F32", lambda o, i: []), "pre_quant_scale": ("BF16", lambda o, i: [i]),
                 "input_scale": ("F32", lambda o, i: [])},
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
                if k.endswith(("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")) and ".experts." in k:
                    t[k] = fh.get_tensor(k)
    for k, v in t.items():
        for a, b in ((".w1.", ".w3."), (".gate_proj.", ".up_proj.")):
            algo = chosen[k.rsplit(".", 1)[0]]
            if a in k and algo in ("FP8", "NVFP4", "W4A16_NVFP4", "W4A8_AWQ") and (
                    k.endswith("weight_scale") and algo == "FP8" or k.endswith(("weight_scale_2", "pre_quant_scale"))):
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
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "int8", "mxfp4", "nvfp4_w4a16"])
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


def test_w4a8_awq_checkpoint_reads_as_tensorrt_llm_reads_it(tiny_model, ids, tmp_path):
    """W4A8-AWQ (ModelOpt's W4A8_AWQ_BETA_CFG cannot export transformers' fused experts, so no oracle runs):
    TensorRT-LLM's WInt4AFP8FusedMoEMethod rules restated. Per expert it stacks w3 and w1 codes, unpacks each
    byte of ``weight`` [(N/2), K] into output rows 2j (low nibble) and 2j+1 (high), divides the per-group
    ``weight_scale`` by the larger ``weight_scale_2`` of w1/w3 (the kernel's FP8 weight), multiplies inputs
    by ``pre_quant_scale / input_scale`` (the max over w1/w3 and over experts) and the GEMM by ``alpha =
    weight_scale_2 * input_scale``."""
    model = tiny_model("mixtral", dtype="bfloat16", hidden_size=128, intermediate_size=128, seed=3)
    from trtmoe.hf.reader import HFCheckpoint

    with HFCheckpoint(model) as ck:
        moe = [l for l, m in enumerate(ck.model.moe_layers) if m]
    amax = U.measure_input_amax(model, ids)
    # The routed experts (what the fused MoE runs in W4A8); attention stays bf16.
    U.write_unified_checkpoint(model, tmp_path / "ck", U.UnifiedPlan({l: "w4a8_awq" for l in moe}), input_amax=amax)
    chosen = check_loadable(tmp_path / "ck", model)
    assert {a for m, a in chosen.items() if ".experts." in m} == {"W4A8_AWQ"}
    q = json.loads((tmp_path / "ck" / "hf_quant_config.json").read_text())["quantization"]
    assert (q["group_size"], q["has_zero_point"], q["pre_quant_scale"]) == (128, False, True)
    qc = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    assert "config_groups" not in qc  # ModelOpt describes only FP8 / NVFP4 / W4A16_NVFP4 that way
    t, src = {}, {}
    for f in sorted((tmp_path / "ck").glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            t.update({k: fh.get_tensor(k) for k in fh.keys()})
    with safe_open(str(next(model.glob("*.safetensors"))), "pt") as fh:
        src = {k: fh.get_tensor(k) for k in fh.keys()}
    for l in moe:
        p = f"model.layers.{l}.block_sparse_moe.experts"
        in_scales = {t[f"{p}.{e}.{w}.input_scale"].item() for e in range(4) for w in ("w1", "w3")}
        assert len(in_scales) == 1  # the loader takes the max: all equal loses nothing
        assert in_scales.pop() == pytest.approx(amax[f"{p}.0.w1"] / 448, rel=1e-6)
        for e in range(4):
            w1, w3 = f"{p}.{e}.w1", f"{p}.{e}.w3"
            ws2 = torch.max(t[w1 + ".weight_scale_2"], t[w3 + ".weight_scale_2"])
            assert torch.equal(t[w1 + ".weight_scale_2"], ws2) and torch.equal(t[w3 + ".weight_scale_2"], ws2)
            for name in (w1, w3, f"{p}.{e}.w2"):
                packed = t[name + ".weight"].view(torch.int8)
                lo, hi = (packed << 4) >> 4, packed >> 4  # sign-extended nibbles
                codes = torch.stack((lo, hi), dim=1).flatten(0, 1).float()  # rows 2j, 2j+1
                scale = t[name + ".weight_scale"].repeat_interleave(128, dim=1)
                w = src[name + ".weight"].float()
                assert torch.equal(t[name + ".pre_quant_scale"], torch.ones(w.shape[1], dtype=torch.bfloat16))
                # The INT4 codes and group scales give the weight back within half a step per group ...
                assert bool(((codes * scale - w).abs() <= scale / 2 + 1e-8).all()), name
                # ... the per-group scale over weight_scale_2 fits FP8's range, so the kernel's FP8 weight
                # (codes * weight_scale / weight_scale_2) never saturates.
                s2 = t[name + ".weight_scale_2"]
                assert float((codes.abs() * scale / s2).max()) <= 448.0
                assert float(s2) == pytest.approx(w.abs().max().item() / 448 if name.endswith("w2") else
                                                  max(src[w1 + ".weight"].float().abs().max().item(),
                                                      src[w3 + ".weight"].float().abs().max().item()) / 448,
                                                  rel=1e-6)
