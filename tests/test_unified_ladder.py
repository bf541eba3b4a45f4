"""W4A8-AWQ and MXFP4 in the graded per-layer ladder of the unified-HF targets: one calibration over FP8,
NVFP4 and W4A8-AWQ (and MXFP4), the per-layer plan ``convert --budget`` makes from it, and the
MIXED_PRECISION checkpoints with FP8 / MXFP4 and W4A8-AWQ layers that the writer exports and the embedded
unified loader runs."""

from __future__ import annotations

import json
import shutil
from itertools import product
from pathlib import Path

import pytest
import torch

from conftest import TRAINED_MIXTRAL, TRAINED_QWEN3_MOE, no_w4a8_search, require_fixture

LADDER = ("fp8", "nvfp4", "w4a8_awq")
LADDER_MX = ("fp8", "nvfp4", "mxfp4", "w4a8_awq")
L, E = 2, 4
# ModelOpt 0.47's quantized_layers entries (modelopt/torch/export/quant_utils.py process_layer_quant_config).
W4A8_ENTRY = {"quant_algo": "W4A8_AWQ", "group_size": 128, "has_zero_point": False, "pre_quant_scale": True}
FP8_ENTRY = {"quant_algo": "FP8"}
ARCHS = {  # architecture -> (size overrides: every expert matrix's input a multiple of 128, tokenizer source)
    "mixtral": ({"num_local_experts": E, "intermediate_size": 128, "vocab_size": 2048}, TRAINED_MIXTRAL),
    "qwen3_moe": ({"num_experts": E, "moe_intermediate_size": 128, "vocab_size": 1024}, TRAINED_QWEN3_MOE),
}


def _calibrated(arch: str, tiny_model, tmp_path_factory, formats: tuple[str, ...]):
    from trtmoe.data import write_split_text
    from trtmoe.quant.calibrate import calibrate

    sizes, tok = ARCHS[arch]
    tmp = tmp_path_factory.mktemp(f"ladder-{arch}")
    src = tiny_model(arch, num_hidden_layers=L, seed=5, hidden_size=128, head_dim=32, dtype="bfloat16", **sizes)
    model = Path(shutil.copytree(src, tmp / "m"))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok / f).is_file():
            shutil.copyfile(tok / f, model / f)
    text = tmp / "calib.txt"
    write_split_text("calib", text, max_bytes=20000)
    cal = tmp / "cal"
    calibrate(model, text, cal, samples=4, seq_len=32, formats=formats, rounding="awq_gptq")
    return arch, model, cal


@pytest.fixture(scope="module", params=list(ARCHS))
def ladder_cal(request, tiny_model, tmp_path_factory):
    """A tiny bf16 model (2 MoE layers, hidden 128) with a tokenizer, and its calibration over the
    three quantized formats with the default activation-aware rounding (awq_gptq)."""
    return _calibrated(request.param, tiny_model, tmp_path_factory, LADDER)


@pytest.fixture(scope="module", params=list(ARCHS))
def mx_cal(request, tiny_model, tmp_path_factory):
    """The same tiny model's calibration over FP8, NVFP4, MXFP4 and W4A8-AWQ (awq_gptq rounding)."""
    return _calibrated(request.param, tiny_model, tmp_path_factory, LADDER_MX)


def _tensors(ck: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    t = {}
    for f in sorted(ck.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            t.update({k: fh.get_tensor(k) for k in fh.keys()})
    return t


def _experts_prefix(quantized_layers: dict, layer: int) -> str:
    (p,) = [p for p in quantized_layers if f"layers.{layer}." in p]
    return p


def test_one_calibration_measures_the_three_candidates(ladder_cal):
    """Every expert of every MoE layer has a ΔKL for FP8, NVFP4 and W4A8-AWQ; the rounding is recorded,
    the W4A8 recipes are stored and the activation statistics the FP8 / NVFP4 codes need are kept."""
    from trtmoe.quant import awq
    from trtmoe.quant.calibrate import load_calib

    _, _, cal = ladder_cal
    c = load_calib(cal)
    assert c["formats"] == list(LADDER) and c["rounding"] == "awq_gptq"
    dkl = c["sensitivity"]["delta_kl"]
    for f in LADDER:
        assert len(dkl[f]) == L and all(len(row) == E for row in dkl[f]), f
    assert any(v > 0 for row in dkl["w4a8_awq"] for v in row)
    assert (cal / awq.ACT_FILE).is_file()
    assert any((cal / "recipes").glob("*.safetensors"))
    # Per-channel input amax per layer and matrix: what the W4A8 input scale amax(x * pre_quant_scale) needs.
    assert all(isinstance(c["input_amax"][str(l)][m], list) for l in range(L) for m in ("fc", "proj"))


@pytest.fixture(scope="module")
def mixed_exports(ladder_cal, tmp_path_factory):
    """The calibration's mixed export (layer 0 FP8, layer 1 W4A8-AWQ) and the two uniform exports with the
    same calibration, all for vLLM."""
    from trtmoe.build.unified_hf import convert_unified

    arch, model, cal = ladder_cal
    tmp = tmp_path_factory.mktemp(f"ladder-ck-{arch}")
    out = {}
    for name, spec in (("mixed", ["0=fp8", "1=w4a8_awq"]), ("fp8", ["0=fp8", "1=fp8"]),
                       ("w4a8", ["0=w4a8_awq", "1=w4a8_awq"])):
        out[name] = convert_unified(model, tmp / name, target="vllm", layer_formats=spec, calib=cal, sm=90)
    return arch, model, cal, out


def test_mixed_fp8_w4a8_export_is_written_as_modelopt_writes_mixed_w4a8(mixed_exports):
    """hf_quant_config.json: MIXED_PRECISION with one quantized_layers entry per MoE layer, the W4A8 one
    with ModelOpt's group size / zero point / pre-quant scale keys; config.json: one config group per
    entry; vLLM's cell for per-layer W4A8 is accepted with a caution (unlisted)."""
    _, _, _, out = mixed_exports
    r = out["mixed"]
    q = r.result.hf_quant_config["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION"
    ql = q["quantized_layers"]
    assert len(ql) == L and all(p.endswith(".experts") for p in ql)
    assert ql[_experts_prefix(ql, 0)] == FP8_ENTRY
    assert ql[_experts_prefix(ql, 1)] == W4A8_ENTRY
    cfg = json.loads((r.result.out_dir / "config.json").read_text())["quantization_config"]
    assert cfg["quant_algo"] == "MIXED_PRECISION" and cfg["quantized_layers"] == ql
    groups = {tuple(g["targets"]): g for g in cfg["config_groups"].values()}
    w4 = groups[(_experts_prefix(ql, 1),)]
    assert w4["weights"] == {"dynamic": False, "group_size": 128, "num_bits": 4, "type": "float"}
    assert w4["input_activations"] == {"dynamic": False, "group_size": 128, "num_bits": 8, "type": "float"}
    assert r.verdict.ok and any("W4A8-AWQ x mixed" in c for c in r.verdict.cautions)
    man = json.loads((r.result.out_dir / "manifest.json").read_text())
    assert man["rounding"] == "awq_gptq" and man["plan"]["rounding"] == "awq_gptq"


def test_mixed_export_is_the_uniform_exports_spliced_per_layer(mixed_exports):
    """Each layer of the mixed checkpoint holds exactly the tensors the uniform export in that layer's
    format writes (the calibration's W4A8 recipes with per-expert pre-quant scales, the FP8 layer's
    activation-aware codes); the W4A8 layer's gate and up share their pre-quant scale and some scales
    are not all ones; the FP8 layer has none."""
    _, _, _, out = mixed_exports
    mixed, fp8, w4 = (_tensors(out[n].result.out_dir) for n in ("mixed", "fp8", "w4a8"))
    ql = out["mixed"].result.hf_quant_config["quantization"]["quantized_layers"]
    p0, p1 = _experts_prefix(ql, 0) + ".", _experts_prefix(ql, 1) + "."
    assert set(mixed) == {k for k in fp8 if not k.startswith(p1)} | {k for k in w4 if k.startswith(p1)}
    for k, t in mixed.items():
        want = w4[k] if k.startswith(p1) else fp8[k]
        assert t.dtype == want.dtype and torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                                                     want.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else want), k
    assert not any(k.startswith(p0) and k.endswith("pre_quant_scale") for k in mixed)
    pq = {k: t for k, t in mixed.items() if k.startswith(p1) and k.endswith("pre_quant_scale")}
    assert len(pq) == 3 * E
    names = sorted({k[len(p1):].split(".")[0] for k in pq})
    assert names == [str(e) for e in range(E)]
    gate_up = [sorted(k for k in pq if k.startswith(f"{p1}{e}.")) for e in range(E)]
    for keys in gate_up:  # [down, gate, up] or [w1, w2, w3]: the fc pair is the two not named down / w2
        fc = [k for k in keys if not any(s in k for s in (".w2.", ".down_proj."))]
        assert len(fc) == 2 and torch.equal(pq[fc[0]], pq[fc[1]])
    assert any(not bool(torch.all(t == 1)) for t in pq.values())


def test_mixed_checkpoint_runs_in_the_embedded_unified_loader(mixed_exports):
    """The loaded mixed checkpoint computes what the uniform FP8 checkpoint computes with layer 1's experts
    taken from the uniform W4A8 checkpoint (each layer on its own format's kernel, W4A8 inputs
    pre-scaled), and differs from all-FP8."""
    _, _, _, out = mixed_exports
    _assert_runs_as_spliced(out["mixed"], out["fp8"], out["w4a8"])


def _assert_runs_as_spliced(mixed, base, swapped, layer: int = 1):
    """The loaded ``mixed`` export computes exactly what the uniform ``base`` export computes with
    ``layer``'s experts taken from the uniform ``swapped`` export, and differs from ``base`` alone."""
    from trtmoe.runtime.unified_load import load_unified_engine

    ids = torch.randint(0, 250, (2, 20), generator=torch.Generator().manual_seed(7))
    got_eng = load_unified_engine(mixed.result.out_dir, device="cpu")
    ref = load_unified_engine(base.result.out_dir, device="cpu")
    other = load_unified_engine(swapped.result.out_dir, device="cpu")
    with torch.inference_mode():
        all_base = ref.logits(ids).float()
        ref.layers[layer].experts = other.layers[layer].experts
        want = ref.logits(ids).float()
        got = got_eng.logits(ids).float()
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    assert not torch.allclose(got, all_base, atol=1e-4 * float(all_base.abs().max()), rtol=0)


def test_export_takes_the_calibrations_w4a8_recipes_without_searching(ladder_cal, tmp_path, monkeypatch):
    from trtmoe.build.unified_hf import convert_unified
    from trtmoe.quant import awq

    _, model, cal = ladder_cal
    no_w4a8_search(monkeypatch)
    awq._RECIPES.clear()
    r = convert_unified(model, tmp_path / "ck", target="vllm", layer_formats=["0=fp8", "1=w4a8_awq"], calib=cal,
                        sm=90)
    assert r.result.hf_quant_config["quantization"]["quant_algo"] == "MIXED_PRECISION"


# ---- the plan ------------------------------------------------------------------------------------

def _stored_bpw(model: Path, ladder: tuple[str, ...] = LADDER) -> dict[str, float]:
    """Each format's stored bits per routed-expert weight in the unified-HF checkpoint (every layer alike)."""
    from trtmoe.checkpoint import unified_hf as U

    with U.SourceModel(model) as src:
        bits = U.expert_layer_bits(src, ("float", *ladder))
        n_w = sum(m.shape[0] * m.shape[1] for m in src.modules() if m.kind == "expert" and m.layer == 0)
    assert all(b == bits[0] for b in bits.values())
    return {f: b / n_w for f, b in bits[0].items()}


def _edited(cal: Path, tmp: Path, scale: dict[tuple[str, int], float]) -> Path:
    """A copy of the calibration whose ΔKL of (format, layer) is NVFP4's times ``scale`` (others kept)."""
    d = Path(shutil.copytree(cal, tmp / "cal"))
    c = json.loads((d / "calib.json").read_text())
    dkl = c["sensitivity"]["delta_kl"]
    for (f, l), s in scale.items():
        dkl[f][l] = [v * s for v in dkl["nvfp4"][l]]
    (d / "calib.json").write_text(json.dumps(c))
    return d


def test_plan_picks_w4a8_where_it_buys_more_per_bit(ladder_cal, tmp_path):
    """With W4A8 (fewer stored bits than NVFP4) slightly worse than NVFP4 in ΔKL, a budget that fits
    FP8 + W4A8 but not FP8 + NVFP4 gives the more sensitive layer FP8 and the other W4A8; where W4A8 is
    better than NVFP4 in one layer only, a 4-bit budget gives that layer W4A8 and the other NVFP4. A
    cell without MIXED_PRECISION (TensorRT-LLM, Mixtral / Qwen3-MoE) keeps one format; one without a
    W4A8 kernel (TensorRT-LLM on SM100) never picks it."""
    from trtmoe.build.unified_hf import plan_from_calibration
    from trtmoe.quant.calibrate import load_calib

    _, model, cal = ladder_cal
    c = load_calib(cal)
    bpw = _stored_bpw(model)
    assert bpw["w4a8_awq"] < bpw["nvfp4"]
    dkl = c["sensitivity"]["delta_kl"]
    hot = max(range(L), key=lambda l: sum(dkl["nvfp4"][l]))
    cold = 1 - hot
    d = _edited(cal, tmp_path / "a", {("w4a8_awq", 0): 1.2, ("w4a8_awq", 1): 1.2,
                                      ("fp8", 0): 0.01, ("fp8", 1): 0.01})
    budget = (bpw["fp8"] + (bpw["w4a8_awq"] + bpw["nvfp4"]) / 2) / 2  # FP8 + W4A8 fits, FP8 + NVFP4 does not
    plan, _ = plan_from_calibration(model, d, budget, engine="vllm-0.33", sm=90)
    assert plan.expert_formats == {hot: "fp8", cold: "w4a8_awq"}
    assert plan.meta["avg_bpw"] <= budget
    d2 = _edited(cal, tmp_path / "b", {("w4a8_awq", 0): 0.5, ("w4a8_awq", 1): 2.0})
    four = (bpw["nvfp4"] + bpw["fp8"]) / 2 - 0.5  # only 4-bit layers fit
    plan, _ = plan_from_calibration(model, d2, four, engine="vllm-0.33", sm=90)
    assert plan.expert_formats == {0: "w4a8_awq", 1: "nvfp4"}
    plan, _ = plan_from_calibration(model, d2, four, engine="trtllm-1.2.1", sm=90)
    assert len(set(plan.expert_formats.values())) == 1
    d3 = _edited(cal, tmp_path / "c", {("w4a8_awq", 0): 0.1, ("w4a8_awq", 1): 0.1})
    plan, _ = plan_from_calibration(model, d3, four, engine="trtllm-1.2.1", sm=90)
    assert plan.expert_formats == {0: "w4a8_awq", 1: "w4a8_awq"}
    plan, _ = plan_from_calibration(model, d3, four, engine="trtllm-1.2.1", sm=100)
    assert "w4a8_awq" not in plan.expert_formats.values()


def _assert_least_dkl_plans(model: Path, cal: Path, ladder: tuple[str, ...], formats: list[str] | None = None):
    from trtmoe.build.unified_hf import plan_from_calibration
    from trtmoe.quant.calibrate import load_calib

    c = load_calib(cal)
    dkl = c["sensitivity"]["delta_kl"]
    keep = None if formats is None else {"float" if f == "bf16" else f for f in formats}
    cost = {f: b for f, b in _stored_bpw(model, ladder).items() if keep is None or f in keep}
    loss = {f: [sum(dkl[f][l]) if f != "float" else 0.0 for l in range(L)] for f in cost}
    for budget in (4.3, 4.4, 4.5, 5.0, 6.0, 6.2, 7.0, 10.0, 12.5):
        fits = [a for a in product(cost, repeat=L) if sum(cost[f] for f in a) / L <= budget * (1 + 1e-12)]
        if not fits:  # below the ladder's fewest bits (4.3: only MXFP4 fits)
            continue
        best = min(sum(loss[f][l] for l, f in enumerate(a)) for a in fits)
        plan, _ = plan_from_calibration(model, cal, budget, engine="vllm-0.33", sm=90, formats=formats)
        got = [("float" if plan.expert_formats[l] == "bf16" else plan.expert_formats[l]) for l in range(L)]
        assert set(got) <= set(cost), budget
        assert plan.meta["avg_bpw"] == pytest.approx(sum(cost[f] for f in got) / L, rel=1e-12), budget
        assert plan.meta["avg_bpw"] <= budget * (1 + 1e-12), budget
        assert sum(loss[f][l] for l, f in enumerate(got)) == pytest.approx(best, rel=1e-9, abs=1e-15), budget


def test_plan_over_the_ladder_is_the_least_predicted_dkl_within_the_budget(ladder_cal):
    """On the measured calibration, at several budgets: the per-layer plan's predicted ΔKL is the least
    over every per-layer assignment of {bf16, fp8, nvfp4, w4a8_awq} whose stored bits in the unified-HF
    checkpoint fit (enumerated), and its avg_bpw is those stored bits per weight."""
    _, model, cal = ladder_cal
    _assert_least_dkl_plans(model, cal, LADDER)


# ---- MXFP4 (W4A16, E8M0 scales per 32) in the ladder ----------------------------------------------

def test_plan_over_the_ladder_with_mxfp4_is_the_least_predicted_dkl(mx_cal):
    """One calibration over FP8, NVFP4, MXFP4 and W4A8-AWQ measures every expert in each; the plan over
    {bf16, fp8, nvfp4, mxfp4, w4a8_awq} is the least predicted ΔKL within each budget (enumerated, in
    stored bits), and the plan restricted to {fp8, nvfp4, w4a8_awq} from the same calibration is that
    ladder's least and never MXFP4."""
    from trtmoe.quant.calibrate import load_calib

    _, model, cal = mx_cal
    c = load_calib(cal)
    assert c["formats"] == list(LADDER_MX) and c["rounding"] == "awq_gptq"
    dkl = c["sensitivity"]["delta_kl"]
    assert len(dkl["mxfp4"]) == L and all(len(row) == E for row in dkl["mxfp4"])
    assert any(v > 0 for row in dkl["mxfp4"] for v in row)
    _assert_least_dkl_plans(model, cal, LADDER_MX)
    _assert_least_dkl_plans(model, cal, LADDER_MX, formats=["bf16", *LADDER])


def test_plan_picks_mxfp4_where_it_buys_more_per_bit(mx_cal, tmp_path):
    """MXFP4 stores the fewest bits of the 4-bit rungs; with its ΔKL half NVFP4's (W4A8's twice), a
    4-bit budget gives every layer MXFP4, and a budget of exactly FP8 + MXFP4 gives the more sensitive
    layer FP8 and the other MXFP4 (FP8 + W4A8 / NVFP4 do not fit)."""
    from trtmoe.build.unified_hf import plan_from_calibration
    from trtmoe.quant.calibrate import load_calib

    _, model, cal = mx_cal
    bpw = _stored_bpw(model, LADDER_MX)
    assert bpw["mxfp4"] < bpw["w4a8_awq"] < bpw["nvfp4"] < bpw["fp8"]
    dkl = load_calib(cal)["sensitivity"]["delta_kl"]
    hot = max(range(L), key=lambda l: sum(dkl["nvfp4"][l]))
    d = _edited(cal, tmp_path, {("mxfp4", 0): 0.5, ("mxfp4", 1): 0.5, ("w4a8_awq", 0): 2.0,
                                ("w4a8_awq", 1): 2.0, ("fp8", 0): 0.01, ("fp8", 1): 0.01})
    plan, _ = plan_from_calibration(model, d, bpw["nvfp4"] + 0.01, engine="vllm-0.33", sm=90)
    assert plan.expert_formats == {0: "mxfp4", 1: "mxfp4"}
    budget = (bpw["fp8"] + bpw["mxfp4"]) / 2
    plan, _ = plan_from_calibration(model, d, budget, engine="vllm-0.33", sm=90)
    assert plan.expert_formats == {hot: "fp8", 1 - hot: "mxfp4"}
    assert plan.meta["avg_bpw"] == pytest.approx(budget, rel=1e-12)


def test_mixed_mxfp4_w4a8_checkpoint_is_the_uniform_exports_spliced_and_runs(mx_cal, tmp_path):
    """The MIXED_PRECISION export with layer 0 MXFP4 and layer 1 W4A8-AWQ (codes and recipes of the one
    calibration): each layer's entry is the one the uniform export of its format writes, each layer holds
    exactly that uniform export's tensors, and the embedded loader's logits are those of the uniform MXFP4
    engine with layer 1's experts taken from the uniform W4A8 engine (and differ from all-MXFP4)."""
    from trtmoe.build.unified_hf import convert_unified
    from trtmoe.checkpoint import unified_hf as U

    _, model, cal = mx_cal
    out = {name: convert_unified(model, tmp_path / name, target="vllm", layer_formats=spec, calib=cal, sm=90)
           for name, spec in (("mixed", ["0=mxfp4", "1=w4a8_awq"]), ("mx", ["0=mxfp4", "1=mxfp4"]),
                              ("w4a8", ["0=w4a8_awq", "1=w4a8_awq"]))}
    q = out["mixed"].result.hf_quant_config["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION"
    ql = q["quantized_layers"]
    assert ql[_experts_prefix(ql, 0)] == U.FORMATS["mxfp4"].layer_config()
    assert ql[_experts_prefix(ql, 1)] == W4A8_ENTRY
    assert out["mixed"].verdict.ok
    assert json.loads((out["mixed"].result.out_dir / "manifest.json").read_text())["rounding"] == "awq_gptq"
    mixed, mx, w4 = (_tensors(out[n].result.out_dir) for n in ("mixed", "mx", "w4a8"))
    p1 = _experts_prefix(ql, 1) + "."
    assert set(mixed) == {k for k in mx if not k.startswith(p1)} | {k for k in w4 if k.startswith(p1)}
    for k, t in mixed.items():
        want = w4[k] if k.startswith(p1) else mx[k]
        assert t.dtype == want.dtype and torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                                                     want.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else want), k
    _assert_runs_as_spliced(out["mixed"], out["mx"], out["w4a8"])


# ---- the CLI on a trained fixture ----------------------------------------------------------------

@pytest.mark.slow
def test_cli_calibrate_three_formats_then_convert_vllm_budget(tmp_path):
    """`trtmoe calibrate --formats fp8,nvfp4,w4a8_awq --rounding awq_gptq` then `trtmoe convert --target vllm
    --calib C --budget 6` on the trained Mixtral: the plan is the one plan_from_calibration makes, within
    the budget; where W4A8 measured below NVFP4 in every layer (it stores fewer bits) no layer is NVFP4;
    the checkpoint's W4A8 layers carry per-expert pre-quant scales, and the embedded loader runs it."""
    from click.testing import CliRunner

    from trtmoe.build.unified_hf import plan_from_calibration
    from trtmoe.cli import main
    from trtmoe.data import write_split_text
    from trtmoe.quant.calibrate import load_calib
    from trtmoe.runtime.unified_load import load_unified_engine

    model = require_fixture(TRAINED_MIXTRAL)
    write_split_text("calib", tmp_path / "calib.txt", max_bytes=40_000)
    r = CliRunner().invoke(main, ["calibrate", str(model), "--data", str(tmp_path / "calib.txt"), "--formats",
                                  "fp8,nvfp4,w4a8_awq", "--rounding", "awq_gptq", "-o", str(tmp_path / "cal"),
                                  "--samples", "8", "--seq-len", "64"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["convert", str(model), "-o", str(tmp_path / "ck"), "--target", "vllm", "--calib",
                                  str(tmp_path / "cal"), "--budget", "6"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    ck = tmp_path / "ck"
    man = json.loads((ck / "manifest.json").read_text())
    plan, _ = plan_from_calibration(model, tmp_path / "cal", 6.0, engine="vllm-0.33", sm=90)
    assert {int(k): v for k, v in man["plan"]["expert_formats"].items()} == plan.expert_formats
    assert man["plan"]["avg_bpw"] <= 6.0
    # avg_bpw is the written experts' stored bits per weight (every expert tensor counted)
    t = _tensors(ck)
    stored = sum(8 * v.numel() * v.element_size() for k, v in t.items() if ".experts." in k)
    n_w = sum(v.numel() * (2 if v.dtype == torch.uint8 else 1) for k, v in t.items()
              if ".experts." in k and k.endswith(".weight"))
    assert man["plan"]["avg_bpw"] == pytest.approx(stored / n_w, rel=1e-12)
    c = load_calib(tmp_path / "cal")
    dkl = c["sensitivity"]["delta_kl"]
    if all(sum(dkl["w4a8_awq"][i]) < sum(dkl["nvfp4"][i]) for i in range(len(c["moe_layers"]))):
        assert "nvfp4" not in plan.expert_formats.values()
    for l, f in plan.expert_formats.items():
        pq = [k for k in t if f"layers.{l}." in k and ".experts." in k and k.endswith("pre_quant_scale")]
        assert len(pq) == (3 * c["num_experts"] if f == "w4a8_awq" else 0), (l, f)
    eng = load_unified_engine(ck, device="cpu")
    with torch.inference_mode():
        assert torch.isfinite(eng.logits(torch.arange(1, 33).reshape(2, 16))).all()


def test_stored_bits_leave_out_what_a_layer_cannot_hold(tiny_model):
    """gpt-oss's stacked experts are written as BF16 or MXFP4 only; a Mixtral whose FFN width is not a
    multiple of 32 / 128 has no MXFP4 / W4A8 form: those formats get no cost (the plan cannot pick them)."""
    from trtmoe.checkpoint import unified_hf as U

    with U.SourceModel(tiny_model("gpt_oss", dtype="bfloat16", intermediate_size=64)) as src:
        bits = U.expert_layer_bits(src, ("float", *LADDER, "mxfp4"))
    assert bits and all(set(b) == {"float", "mxfp4"} and b["mxfp4"] < b["float"] / 3 for b in bits.values())
    with U.SourceModel(tiny_model("mixtral", dtype="bfloat16")) as src:
        bits = U.expert_layer_bits(src, ("float", *LADDER, "mxfp4"))
    assert bits and all(set(b) == {"float", "fp8", "nvfp4"} for b in bits.values())
