"""The embedded engine loads a unified-HF checkpoint (trtmoe's export, and NVIDIA ModelOpt 0.47's own) from
its packed bytes (``trtmoe.runtime.unified_load``), and ``trtmoe run`` runs one.

References, each built another way than the loader builds its engine:

* weight-only formats (W8A16, MXFP4, FP8 blocks; and bf16): the checkpoint's weights dequantized by the
  writer's own numerics (``checkpoint.unified_hf.UnifiedFormat.dequantize``) into a float32 Hugging Face
  checkpoint, converted to a TensorRT-LLM checkpoint and run by the engine's float path. The products
  are the same float32 products of the same float32 weights, so the logits are equal bit for bit.
* formats that quantize activations (FP8, NVFP4): the source model's float engine with every quantized
  linear replaced by one the engine's format classes (``trtmoe.quant.formats``) quantize from the source
  weights, with the same input amax; the loader must give the same logits, bit for bit.
* ModelOpt's export of the same model (its own environment, a subprocess; skipped when absent): its
  tensors equal trtmoe's except the input scales (its calibration runs in another transformers release:
  one bf16 rounding step apart), so the weight-only formats give equal logits, and the activation formats
  equal logits once ModelOpt's input scales are put into trtmoe's checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trtmoe.checkpoint import unified_hf as U
from trtmoe.checkpoint.writer import convert
from trtmoe.errors import CheckpointError, UnsupportedError
from trtmoe.hf.reader import HFCheckpoint
from trtmoe.quant.formats import FORMATS as QFORMATS
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams
from trtmoe.runtime.experts import PackedExperts, PackedShard
from trtmoe.runtime.load import load_engine
from trtmoe.runtime.unified_load import QuantLinear, SplitExperts, load_unified_engine

from test_unified_hf_conformance import tensors

REPO = Path(__file__).resolve().parents[1]
WIDTH = {"mixtral": {"intermediate_size": 64}, "qwen3_moe": {"moe_intermediate_size": 64},
         "qwen2_moe": {"moe_intermediate_size": 64}, "deepseek_v1": {"moe_intermediate_size": 64},
         "phimoe": {"intermediate_size": 64}}
# Every weight-only format on the three architectures TensorRT-LLM's PyTorch backend runs; W8A16 on the
# other two the registry knows (DeepSeek-MoE v1: dense layer and shared experts; Phi-3.5-MoE: LayerNorm,
# biases, sparse-mixer routing, LongRoPE).
WEIGHT_ONLY = [(a, f) for a in ("mixtral", "qwen3_moe", "qwen2_moe") for f in ("bf16", "int8", "mxfp4", "fp8_block_wo")] \
    + [("deepseek_v1", "int8"), ("phimoe", "int8")]


@pytest.fixture(scope="module")
def ids() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(250) for _ in range(32)] for _ in range(4)]


def moe_layers(model: Path) -> list[int]:
    with HFCheckpoint(model) as ck:
        return [l for l, m in enumerate(ck.model.moe_layers) if m]


def logits(eng: EmbeddedEngine, ids) -> torch.Tensor:
    with torch.inference_mode():
        return eng.logits(torch.tensor(ids)).float()


def dequantized_copy(ck: Path, out: Path) -> Path:
    """A float32 HF checkpoint holding ``ck``'s weights as the writer's numerics dequantize them."""
    out.mkdir(parents=True)
    t = tensors(ck)
    q = json.loads((ck / "hf_quant_config.json").read_text())["quantization"]
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["quantization_config"]
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    res = {}
    for k, v in t.items():
        mod, _, suffix = k.rpartition(".")
        if suffix in ("weight_scale", "weight_scale_2", "input_scale"):
            continue
        if suffix != "weight" or f"{mod}.weight_scale" not in t:
            res[k] = v.float()
            continue
        if q["quant_algo"] == "MIXED_PRECISION":
            hit = max((p for p in q["quantized_layers"] if mod.startswith(p + ".") or mod == p), key=len)
            fmt = U.format_for_algo(q["quantized_layers"][hit]["quant_algo"])
        else:
            fmt = U.format_for_algo(q["quant_algo"])
        parts = {s[len(mod) + 1:]: x for s, x in t.items() if s.startswith(mod + ".") and s.count(".") == k.count(".")}
        res[k] = fmt.dequantize(parts).float().contiguous()
    save_file(res, str(out / "model.safetensors"))
    return out


# ---- trtmoe's own export -------------------------------------------------------------------------

@pytest.mark.parametrize("arch,fmt", WEIGHT_ONLY)
def test_weight_only_export_runs_its_dequantized_weights_exactly(arch, fmt, tiny_model, ids, tmp_path):
    model = tiny_model(arch, dtype="bfloat16", **WIDTH[arch])
    ck = tmp_path / "unified"
    U.write_unified_checkpoint(model, ck, U.UnifiedPlan.uniform(fmt, moe_layers(model)), shard_bytes=60_000)
    eng = load_engine(ck, "cpu")  # dispatches on the checkpoint kind
    quantized = fmt != "bf16"
    assert isinstance(eng.layers[0].attn.wqkv, QuantLinear) == quantized
    assert isinstance(eng.layers[-1].experts, (PackedExperts, SplitExperts)) == quantized
    ref_dir = tmp_path / "ref_trtllm"
    convert(dequantized_copy(ck, tmp_path / "dequantized"), ref_dir)
    ref = EmbeddedEngine.from_checkpoint(ref_dir, device="cpu")
    got, want = logits(eng, ids), logits(ref, ids)
    assert torch.equal(got, want), float((got - want).abs().max())
    # Generation runs through the same contract as a TensorRT-LLM checkpoint's engine.
    p = SamplingParams(max_new_tokens=6)
    assert eng.generate(ids[0][:8], p) == ref.generate(ids[0][:8], p)


def _reference_engine(model: Path, tmp_path: Path, plan: U.UnifiedPlan, amax: dict[str, float]) -> EmbeddedEngine:
    """The source model's float engine with each linear ``plan`` quantizes replaced by one that
    ``trtmoe.quant.formats`` quantizes from the source weights (fused groups sharing the weight amax
    where the writer shares it), running the format's ``linear``."""
    convert(model, tmp_path / "src_trtllm")
    eng = EmbeddedEngine.from_checkpoint(tmp_path / "src_trtllm", device="cpu", pack_experts=False)
    hf = HFCheckpoint(model)
    ad, dt = hf.adapter, torch.bfloat16
    mods = {m.name: m for m in U.classify(hf)}

    def group(names: list[str], kind: str):
        fmt = plan.format_of(mods[names[0][:-7]])
        if fmt.quant_algo is None:
            return None
        q = QFORMATS[fmt.name]
        ws = [hf.read(n).to(dt) for n in names]
        if len(ws) > 1 and fmt.shares_amax(kind):
            packed = [q.quantize(torch.cat(ws), dtype=dt, input_amax=amax.get(names[0][:-7]))]
        else:
            packed = [q.quantize(w, dtype=dt, input_amax=amax.get(n[:-7])) for w, n in zip(ws, names)]
        return lambda x: torch.cat([q.linear(x, p) for p in packed], -1)

    for l, lay in enumerate(eng.layers):
        qkv = group([ad.name(r, l) for r in ("q", "k", "v")], "attention")
        o = group([ad.name("o", l)], "attention")
        lay.attn.wqkv = qkv or lay.attn.wqkv
        lay.attn.wo = o or lay.attn.wo
        if lay.experts is None:
            continue
        names = {r: ad.name(f"expert_{r}", l, 0)[:-7] for r in ("gate", "up", "down")}
        fmt = plan.format_of(mods[names["gate"]])
        if fmt.quant_algo is None:
            continue
        q = QFORMATS[fmt.name]
        base = lay.experts
        shards = []
        for e in range(eng.cfg.num_experts):
            w = base.row_major(e)
            shards.append([PackedShard(q, q.quantize(w["fc"], dtype=dt, input_amax=amax[names["up"]]),
                                       q, q.quantize(w["proj"], dtype=dt, input_amax=amax[names["down"]]))])
        lay.experts = PackedExperts(shards, [q.name] * len(shards))
    hf.close()
    return eng


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("plan", ["fp8", "nvfp4", "w4a8_awq", "graded"])
def test_activation_formats_equal_the_engines_own_quantization(arch, plan, tiny_model, ids, tmp_path):
    # W4A8-AWQ groups 128 input channels: its model is 128 wide (hidden and expert FFN).
    wide = {"hidden_size": 128, "head_dim": 32, next(iter(WIDTH[arch])): 128} if plan == "w4a8_awq" else {}
    model = tiny_model(arch, dtype="bfloat16", **{**WIDTH[arch], **wide})
    layers = moe_layers(model)
    up = (U.UnifiedPlan({layers[0]: "nvfp4", layers[1]: "fp8", layers[2]: "bf16"}, {"attention": "fp8"})
          if plan == "graded" else U.UnifiedPlan.uniform(plan, layers))
    amax = U.measure_input_amax(model, ids)
    ck = tmp_path / "unified"
    U.write_unified_checkpoint(model, ck, up, input_amax=amax)
    q = json.loads((ck / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == ("MIXED_PRECISION" if plan == "graded" else up.used().pop().upper())
    eng = load_unified_engine(ck, device="cpu")
    ref = _reference_engine(model, tmp_path, up, amax)
    got, want = logits(eng, ids), logits(ref, ids)
    assert torch.equal(got, want), float((got - want).abs().max())
    # And not the float model's: the activations and weights really were quantized.
    flt = logits(EmbeddedEngine.from_checkpoint(tmp_path / "src_trtllm", device="cpu"), ids)
    assert not torch.allclose(got, flt, atol=1e-3)


def test_pack_experts_off_and_cpu_activations_model_load_too(tiny_model, ids, tmp_path):
    model = tiny_model("mixtral", dtype="bfloat16", **WIDTH["mixtral"])
    U.write_unified_checkpoint(model, tmp_path / "ck", U.UnifiedPlan.uniform("mxfp4", moe_layers(model)))
    a = logits(load_unified_engine(tmp_path / "ck", device="cpu"), ids)
    b = logits(load_unified_engine(tmp_path / "ck", device="cpu", pack_experts=False), ids)
    assert torch.equal(a, b)
    c = logits(load_unified_engine(tmp_path / "ck", device="cpu", cpu_activations="model"), ids)
    assert (c.argmax(-1) == a.argmax(-1)).float().mean() > 0.9  # bfloat16 activations: close, not equal


def _edit(ck: Path, out: Path, **quant) -> Path:
    shutil.copytree(ck, out)
    f = out / "hf_quant_config.json"
    q = json.loads(f.read_text())
    q["quantization"].update(quant)
    f.write_text(json.dumps(q))
    return out


def test_what_the_engine_cannot_run_is_refused_by_name(tiny_model, tmp_path):
    model = tiny_model("mixtral", dtype="bfloat16", **WIDTH["mixtral"])
    ck = tmp_path / "ck"
    U.write_unified_checkpoint(model, ck, U.UnifiedPlan.uniform("int8", moe_layers(model)))
    with pytest.raises(UnsupportedError, match="kv_cache_quant_algo 'FP8'"):
        load_unified_engine(_edit(ck, tmp_path / "kv", kv_cache_quant_algo="FP8"), device="cpu")
    with pytest.raises(UnsupportedError, match="quant_algo 'W4A16_AWQ' is not one the embedded engine runs"):
        load_unified_engine(_edit(ck, tmp_path / "awq", quant_algo="W4A16_AWQ"), device="cpu")
    # A config saying FP8 over W8A16 tensors: the missing input scale is named.
    with pytest.raises(CheckpointError, match="is FP8 but has no input_scale"):
        load_unified_engine(_edit(ck, tmp_path / "lies", quant_algo="FP8"), device="cpu")
    # The lm_head quantized (a MIXED entry naming it): refused, not run in float.
    bad = _edit(ck, tmp_path / "head", quant_algo="MIXED_PRECISION",
                quantized_layers={"lm_head": {"quant_algo": "W8A16"}})
    with pytest.raises(UnsupportedError, match="runs the lm head unquantized"):
        load_unified_engine(bad, device="cpu")


def test_trtmoe_run_generates_from_a_unified_checkpoint(tmp_path):
    fixture = REPO / "tests" / "fixtures" / "trained_mixtral"
    if not (fixture / "model.safetensors").is_file():
        pytest.skip("the trained Mixtral fixture is not checked out")
    ck = tmp_path / "ck"
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "trtmoe.cli", "convert", str(fixture), "-o", str(ck), "--target",
                        "trtllm-pytorch", "--layer-format", "*=mxfp4"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-m", "trtmoe.cli", "run", str(ck), "-p", "def main(", "-n", "12", "--json"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)[0]
    eng = load_engine(ck, "cpu")
    from trtmoe.runtime.load import load_tokenizer

    tok = load_tokenizer(ck)
    assert out["output_ids"] == eng.generate(tok.encode("def main("), SamplingParams(max_new_tokens=12, end_id=tok.eos_id))
    assert len(out["output_ids"]) == 12 and out["text"]


# ---- ModelOpt's own export -----------------------------------------------------------------------

MO_FORMATS = ("fp8", "nvfp4", "int8", "mxfp4", "fp8_block_wo")
GRADED = {0: "fp8", 1: "nvfp4", 2: "bf16"}


@pytest.fixture(scope="module")
def modelopt_exports(modelopt_py, tiny_model, ids, tmp_path_factory):
    """``export(arch)``: the folder of ModelOpt's exports of the tiny model (one job per format, and the
    graded MIXED_PRECISION one), made by one ModelOpt process per architecture."""
    done: dict[str, Path] = {}

    def export(arch: str) -> tuple[Path, Path]:
        model = tiny_model(arch, dtype="bfloat16", **WIDTH[arch])
        if arch not in done:
            out = tmp_path_factory.mktemp(f"mo_{arch}")
            ids_path = out / "ids.json"
            ids_path.write_text(json.dumps(ids))
            argv = [modelopt_py, str(REPO / "scripts" / "modelopt_export.py"), str(model), str(out),
                    "--calib-ids", str(ids_path)]
            for f in MO_FORMATS:
                argv += ["--job", f, f]
            argv += ["--job", "graded", "bf16", *(f"{l}={f}" for l, f in GRADED.items())]
            p = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd="/tmp")
            assert p.returncode == 0, p.stderr[-2000:]
            done[arch] = out
        return model, done[arch]

    return export


def _with_input_scales(ck: Path, source: Path, out: Path) -> Path:
    """``ck`` with every ``input_scale`` taken from ``source`` (one shard, the same config files)."""
    out.mkdir()
    for name in ("config.json", "hf_quant_config.json"):
        shutil.copyfile(ck / name, out / name)
    t, s = tensors(ck), tensors(source)
    assert {k for k in t if k.endswith("input_scale")} == {k for k in s if k.endswith("input_scale")}
    save_file({k: (s[k] if k.endswith("input_scale") else v).contiguous() for k, v in t.items()},
              str(out / "model.safetensors"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("job", [*MO_FORMATS, "graded"])
def test_modelopt_export_loads_to_the_same_logits_as_trtmoes(arch, job, modelopt_exports, ids, tmp_path):
    model, mo = modelopt_exports(arch)
    theirs = mo / job
    layers = moe_layers(model)
    plan = U.UnifiedPlan(GRADED) if job == "graded" else U.UnifiedPlan.uniform(job, layers)
    amax = U.measure_input_amax(model, ids) if any(U.get_format(f).activations for f in plan.used()) else None
    ours = tmp_path / "trtmoe"
    U.write_unified_checkpoint(model, ours, plan, input_amax=amax)
    a = logits(load_unified_engine(theirs, device="cpu"), ids)
    if amax is None:
        b = logits(load_unified_engine(ours, device="cpu"), ids)
    else:  # the two calibrations' input scales differ by a bf16 rounding step: take ModelOpt's
        b = logits(load_unified_engine(_with_input_scales(ours, theirs, tmp_path / "same_scales"), device="cpu"), ids)
    assert torch.equal(a, b), float((a - b).abs().max())


# ---- the llmapi repository on CPU ----------------------------------------------------------------

FIXTURE = REPO / "tests" / "fixtures" / "trained_mixtral"


@pytest.fixture(scope="module")
def llmapi_repo(tmp_path_factory):
    """trtmoe's unified-HF export of the trained Mixtral fixture (MXFP4 experts and attention) and the
    llmapi repository ``trtmoe repo`` writes for it (upstream's layout: config.pbtxt and model.yaml)."""
    if not (FIXTURE / "model.safetensors").is_file():
        pytest.skip("the trained Mixtral fixture is not checked out")
    from trtmoe.build.unified_hf import write_llmapi_repository

    root = tmp_path_factory.mktemp("llmapi_unified")
    ck = root / "ck"
    U.write_unified_checkpoint(FIXTURE, ck, U.UnifiedPlan.uniform("mxfp4", moe_layers(FIXTURE)))
    write_llmapi_repository(ck, root / "repo", build={"max_batch_size": 4, "max_seq_len": 256})
    return ck, root / "repo"


def test_llmapi_repository_runs_the_embedded_engine_in_process(llmapi_repo, tmp_path):
    pytest.importorskip("tritonclient.grpc")
    from google.protobuf import json_format

    from trtmoe.build.unified_hf import llmapi_config_pbtxt
    from trtmoe.runtime.load import load_tokenizer
    from trtmoe.triton.repository import parse_model_config, validate_repository
    from trtmoe.triton.served import load_served_engine
    from trtmoe.triton.unified_repo import embedded_repository, needs_embedded_engine

    ck, repo = llmapi_repo
    assert needs_embedded_engine(repo)
    made = embedded_repository(repo, tmp_path / "work")
    validate_repository(made.path)
    text = (made.path / "tensorrt_llm" / "config.pbtxt").read_text()
    cfg = parse_model_config(text, where="config.pbtxt")
    # The same contract: every input and output of the llmapi config trtmoe writes for the GPU host.
    upstream = parse_model_config(llmapi_config_pbtxt(True), where="upstream")
    assert {i.name for i in upstream.input} <= {i.name for i in cfg.input}
    assert {o.name for o in upstream.output} <= {o.name for o in cfg.output}
    assert cfg.model_transaction_policy.decoupled  # model.yaml's triton_config.decoupled
    assert (made.settings.max_batch_size, made.settings.max_seq_len) == (4, 256)  # model.yaml's limits
    served = load_served_engine(json_format.MessageToDict(cfg, preserving_proto_field_name=True),
                                str(made.path / "tensorrt_llm"))
    assert isinstance(served.engine.layers[0].attn.wqkv, QuantLinear)
    tok = load_tokenizer(ck)
    p = SamplingParams(max_new_tokens=10, end_id=tok.eos_id)
    prompt = tok.encode("def main(")
    assert served.engine.generate(prompt, p) == load_unified_engine(ck, device="cpu").generate(prompt, p)
    # What the repository was written from is left as it was.
    assert not (repo / "tensorrt_llm" / "1" / "model.py").exists()


def _installed_trtmoe_loads_unified() -> bool:
    """Whether the trtmoe a Triton Python-backend stub imports (this interpreter's installation, not
    PYTHONPATH) has the unified-HF loader."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                        "print(u.find_spec('trtmoe.runtime.unified_load') is not None)"],
                       capture_output=True, text=True, env=env, cwd="/tmp", timeout=120)
    return p.stdout.strip() == "True"


@pytest.mark.server
def test_llmapi_repository_served_on_cpu_answers_through_the_llmapi_contract(llmapi_repo, tmp_path):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    pytest.importorskip("pytriton")
    if not _installed_trtmoe_loads_unified():
        pytest.skip("the Triton Python-backend stub imports the installed trtmoe, which has no unified-HF loader")
    import numpy as np

    from trtmoe.runtime.load import load_tokenizer
    from trtmoe.triton.serve import serve_repository
    from trtmoe.triton.unified_repo import embedded_repository

    ck, repo = llmapi_repo
    made = embedded_repository(repo, tmp_path / "work", torch_num_threads=1)
    server = serve_repository(made.path, http_port=0, grpc_port=0, metrics_port=0, timeout_s=240)
    try:
        tok = load_tokenizer(ck)
        want = tok.decode(load_unified_engine(ck, device="cpu").generate(
            tok.encode("def main("), SamplingParams(max_new_tokens=12, end_id=tok.eos_id)))

        def t(name, arr, dtype):
            x = grpcclient.InferInput(name, list(arr.shape), dtype)
            x.set_data_from_numpy(arr)
            return x

        inputs = [t("text_input", np.array([b"def main("], dtype=object), "BYTES"),
                  t("sampling_param_max_tokens", np.array([12], dtype=np.int32), "INT32"),
                  t("streaming", np.array([False]), "BOOL")]
        from conftest import grpc_stream

        out, err = grpc_stream(server.endpoints.grpc, "tensorrt_llm", inputs, 120, None)
        assert err is None, err
        assert out[-1].as_numpy("text_output")[0].decode() == want
    finally:
        server.stop()
