"""The unified-HF export of the architectures TensorRT-LLM's engine path never had: DeepSeek-V3, gpt-oss,
OLMoE, GLM-4.5, Llama-4's text model (tiny seeded models from transformers' own classes,
scripts/make_tiny_models.py).

What the engines' loaders read is restated here from their sources: TensorRT-LLM
``_torch/models/modeling_gpt_oss.py`` (gpt-oss experts as BF16 ``gate_up_proj`` ``[E, H, 2I]`` with gate and
up interleaved along the last dim, or MXFP4 ``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]`` /
``gate_up_proj_scales`` ``[E, 2I, H/32]`` whose rows interleave gate and up), ``modeling_deepseekv3.py``
(routed experts per expert, ``shared_experts``, ``mlp.gate.e_score_correction_bias``) and Hugging Face
transformers' MXFP4 dequantizer (``integrations/mxfp4.convert_moe_packed_tensors``), used as the
independent reading of the ``_blocks`` / ``_scales`` bytes. Llama-4's stacked experts are read back as
TensorRT-LLM's fused MoE reads them in its ``FUSED_GATE_UP_PROJ`` mode (``_torch/modules/fused_moe/
quantization.py``: expert ``e``'s ``gate_up_proj[e]``, and for NVFP4 ``gate_up_proj_weight_scale[e]``,
transposed to ``[2I, ...]`` and split in half along that first dim, gate first; ``down_proj[e]``
transposed; one ``*_weight_scale`` (FP8) / ``*_weight_scale_2`` (NVFP4) and ``*_input_scale`` for all
experts). ModelOpt's byte-for-byte comparison of OLMoE, DeepSeek-V3 and Llama-4 lives in
test_unified_hf_conformance.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trtmoe.checkpoint import unified_hf as U
from trtmoe.checkpoint.verify import verify_artifact
from trtmoe.errors import UnsupportedError
from trtmoe.quant import formats as QF

from test_unified_hf_conformance import make_llama4_multimodal, tensors

REPO = Path(__file__).resolve().parents[1]




def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "trtmoe.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})


def graded_export(model, calib: Path, out: Path) -> dict:
    """``model`` converted for vLLM on SM100 from the calibration ``calib`` at 6 bits per expert weight:
    the artifact verified, its algorithm one of the graded plan's, its tensors returned."""
    p = run_cli("convert", model, "-o", out, "--target", "vllm", "--sm", "100", "--calib", calib, "--budget", "6")
    assert p.returncode == 0, p.stderr
    verify_artifact(out)
    q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] in ("FP8", "NVFP4", "MIXED_PRECISION")
    return tensors(out)


def assert_unquantized_export_gives_the_source_logits(model, out, dtype=torch.bfloat16, cls=None):
    """The BF16 (unquantized) unified-HF export of ``model`` written to ``out`` and the source, loaded by
    transformers' ``cls`` (AutoModelForCausalLM by default), give bit-identical logits."""
    if cls is None:
        from transformers import AutoModelForCausalLM as cls
    U.write_unified_checkpoint(model, out, U.UnifiedPlan({}, {}, {"policy": "per-layer"}))
    ids = torch.tensor([[3, 17, 5, 42, 9, 11, 2, 8]])
    with torch.no_grad():
        a = cls.from_pretrained(str(model), dtype=dtype).eval()(input_ids=ids).logits
        b = cls.from_pretrained(str(out), dtype=dtype).eval()(input_ids=ids).logits
    assert torch.equal(a, b)


@pytest.fixture(scope="module")
def gpt_oss(tiny_model):
    return tiny_model("gpt_oss", dtype="bfloat16", intermediate_size=64)


@pytest.fixture(scope="module")
def deepseek_v3(tiny_model):
    return tiny_model("deepseek_v3", dtype="bfloat16", moe_intermediate_size=64)


@pytest.fixture(scope="module")
def olmoe(tiny_model):
    return tiny_model("olmoe", dtype="bfloat16", intermediate_size=64)


@pytest.fixture(scope="module")
def deepseek_v2(tiny_model):
    return tiny_model("deepseek_v2", dtype="bfloat16", moe_intermediate_size=64)


@pytest.fixture(scope="module")
def glm4_moe(tiny_model):
    return tiny_model("glm4_moe", dtype="bfloat16", moe_intermediate_size=64)


@pytest.fixture(scope="module")
def llama4_text(tiny_model):
    return tiny_model("llama4_text", dtype="bfloat16", intermediate_size=64)


@pytest.fixture(scope="module")
def llama4(llama4_text, tmp_path_factory):
    return make_llama4_multimodal(llama4_text, tmp_path_factory.mktemp("tiny-llama4"))


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3", "olmoe", "deepseek_v2", "glm4_moe"])
def test_modules_are_found_by_their_hf_names(arch, request):
    model = request.getfixturevalue(arch)
    with U.SourceModel(model) as src:
        assert src.family == arch
        mods = src.modules()
    kinds = {m.name: m.kind for m in mods}
    experts = [m for m in mods if m.kind == "expert"]
    first_dense = arch in ("deepseek_v3", "deepseek_v2", "glm4_moe")
    assert sorted({m.layer for m in experts}) == ([1, 2] if first_dense else [0, 1, 2])
    assert kinds["lm_head"] == "excluded" and kinds["model.embed_tokens"] == "excluded"
    if arch == "gpt_oss":  # stacked [E, in, out] tensors, one module each
        assert {(m.name.rsplit(".", 1)[1], m.stacked, m.shape) for m in experts} == {
            ("gate_up_proj", 4, (128, 64)), ("down_proj", 4, (64, 64))}
        assert kinds["model.layers.0.mlp.router"] == "excluded"
    else:
        assert kinds["model.layers.1.mlp.gate"] == "excluded"
        assert {m.expert_role for m in experts} == {"gate", "up", "down"}
    if arch in ("deepseek_v3", "deepseek_v2"):
        assert kinds["model.layers.1.self_attn.kv_b_proj"] == "mla"
    if arch == "glm4_moe":  # grouped-query attention with biases: an ordinary attention module
        assert kinds["model.layers.1.self_attn.q_proj"] == "attention"
    if first_dense:
        assert kinds["model.layers.1.mlp.shared_experts.up_proj"] == "shared"
        assert kinds["model.layers.0.mlp.gate_proj"] == "dense"


def test_gpt_oss_mxfp4_is_written_as_its_release_and_loaders_read_it(gpt_oss, tmp_path):
    out = tmp_path / "ck"
    r = U.write_unified_checkpoint(gpt_oss, out, U.UnifiedPlan.uniform("mxfp4", [0, 1, 2]))
    verify_artifact(out)
    assert r.manifest["quant_algo"] == "W4A16_MXFP4"
    assert not (out / "hf_quant_config.json").exists()  # the loaders would take it over config.json
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert "model.layers.*.self_attn" in cfg["quantization_config"]["modules_to_not_convert"]
    assert U.read_layer_formats(out) == {"*": U.FORMATS["mxfp4"]}
    a, src = tensors(out), tensors(gpt_oss)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for l in range(3):
        p = f"model.layers.{l}.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):
            w = src[p + proj]  # [E, in, out]
            e, i, o = w.shape
            blocks, scales = a[p + proj + "_blocks"], a[p + proj + "_scales"]
            assert (blocks.dtype, tuple(blocks.shape)) == (torch.uint8, (e, o, i // 32, 16))
            assert (scales.dtype, tuple(scales.shape)) == (torch.uint8, (e, o, i // 32))
            assert p + proj not in a
            # transformers' own dequantizer of the release format reads the bytes back as [E, in, out] ...
            deq = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)
            assert tuple(deq.shape) == (e, i, o)
            # ... equal to the mxfp4 format's rule (the embedded engine's) on the same bytes ...
            mine = torch.stack([QF.FORMATS["mxfp4"].dequantize({"weight": blocks[x].flatten(-2),
                                                               "weight_scale": scales[x]}, dtype=torch.float32)
                                for x in range(e)]).transpose(1, 2)
            assert torch.equal(deq, mine)
            # ... and within one E2M1 step (at most 1 x the block's power of two) of the source weight.
            step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1).transpose(1, 2)
            assert bool(((deq - w.float()).abs() <= step).all())
        # TensorRT-LLM deinterleaves the rows of the fused gate_up blocks: even rows gate, odd rows up, the
        # same order as the BF16 release's columns.
        bu, su = a[p + "gate_up_proj_blocks"], a[p + "gate_up_proj_scales"]
        full = convert_moe_packed_tensors(bu.clone(), su.clone(), dtype=torch.float32)
        for half in (0, 1):
            rows = convert_moe_packed_tensors(bu[:, half::2].clone(), su[:, half::2].clone(), dtype=torch.float32)
            assert torch.equal(rows, full[:, :, half::2])
        for keep in ("gate_up_proj_bias", "down_proj_bias"):
            assert torch.equal(a[p + keep], src[p + keep])
    for k in ("model.layers.1.self_attn.sinks", "model.layers.1.mlp.router.weight", "model.layers.1.mlp.router.bias",
              "model.layers.1.self_attn.q_proj.weight"):
        assert torch.equal(a[k], src[k]), k


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3", "olmoe", "deepseek_v2", "glm4_moe", "llama4_text"])
def test_unquantized_export_runs_in_transformers_as_the_source(arch, request, tmp_path):
    """Every tensor under the name transformers reads: the BF16 export gives the source's logits."""
    assert_unquantized_export_gives_the_source_logits(request.getfixturevalue(arch), tmp_path / "ck")


def test_deepseek_v3_keeps_mla_and_router_and_quantizes_experts_shared_dense(deepseek_v3, tmp_path):
    out = tmp_path / "ck"
    U.write_unified_checkpoint(deepseek_v3, out, U.UnifiedPlan.uniform("nvfp4_w4a16", [1, 2]))
    q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "W4A16_NVFP4" and q["group_size"] == 16
    assert "model.layers.1.self_attn*" in q["exclude_modules"] and "model.layers.1.mlp.gate" in q["exclude_modules"]
    a = tensors(out)
    for k in ("model.layers.1.mlp.experts.3.up_proj", "model.layers.1.mlp.shared_experts.down_proj",
              "model.layers.0.mlp.gate_proj"):
        assert a[k + ".weight"].dtype == torch.uint8 and a[k + ".weight_scale"].dtype == torch.float8_e4m3fn, k
        assert k + ".input_scale" not in a  # weight-only
    for k in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert a[f"model.layers.1.self_attn.{k}.weight"].dtype == torch.bfloat16
    assert a["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    # A fused gate/up pair shares its global scale (TensorRT-LLM fuses w1/w3 into one GEMM).
    assert torch.equal(a["model.layers.2.mlp.experts.5.gate_proj.weight_scale_2"],
                       a["model.layers.2.mlp.experts.5.up_proj.weight_scale_2"])
    with pytest.raises(UnsupportedError, match="MLA"):
        U.write_unified_checkpoint(deepseek_v3, tmp_path / "mla", U.UnifiedPlan({1: "nvfp4_w4a16"}, {"attention": "fp8"}))
    assert not (tmp_path / "mla").exists()


def test_cli_refusals_name_the_cell_and_what_works(gpt_oss, olmoe, tmp_path):
    p = run_cli("convert", gpt_oss, "-o", tmp_path / "g", "--target", "trtllm-pytorch", "--layer-format", "*=nvfp4_w4a16")
    assert p.returncode == 2, p.stderr
    assert "TensorRT-LLM 1.2.1 (PyTorch backend) x gpt-oss x NVFP4 W4A16 x uniform x SM90: refused" in p.stderr
    assert "modeling_gpt_oss.py" in p.stderr and "uniform BF16, MXFP4" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "g").exists()
    p = run_cli("convert", olmoe, "-o", tmp_path / "o", "--target", "trtllm-pytorch", "--layer-format", "*=nvfp4_w4a16")
    assert p.returncode == 2 and "no OLMoE model class" in p.stderr, p.stderr
    p = run_cli("convert", olmoe, "-o", tmp_path / "o", "--target", "sglang", "--layer-format", "*=nvfp4_w4a16")
    assert p.returncode == 0, p.stderr
    verify_artifact(tmp_path / "o")
    p = run_cli("inspect", olmoe, "--target", "trtllm-pytorch", "--format", "fp8")
    assert p.returncode == 3, p.stderr
    assert "x OLMoE x FP8 x uniform x SM90: refused" in p.stderr
    p = run_cli("inspect", gpt_oss, "--target", "vllm", "--format", "mxfp4", "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["support"]["ok"] and rep["unified_hf"]["engines"]["trtllm-1.2.1"].startswith("uniform BF16, MXFP4")


@pytest.mark.parametrize("arch", ["deepseek_v2", "glm4_moe"])
def test_fp8_export_of_the_experts_is_what_the_format_writes(arch, request, tmp_path):
    """Routed and shared experts and dense MLPs in FP8-block weight-only: each expert's tensors are the
    format's own quantization of the source weight, the rest of the model unchanged; the cells name the
    model file each engine reads it with."""
    from trtmoe.checkpoint import unified_support as S
    from trtmoe.quant.formats import get_format

    model = request.getfixturevalue(arch)
    out = tmp_path / "ck"
    U.write_unified_checkpoint(model, out, U.UnifiedPlan.uniform("fp8_block_wo", [1, 2]))
    verify_artifact(out)
    name = "model.layers.2.mlp.experts.3.down_proj"
    with U.SourceModel(model) as src:
        w = src.read(name + ".weight")
    got = {}
    for f in out.glob("model-*.safetensors"):
        with safe_open(str(f), "pt") as st:
            got.update({k: st.get_tensor(k) for k in st.keys() if k.startswith(name + ".")})
    want = get_format("fp8_block_wo").modelopt_export(w, dtype=torch.bfloat16)
    assert set(got) == {f"{name}.{k}" for k in want} and got[name + ".weight"].dtype == torch.float8_e4m3fn
    for k, v in want.items():
        assert torch.equal(got[f"{name}.{k}"].float(), v.float()), k
    cfg = json.loads((out / "hf_quant_config.json").read_text())
    assert "model.layers.1.mlp.gate" in " ".join(cfg["quantization"]["exclude_modules"])
    for engine in ("vllm-0.33", "sglang-0.5"):
        c = S.cell(engine, arch, "fp8", "uniform", 90)
        assert c.ok and ("deepseek_v2.py" if arch == "deepseek_v2" else "glm4_moe.py") in c.source
    trt = S.cell("trtllm-1.2.1", arch, "fp8", "uniform", 90)
    assert trt.ok == (arch == "glm4_moe")


# ---- Llama-4 ---------------------------------------------------------------------------------------

def test_llama4_modules_are_found_by_their_hf_names(llama4_text):
    """MoE every second layer (1, 3): each projection's experts one ``[E, in, out]`` stack, the router kept,
    the shared expert its own decision; layers 0 and 2 hold a dense MLP."""
    with U.SourceModel(llama4_text) as src:
        assert src.family == "llama4_text"
        mods = src.modules()
    kinds = {m.name: m.kind for m in mods}
    experts = [m for m in mods if m.kind == "expert"]
    assert {(m.layer, m.name.rsplit(".", 1)[1], m.stacked, m.shape, m.layout, m.group) for m in experts} == {
        (l, proj, 4, shape, "llama4", f"model.layers.{l}.feed_forward.experts")
        for l in (1, 3) for proj, shape in (("gate_up_proj", (128, 64)), ("down_proj", (64, 64)))}
    assert kinds["model.layers.1.feed_forward.router"] == "excluded"
    assert kinds["model.layers.1.feed_forward.shared_expert.gate_proj"] == "shared"
    assert kinds["model.layers.0.feed_forward.gate_proj"] == "dense"
    assert kinds["model.layers.1.self_attn.q_proj"] == "attention"
    assert kinds["lm_head"] == "excluded" and kinds["model.embed_tokens"] == "excluded"


def _llama4_read_as_trtllm(a: dict, prefix: str, e: int, fmt: str) -> dict[str, torch.Tensor]:
    """Expert ``e`` of a stack as TensorRT-LLM's FUSED_GATE_UP_PROJ loading takes it: w1 (gate), w3 (up) and
    w2 (down) as ``[out, in]`` matrices in the format's own tensors, the per-tensor scales shared."""
    out = {}
    for proj, names in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
        w = a[prefix + proj][e].transpose(0, 1)
        parts = w.chunk(2, dim=0) if len(names) == 2 else (w,)
        scale = a.get(prefix + proj + "_weight_scale")
        if fmt.startswith("nvfp4"):
            blocks = scale[e].transpose(0, 1)
            bparts = blocks.chunk(2, dim=0) if len(names) == 2 else (blocks,)
            for n, q, b in zip(names, parts, bparts):
                out[n] = {"weight": q.contiguous(), "weight_scale": b.contiguous(),
                          "weight_scale_2": a[prefix + proj + "_weight_scale_2"]}
        else:
            for n, q in zip(names, parts):
                out[n] = {"weight": q.contiguous(), "weight_scale": scale}
    return out


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "nvfp4_w4a16"])
def test_llama4_stacked_experts_read_back_as_the_engines_split_them(fmt, llama4_text, tmp_path):
    """Each expert's gate, up and down, taken from the stacks the way TensorRT-LLM's fused MoE splits
    them, dequantize (by the format's rule) to the source's gate / up / down within one step of the format,
    and the per-tensor scales are the stack's (one amax over every expert, gate and up together)."""
    out = tmp_path / "ck"
    ids = [[3, 17, 5, 42, 9, 11, 2, 8] * 4]
    amax = U.measure_input_amax(llama4_text, ids) if U.FORMATS[fmt].activations else None
    U.write_unified_checkpoint(llama4_text, out, U.UnifiedPlan({1: fmt, 3: fmt}), input_amax=amax)
    verify_artifact(out)
    a, src = tensors(out), tensors(llama4_text)
    f = QF.FORMATS[fmt]
    for l in (1, 3):
        p = f"model.layers.{l}.feed_forward.experts."
        gu, dn = src[p + "gate_up_proj"].float(), src[p + "down_proj"].float()  # [E, H, 2I], [E, I, H]
        inter = dn.shape[1]
        if fmt == "fp8":
            assert a[p + "gate_up_proj_weight_scale"].shape == ()
            assert torch.equal(a[p + "gate_up_proj_weight_scale"], gu.abs().amax() / 448)
        else:
            assert torch.equal(a[p + "gate_up_proj_weight_scale_2"], gu.abs().amax() / (6 * 448))
        assert (p + "gate_up_proj_input_scale" in a) == U.FORMATS[fmt].activations
        if amax:
            assert a[p + "down_proj_input_scale"].item() == pytest.approx(amax[p + "down_proj"] / 448
                                                                          / (6 if fmt == "nvfp4" else 1), rel=1e-6)
        for e in range(gu.shape[0]):
            want = {"w1": gu[e, :, :inter].T, "w3": gu[e, :, inter:].T, "w2": dn[e].T}
            for n, t in _llama4_read_as_trtllm(a, p, e, fmt).items():
                got = f.dequantize(t, dtype=torch.float32)
                assert got.shape == want[n].shape, (l, e, n)
                if fmt == "fp8":  # half an E4M3 step (2**-4 relative) of the scale's grid
                    step = want[n].abs() * 2 ** -4 + t["weight_scale"] * 2 ** -9
                else:  # half the largest E2M1 step (2) times the block's scale
                    bs = (t["weight_scale"].float() * t["weight_scale_2"]).repeat_interleave(16, dim=-1)
                    step = bs * 1.0 + 1e-6
                assert bool(((got - want[n]).abs() <= step + want[n].abs() * 2 ** -8).all()), (l, e, n)


def test_llama4_dequantized_export_runs_in_transformers(llama4_text, tmp_path):
    """An NVFP4-expert export, dequantized back to bf16 stacks under the source's names, loads in
    transformers and gives the source's next tokens on most positions (a transposed or mis-split stack
    would not)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ck"
    U.write_unified_checkpoint(llama4_text, out, U.UnifiedPlan({1: "nvfp4_w4a16", 3: "nvfp4_w4a16"}))
    a = tensors(out)
    f = QF.FORMATS["nvfp4_w4a16"]
    state = {}
    for k, t in a.items():
        if k.endswith(("_weight_scale", "_weight_scale_2")):
            continue
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stack = [f.dequantize({"weight": t[e].T.contiguous(), "weight_scale": a[k + "_weight_scale"][e].T.contiguous(),
                                   "weight_scale_2": a[k + "_weight_scale_2"]}, dtype=torch.float32).T
                     for e in range(t.shape[0])]
            state[k] = torch.stack(stack).to(torch.bfloat16).contiguous()
        else:
            state[k] = t
    deq = tmp_path / "deq"
    deq.mkdir()
    save_file(state, str(deq / "model.safetensors"), metadata={"format": "pt"})
    (deq / "config.json").write_text((llama4_text / "config.json").read_text())
    ids = torch.tensor([[3, 17, 5, 42, 9, 11, 2, 8, 100, 7, 64, 33, 12, 200, 150, 1]])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(llama4_text), dtype=torch.bfloat16).eval()(ids).logits.float()
        got = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.bfloat16).eval()(ids).logits.float()
    assert not torch.equal(ref, got)  # the experts were quantized
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0)
    assert cos > 0.99, cos
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() >= 0.75


def test_llama4_refusals_name_the_cell_and_the_formats_written(llama4_text, tmp_path):
    with pytest.raises(UnsupportedError, match="BF16, FP8, NVFP4 or NVFP4 W4A16"):
        U.write_unified_checkpoint(llama4_text, tmp_path / "m", U.UnifiedPlan({1: "mxfp4"}))
    assert not (tmp_path / "m").exists()
    p = run_cli("convert", llama4_text, "-o", tmp_path / "t", "--target", "trtllm-pytorch", "--layer-format", "*=nvfp4_w4a16")
    assert p.returncode == 2 and "x Llama-4 (text only) x NVFP4 W4A16 x uniform x SM90: refused" in p.stderr, p.stderr
    assert "text_config" in p.stderr and "modeling_llama.py" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("convert", llama4_text, "-o", tmp_path / "v", "--target", "vllm", "--layer-format", "3=int8")
    assert p.returncode == 2 and "x Llama-4 (text only) x W8A16 x uniform x SM90: refused" in p.stderr, p.stderr
    p = run_cli("convert", llama4_text, "-o", tmp_path / "v", "--target", "vllm", "--layer-format", "*=nvfp4_w4a16")
    assert p.returncode == 0, p.stderr
    verify_artifact(tmp_path / "v")
    q = json.loads((tmp_path / "v" / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "W4A16_NVFP4"
    assert q["exclude_modules"] == ["lm_head", "model.embed_tokens", "model.layers.1.feed_forward.router",
                                    "model.layers.3.feed_forward.router"]


def test_llama4_streamed_calibration_gives_the_stacks_input_scales_and_a_graded_plan(tiny_model, tmp_path):
    """A layer-streamed calibration of the tiny Llama-4 records each MoE layer's expert input amax at the
    seam (the router-scaled input, and the intermediate) equal to what the export measures in transformers
    on the same tokens; a budgeted convert for vLLM then writes the stacks' input scales from it."""
    from test_calibrate_stream import _tiny
    from test_quant_pipeline import make_tokenizer

    from trtmoe.build.unified_hf import calib_input_amax
    from trtmoe.data import load_texts, write_split_text
    from trtmoe.quant.calibrate import calibrate, token_batches
    from trtmoe.runtime.load import load_tokenizer

    tokdir = make_tokenizer(tmp_path / "tok")
    text = tmp_path / "calib.txt"
    write_split_text("calib", text, max_bytes=12_000)
    model = _tiny(tiny_model, "llama4_text", tokdir, tmp_path)
    samples, seq_len = 4, 24
    res = calibrate(model, text, tmp_path / "c", samples=samples, seq_len=seq_len, formats=("fp8", "nvfp4"),
                    rounding="rtn", batch_size=2, runner="stream")
    assert sorted(map(int, res["input_amax"])) == [1, 3]
    tok = load_tokenizer(tokdir)
    tok.add_bos = True
    ids = token_batches(load_texts(text), tok, samples, seq_len).tolist()
    measured = {k: v for k, v in U.measure_input_amax(model, ids).items() if ".experts." in k}
    from_calib = calib_input_amax(model, res)
    assert sorted(from_calib) == sorted(measured) == [f"model.layers.{l}.feed_forward.experts.{p}"
                                                      for l in (1, 3) for p in ("down_proj", "gate_up_proj")]
    for k in measured:
        assert from_calib[k] == pytest.approx(measured[k], rel=2 ** -7), k
    a = graded_export(model, tmp_path / "c", tmp_path / "u")
    for k, v in from_calib.items():
        if k + "_input_scale" in a:
            div = 448 * (6 if a[k].dtype == torch.uint8 else 1)
            assert a[k + "_input_scale"].item() == pytest.approx(v / div, rel=1e-6), k


def test_llama4_multimodal_exports_its_text_model_and_keeps_the_towers(llama4, tmp_path):
    """The released form: the same stacks under ``language_model.``, the towers kept; its BF16 export runs
    in transformers' own class with the source's logits, and TensorRT-LLM's cell (which refuses the
    text-only form) takes it uniform, naming the model file and the fused-MoE loader."""
    from transformers import Llama4ForConditionalGeneration

    from trtmoe.checkpoint import unified_support as S

    with U.SourceModel(llama4) as src:
        assert src.family == "llama4"
        mods = {m.name: m for m in src.modules()}
    assert mods["language_model.model.layers.3.feed_forward.experts.gate_up_proj"].layout == "llama4"
    assert mods["vision_model.model.layers.0.self_attn.q_proj"].kind == "excluded"
    assert mods["multi_modal_projector.linear_1"].kind == "excluded"
    assert_unquantized_export_gives_the_source_logits(llama4, tmp_path / "bf16", cls=Llama4ForConditionalGeneration)
    c = S.cell("trtllm-1.2.1", "llama4", "fp8", "uniform", 90)
    assert c.status == S.SUPPORTED and "modeling_llama.py" in c.source and "quantization.py" in c.source
    assert not S.cell("trtllm-1.2.1", "llama4_text", "fp8", "uniform", 90).ok
    assert not S.cell("trtllm-1.4", "llama4", "fp8", "mixed", 90).ok
    p = run_cli("convert", llama4, "-o", tmp_path / "t", "--target", "trtllm-pytorch", "--layer-format", "*=nvfp4_w4a16")
    assert p.returncode == 0, p.stderr
    verify_artifact(tmp_path / "t")
    q = json.loads((tmp_path / "t" / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "W4A16_NVFP4" and "vision_model*" in q["exclude_modules"]
    got = tensors(tmp_path / "t")
    assert got["language_model.model.layers.1.feed_forward.experts.gate_up_proj"].shape == (4, 32, 128)
    assert got["vision_model.model.layers.0.mlp.fc1.weight"].dtype == torch.bfloat16


# ---- transformers MoEs without a support-table row -------------------------------------------------

@pytest.mark.parametrize("arch,kinds", [
    ("dots1", {"attention": 12, "shared": 6, "dense": 3}),  # q/k/v/o attention, one shared expert, dense layer 0
    ("lfm2_moe", {"dense": 3}),  # attention's out_proj and the short convolutions: kept in the model dtype
    ("jamba", {"attention": 8, "dense": 6}),  # the Mamba mixers kept; dense MLPs in the layers without experts
    # The hub's shared_expert is transformers' shared_experts once loaded: its input amax is measured under
    # the module's own name and found under the hub's. Gated attention (g_proj): attention kept.
    ("laguna", {"shared": 6, "dense": 3}),
])
def test_transformers_moe_without_a_row_is_read_by_name(arch, kinds, tiny_model, tmp_path):
    """A MoE outside the registry and the rows whose experts are stored one linear per expert is exported by
    its Hugging Face names: routed experts (gate_proj/up_proj/down_proj or w1/w3/w2), shared experts, dense MLPs
    and plain q/k/v/o attention quantizable, every other linear (routers, convolutions, Mamba) kept. Unquantized
    it gives the source's logits in transformers; in FP8 each cell is unlisted, saying why."""
    import fnmatch
    from collections import Counter

    from trtmoe.checkpoint import unified_support as S

    model = tiny_model(arch, dtype="bfloat16")
    with U.SourceModel(model) as src:
        mods = src.modules()
        assert src.family == S.GENERIC
    count = Counter(m.kind for m in mods)
    moe = sorted({m.layer for m in mods if m.kind == "expert"})
    assert count["expert"] == 3 * 8 * len(moe) and {k: count[k] for k in kinds} == kinds
    assert {m.expert_role for m in mods if m.kind == "expert"} == {"gate", "up", "down"}
    assert all(m.kind == "excluded" for m in mods if m.name.endswith(("gate", "router", "router.gate")))
    assert_unquantized_export_gives_the_source_logits(model, tmp_path / "bf16", dtype=torch.float32)
    (tmp_path / "ids.json").write_text(json.dumps([[3, 17, 5, 42, 9, 11, 2, 8], [1, 4, 4, 7, 120, 33]]))
    p = run_cli("convert", model, "-o", tmp_path / "fp8", "--target", "vllm", "--layer-format", "*=fp8",
                "--calib-ids", tmp_path / "ids.json")
    assert p.returncode == 0, p.stderr
    assert "x other transformers MoE x FP8 x uniform x SM90: unlisted: the support table has no row" in \
        " ".join((p.stdout + p.stderr).split())
    verify_artifact(tmp_path / "fp8")
    q = json.loads((tmp_path / "fp8" / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8"
    excluded = lambda name: any(fnmatch.fnmatchcase(name, pat) for pat in q["exclude_modules"])  # noqa: E731
    assert all(excluded(m.name) == (m.kind == "excluded") for m in mods)
    got = tensors(tmp_path / "fp8")
    for m in mods:
        quantized = m.kind != "excluded"
        assert (got[m.name + ".weight"].dtype == torch.float8_e4m3fn) == quantized, m.name
        assert (m.name + ".input_scale" in got) == quantized, m.name
    p = run_cli("convert", model, "-o", tmp_path / "mixed", "--target", "trtllm-pytorch", "--layer-format",
                f"{moe[0]}=fp8", "--layer-format", f"{moe[-1]}=nvfp4", "--calib-ids", tmp_path / "ids.json", "--sm", "100")
    assert p.returncode == 2 and "MIXED_PRECISION" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_experts_without_a_gate_get_their_input_amax_measured(tiny_model, tmp_path):
    """Nemotron-H's routed experts are up_proj / down_proj (relu², no gate), 3-D at transformers' experts seam:
    an FP8 export measures both matrices' inputs there (the layer input and act(x·upᵀ)) and gives every expert
    linear its input scale."""
    model = tiny_model("nemotron_h", dtype="bfloat16")
    (tmp_path / "ids.json").write_text(json.dumps([[3, 17, 5, 42, 9, 11, 2, 8], [1, 4, 4, 7, 120, 33]]))
    p = run_cli("convert", model, "-o", tmp_path / "fp8", "--target", "vllm", "--layer-format", "*=fp8",
                "--calib-ids", tmp_path / "ids.json")
    assert p.returncode == 0, p.stderr
    got = tensors(tmp_path / "fp8")
    experts = [k[:-len(".weight")] for k in got if ".experts." in k and k.endswith(".weight")
               and ".shared_experts." not in k]
    assert len(experts) == 16 and {e.rsplit(".", 1)[1] for e in experts} == {"up_proj", "down_proj"}
    for e in experts:
        assert got[e + ".weight"].dtype == torch.float8_e4m3fn and float(got[e + ".input_scale"]) > 0, e
    assert len({float(got[e + ".input_scale"]) for e in experts if e.endswith("up_proj")}) == 1  # one per layer
    verify_artifact(tmp_path / "fp8")


def test_transformers_moe_without_a_row_takes_a_graded_plan_from_its_streamed_calibration(tiny_model, tmp_path):
    """dots.llm1 calibrated layer-streamed, then a budgeted convert for vLLM: a per-layer plan over the measured
    formats, the experts' input scales from the calibration."""
    from test_calibrate_stream import _tiny
    from test_quant_pipeline import make_tokenizer

    from trtmoe.build.unified_hf import calib_input_amax
    from trtmoe.data import write_split_text
    from trtmoe.quant.calibrate import calibrate

    tokdir = make_tokenizer(tmp_path / "tok")
    text = tmp_path / "calib.txt"
    write_split_text("calib", text, max_bytes=12_000)
    model = _tiny(tiny_model, "dots1", tokdir, tmp_path)
    res = calibrate(model, text, tmp_path / "c", samples=4, seq_len=24, formats=("fp8", "nvfp4"), rounding="rtn",
                    batch_size=2, runner="stream")
    assert res["moe_layers"] == [1, 2]
    a = graded_export(model, tmp_path / "c", tmp_path / "u")
    amax = calib_input_amax(model, res)
    assert sorted({k.rsplit(".", 2)[0] for k in amax}) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    for k, v in amax.items():
        div = 448 * (6 if a[k + ".weight"].dtype == torch.uint8 else 1)
        assert a[k + ".input_scale"].item() == pytest.approx(v / div, rel=1e-6), k


def test_a_failing_transformers_forward_is_one_line_when_input_amax_is_measured(tiny_model, monkeypatch):
    """The input amax is measured by running transformers' own model: an error there (a modelling-code bug, a
    configuration it cannot run) is refused as an input error naming the class, not an internal error."""
    import transformers

    from trtmoe.errors import InputError

    def broken(self, *a, **k):
        raise ValueError("cannot run this configuration\nsecond line")
    monkeypatch.setattr(transformers.Dots1ForCausalLM, "forward", broken)
    with pytest.raises(InputError, match=r"transformers' forward of Dots1ForCausalLM failed while the input amax "
                                         r"was measured \(ValueError: cannot run this configuration\) \(a weight-only"):
        U.measure_input_amax(tiny_model("dots1", dtype="bfloat16"), [[3, 4, 5]])
