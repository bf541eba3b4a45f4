"""trtmoe's unified-HF export against NVIDIA ModelOpt 0.47's own export of the same tiny model.

ModelOpt runs in its own environment (scripts/modelopt_env.sh makes it; tests/conftest.py's
modelopt_python_path() says where it is looked for, TRTMOE_MODELOPT_PYTHON overrides) through
scripts/modelopt_export.py, one process per architecture making every export this module compares
against (ModelOpt's import dominates a single export); these tests skip with the reason when it is
absent. For each uniform format ModelOpt exports on CPU and each architecture:
the same tensor names, dtypes and shapes, the same hf_quant_config.json and config.json
quantization_config, weights and weight scales bit-identical (dequantized weights equal), and input
scales within one rounding step of the model dtype (the activations come from two transformers
releases). A graded checkpoint's MIXED_PRECISION quantized_layers equals what ModelOpt writes for the
same per-layer choice. OLMoE (which the TensorRT-LLM engine path never had) is compared the same way for
the formats below; DeepSeek-V3's routed experts, shared experts and dense MLPs too, apart from its MLA
projections, which ModelOpt's FP8 preset quantizes and trtmoe keeps in the model dtype (no support cell
quantizes them). ModelOpt's W4A8_AWQ preset fails on transformers' fused experts (Mixtral, Qwen3-MoE), so
W4A8-AWQ is checked against the loaders' rules in test_unified_hf_loaders.py instead.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trtmoe.checkpoint import unified_hf as U
from trtmoe.checkpoint.verify import verify_artifact
from trtmoe.runtime.unified_load import load_unified_engine

REPO = Path(__file__).resolve().parents[1]
ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "llama4_text", "llama4")
FORMATS = ("fp8", "nvfp4", "int8", "fp8_block_wo", "mxfp4", "nvfp4_w4a16")
FORMATS_OF = {**{a: FORMATS for a in ("mixtral", "qwen3_moe", "qwen2_moe")}, "olmoe": ("fp8", "nvfp4_w4a16"),
              "deepseek_v3": (), **{a: ("fp8", "nvfp4", "nvfp4_w4a16") for a in ("llama4_text", "llama4")}}
UNIFORM = [(a, f) for a in ARCHS for f in FORMATS_OF[a]]
# Expert FFN 64 so every format's block (16, 32) divides every input width.
WIDTH = {"mixtral": {"intermediate_size": 64}, "qwen3_moe": {"moe_intermediate_size": 64},
         "qwen2_moe": {"moe_intermediate_size": 64}, "olmoe": {"intermediate_size": 64},
         "deepseek_v3": {"moe_intermediate_size": 64}, "llama4_text": {"intermediate_size": 64}}
GRADED = {0: "fp8", 1: "nvfp4", 2: "bf16"}  # routed experts per MoE layer, the rest unquantized
LLAMA4_GRADED = {1: "fp8", 3: "nvfp4"}  # the tiny Llama-4's MoE layers are 1 and 3
SINGLE = {0: "fp8"}  # one format in one layer
# Every ModelOpt export the tests below compare against, per architecture: job name -> (base format,
# per-layer expert formats). One ModelOpt process per architecture makes all of them.
JOBS = {a: {**{f: (f, {}) for f in FORMATS_OF[a]},
            **({"fp8": ("fp8", {})} if a == "deepseek_v3" else {}),
            **({"graded": ("bf16", GRADED)} if a in ("mixtral", "qwen3_moe") else {}),
            **({"single": ("bf16", SINGLE)} if a == "mixtral" else {}),
            **({"bf16": ("bf16", {}), "graded": ("bf16", LLAMA4_GRADED)} if a.startswith("llama4") else {})}
        for a in ARCHS}


@pytest.fixture(scope="module")
def calib_ids(tmp_path_factory) -> tuple[list[list[int]], Path]:
    rng = random.Random(0)
    ids = [[rng.randrange(250) for _ in range(32)] for _ in range(4)]
    path = tmp_path_factory.mktemp("calib") / "ids.json"
    path.write_text(json.dumps(ids))
    return ids, path


def make_llama4_multimodal(text_model: Path, out: Path) -> Path:
    """A tiny released-form Llama-4 (Llama4ForConditionalGeneration, model_type ``llama4``): the tiny text
    model's weights under ``language_model.``, plus a seeded one-layer vision tower and projector."""
    import transformers

    text = json.loads((Path(text_model) / "config.json").read_text())
    for k in ("architectures", "transformers_version", "dtype", "torch_dtype", "model_type"):
        text.pop(k, None)
    vision = transformers.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vision_output_dim=64,
        image_size=28, patch_size=14, projector_input_dim=64, projector_output_dim=64, pixel_shuffle_ratio=0.5)
    cfg = transformers.Llama4Config(text_config=transformers.Llama4TextConfig(**text), vision_config=vision,
                                    image_token_index=249, boi_token_index=247, eoi_token_index=248)
    cfg.architectures = ["Llama4ForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(cfg)
    src = transformers.Llama4ForCausalLM.from_pretrained(str(text_model), dtype=torch.float32)
    model.language_model.load_state_dict(src.state_dict())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("vision_model.", "multi_modal_projector.")) and p.dim() >= 2:
                p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(str(out))
    return Path(out)


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    out = {a: tiny_model(a, dtype="bfloat16", **WIDTH[a]) for a in ARCHS if a != "llama4"}
    out["llama4"] = make_llama4_multimodal(out["llama4_text"], tmp_path_factory.mktemp("tiny-llama4"))
    return out


@pytest.fixture(scope="module")
def modelopt_refs(modelopt_py, models, calib_ids, tmp_path_factory):
    """``ref(arch, job)``: the folder ModelOpt exported job ``JOBS[arch][job]`` to. The first request for
    an architecture runs one ModelOpt process that makes all of that architecture's exports (a failed
    one fails every test of the architecture with ModelOpt's error)."""
    _, ids_path = calib_ids
    done: dict[str, tuple[Path, str | None]] = {}

    def ref(arch: str, job: str) -> Path:
        if arch not in done:
            out = tmp_path_factory.mktemp(f"modelopt_{arch}")
            argv = [modelopt_py, str(REPO / "scripts" / "modelopt_export.py"), str(models[arch]), str(out),
                    "--calib-ids", str(ids_path)]
            for name, (fmt, layers) in JOBS[arch].items():
                argv += ["--job", name, fmt, *(f"{l}={f}" for l, f in layers.items())]
            p = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd="/tmp")
            done[arch] = (out, None if p.returncode == 0 else p.stderr[-2000:])
        out, err = done[arch]
        assert err is None, err
        return out / job

    return ref


def tensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors files, by name."""
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def moe_layers(model: Path) -> list[int]:
    with U.SourceModel(model) as src:
        return sorted({m.layer for m in src.modules() if m.kind == "expert"})


def assert_same_tensors(ours, ref) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``ours`` and ``ref`` hold the same tensors: names, dtypes and shapes, and the same bits except the
    input scales, which may differ by one rounding step of the model dtype (bf16: 2**-8 relative) on the
    calibrated activations. Returns both tensor dicts."""
    a, b = tensors(ours), tensors(ref)
    assert sorted(a) == sorted(b)
    for k in sorted(a):
        assert (a[k].dtype, tuple(a[k].shape)) == (b[k].dtype, tuple(b[k].shape)), k
        if k.endswith("input_scale"):
            assert torch.allclose(a[k], b[k], rtol=2 ** -7, atol=0), (k, a[k].item(), b[k].item())
        else:
            assert torch.equal(bits(a[k]), bits(b[k])), k
    return a, b


@pytest.mark.slow
@pytest.mark.parametrize("arch,fmt", UNIFORM)
def test_uniform_export_matches_modelopt(arch, fmt, models, calib_ids, modelopt_refs, tmp_path):
    ids, _ = calib_ids
    model = models[arch]
    ref = modelopt_refs(arch, fmt)
    amax = U.measure_input_amax(model, ids) if U.FORMATS[fmt].activations else None
    ours = tmp_path / "trtmoe"
    U.write_unified_checkpoint(model, ours, U.UnifiedPlan.uniform(fmt, moe_layers(model)), input_amax=amax,
                               shard_bytes=150_000)
    verify_artifact(ours)
    a, b = assert_same_tensors(ours, ref)
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
def test_graded_quantized_layers_match_modelopt(arch, models, calib_ids, modelopt_refs, tmp_path):
    """Routed experts per MoE layer (fp8, nvfp4, left bf16), the rest unquantized: ModelOpt writes
    MIXED_PRECISION with one quantized_layers entry per layer's experts block."""
    ids, _ = calib_ids
    model = models[arch]
    ref = modelopt_refs(arch, "graded")
    ours = tmp_path / "trtmoe"
    U.write_unified_checkpoint(model, ours, U.UnifiedPlan(GRADED), input_amax=U.measure_input_amax(model, ids))
    qa = json.loads((ours / "hf_quant_config.json").read_text())
    assert qa == json.loads((ref / "hf_quant_config.json").read_text())
    assert qa["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert len(qa["quantization"]["quantized_layers"]) == 2
    assert (json.loads((ours / "config.json").read_text())["quantization_config"]
            == json.loads((ref / "config.json").read_text())["quantization_config"])
    a, b = tensors(ours), tensors(ref)
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}


@pytest.mark.slow
def test_single_quantized_layer_lists_the_rest_as_modelopt_does(models, calib_ids, modelopt_refs, tmp_path):
    """One format in one layer: a uniform quant_algo whose exclude_modules collapse the unquantized
    subtrees (``model.layers.1*``) exactly as ModelOpt writes them."""
    ids, _ = calib_ids
    model = models["mixtral"]
    ref = modelopt_refs("mixtral", "single")
    ours = tmp_path / "trtmoe"
    U.write_unified_checkpoint(model, ours, U.UnifiedPlan(SINGLE), input_amax=U.measure_input_amax(model, ids))
    assert (json.loads((ours / "hf_quant_config.json").read_text())
            == json.loads((ref / "hf_quant_config.json").read_text()))


@pytest.mark.slow
def test_a_float_layer_of_a_deep_model_is_listed_as_modelopt_lists_it(tiny_model, modelopt_py, calib_ids, tmp_path):
    """Twelve layers, layer 1 unquantized: ``model.layers.1*`` would also match the quantized layers 10
    and 11, so the subtree is listed as ``model.layers.1.*``, as ModelOpt lists it; the embedded loader
    then runs layers 10 and 11 in their format."""
    ids, ids_path = calib_ids
    model = tiny_model("mixtral", dtype="bfloat16", num_hidden_layers=12, **WIDTH["mixtral"])
    layers = {l: "bf16" if l == 1 else "fp8" for l in range(12)}
    ref = tmp_path / "modelopt"
    p = subprocess.run([modelopt_py, str(REPO / "scripts" / "modelopt_export.py"), str(model), str(ref),
                        "--calib-ids", str(ids_path), "--job", "deep", "bf16", *(f"{l}={f}" for l, f in layers.items())],
                       capture_output=True, text=True, timeout=1800, cwd="/tmp")
    assert p.returncode == 0, p.stderr[-2000:]
    ours = tmp_path / "trtmoe"
    U.write_unified_checkpoint(model, ours, U.UnifiedPlan(layers), input_amax=U.measure_input_amax(model, ids))
    q = json.loads((ours / "hf_quant_config.json").read_text())["quantization"]
    assert q == json.loads((ref / "deep" / "hf_quant_config.json").read_text())["quantization"]
    assert "model.layers.1.*" in q["exclude_modules"] and "model.layers.1*" not in q["exclude_modules"]
    eng = load_unified_engine(ours, device="cpu")
    assert torch.isfinite(eng.logits(torch.tensor([ids[0][:16]]))).all()


@pytest.mark.slow
def test_deepseek_v3_experts_match_modelopt(models, calib_ids, modelopt_refs, tmp_path):
    """DeepSeek-V3 in FP8: every tensor ModelOpt writes outside the MLA projections (routed experts per
    expert, shared experts, the first layer's dense MLP, the routers with their float32 correction bias,
    norms) has the same name, dtype, shape and bytes; the MLA projections stay bf16 in trtmoe's export."""
    ids, _ = calib_ids
    model = models["deepseek_v3"]
    ref = modelopt_refs("deepseek_v3", "fp8")
    ours = tmp_path / "trtmoe"
    U.write_unified_checkpoint(model, ours, U.UnifiedPlan.uniform("fp8", moe_layers(model)),
                               input_amax=U.measure_input_amax(model, ids))
    verify_artifact(ours)
    a, b = tensors(ours), tensors(ref)
    mla = [k for k in a if ".self_attn." in k and k.endswith("_proj.weight")]
    assert mla and all(a[k].dtype == torch.bfloat16 for k in mla)
    assert {k for k in b if ".self_attn." not in k} == {k for k in a if ".self_attn." not in k}
    compared = 0
    for k in sorted(k for k in a if ".self_attn." not in k):
        assert (a[k].dtype, tuple(a[k].shape)) == (b[k].dtype, tuple(b[k].shape)), k
        if k.endswith("input_scale"):
            # Activations two transformers releases compute (layer 2's pass two MLA attentions first): within
            # a few bf16 rounding steps.
            assert torch.allclose(a[k], b[k], rtol=2 ** -5, atol=0), (k, a[k].item(), b[k].item())
        else:
            assert torch.equal(bits(a[k]), bits(b[k])), k
            compared += 1
    assert compared > 100
    assert any(k.endswith("mlp.shared_experts.gate_proj.weight_scale") for k in a)
    assert a["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama4_text", "llama4"])
@pytest.mark.parametrize("job", ["bf16", "graded"])
def test_llama4_stacked_experts_match_modelopt(arch, job, models, calib_ids, modelopt_refs, tmp_path):
    """Llama-4's stacked experts unquantized and graded per MoE layer (FP8 in layer 1, NVFP4 in layer 3,
    the rest bf16), for the text model alone and the multimodal release (its vision tower and projector
    kept): every tensor ModelOpt writes, with the same name, dtype, shape and bytes (input scales within
    one bf16 rounding step), and the same quant configs (none for the unquantized export)."""
    ids, _ = calib_ids
    model = models[arch]
    ref = modelopt_refs(arch, job)
    plan = U.UnifiedPlan(LLAMA4_GRADED) if job == "graded" else U.UnifiedPlan({}, {}, {"policy": "per-layer"})
    ours = tmp_path / "trtmoe"
    U.write_unified_checkpoint(model, ours, plan, input_amax=U.measure_input_amax(model, ids) if job == "graded" else None)
    verify_artifact(ours)
    assert_same_tensors(ours, ref)
    if job == "bf16":
        assert not (ours / "hf_quant_config.json").exists() or \
            json.loads((ours / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] is None
        assert not (ref / "hf_quant_config.json").exists()
        return
    qa = json.loads((ours / "hf_quant_config.json").read_text())
    assert qa == json.loads((ref / "hf_quant_config.json").read_text())
    lm = "language_model.model" if arch == "llama4" else "model"
    assert set(qa["quantization"]["quantized_layers"]) == {f"{lm}.layers.1.feed_forward.experts",
                                                          f"{lm}.layers.3.feed_forward.experts"}
    assert (json.loads((ours / "config.json").read_text())["quantization_config"]
            == json.loads((ref / "config.json").read_text())["quantization_config"])


@pytest.mark.slow
def test_llama4_multimodal_keeps_its_towers_as_modelopt_does(models, calib_ids, modelopt_refs, tmp_path):
    """The multimodal release in FP8: the vision tower and projector stay bf16, bit for bit the source's,
    and are excluded as whole subtrees (``vision_model*``, ``multi_modal_projector*``) as ModelOpt writes."""
    ids, _ = calib_ids
    model = models["llama4"]
    ours = tmp_path / "trtmoe"
    U.write_unified_checkpoint(model, ours, U.UnifiedPlan.uniform("fp8", moe_layers(model)),
                               input_amax=U.measure_input_amax(model, ids))
    q = json.loads((ours / "hf_quant_config.json").read_text())["quantization"]
    assert q == json.loads((modelopt_refs("llama4", "fp8") / "hf_quant_config.json").read_text())["quantization"]
    assert {"vision_model*", "multi_modal_projector*", "language_model.lm_head"} <= set(q["exclude_modules"])
    a, src = tensors(ours), tensors(model)
    towers = [k for k in src if k.startswith(("vision_model.", "multi_modal_projector."))]
    assert len(towers) > 10
    for k in towers:
        assert a[k].dtype == src[k].dtype and torch.equal(a[k], src[k]), k
