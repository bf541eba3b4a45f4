"""End-to-end quantization pipeline on seeded tiny models: sensitivity, calibration coverage, plans
through the checkpoint writer and back through the embedded engine, placement, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from trtmoe.checkpoint.writer import convert
from trtmoe.cli import main
from trtmoe.hf.safetensors_io import SafetensorsFile
from trtmoe.parallel.mapping import Mapping
from trtmoe.quant.calibrate import measure
from trtmoe.quant.formats import FORMATS
from trtmoe.quant.plan import QuantPlan, format_obj
from trtmoe.quant.policies import build_units, make_plan
from trtmoe.report.quality import Reference
from trtmoe.runtime.engine import EmbeddedEngine
from trtmoe.runtime.experts import FloatExperts, PackedExperts

E = 8  # experts per layer in the models below
MOE = "model.layers.{l}.block_sparse_moe."


# ---- helpers ---------------------------------------------------------------------------------------
def _ids(n: int, t: int, vocab: int = 250, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def _edit_hf(src: Path, dst: Path, edit) -> Path:
    """Copy an HF checkpoint dir and rewrite its (single) safetensors file through ``edit(tensors)``."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


def _calib(model: Path, tmp: Path, ids: torch.Tensor, formats=("int8", "int4"), min_tokens: int = 16) -> Path:
    """calib.json for ``model`` measured on ``ids`` (the library path `trtmoe calibrate` takes after
    tokenizing), written where `trtmoe convert --calib` reads it."""
    ck = tmp / "calib_ckpt"
    convert(model, ck)
    res = measure(EmbeddedEngine.from_checkpoint(ck, device="cpu"), ids, formats=formats, min_tokens=min_tokens)
    out = tmp / "calib"
    out.mkdir()
    (out / "calib.json").write_text(json.dumps(res))
    shutil.rmtree(ck)
    return out


def make_tokenizer(out: Path) -> Path:
    """A small BPE tokenizer (ids 0..2 = <unk>, <s>, </s>) that fits the tiny models' 250-id vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from trtmoe.data import split_texts

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(split_texts("train", max_bytes=100_000), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "add_bos_token": True}))
    return out


def cli(*args: str, expect: int | None = 0):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if expect is not None:
        assert res.exit_code == expect, res.output
    return res


def _dead_router(tensors: dict, layer: int) -> None:
    """Make experts 4..7 of ``layer`` unreachable, and put all load on EP rank 0's experts: rows 4..7
    are zero (logit 0), while experts (0, 1) and (2, 3) get rows v, -v and u, -u, so every token has
    two positive logits, one in each pair."""
    w = tensors[MOE.format(l=layer) + "gate.weight"]
    g = torch.Generator().manual_seed(7)
    v, u = torch.randn(w.shape[1], generator=g), torch.randn(w.shape[1], generator=g)
    new = torch.zeros_like(w)
    new[0], new[1], new[2], new[3] = 10 * v, -10 * v, 10 * u, -10 * u
    tensors[MOE.format(l=layer) + "gate.weight"] = new.to(w.dtype)


DEAD = (4, 5, 6, 7)


# ---- fixtures -----------------------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mixtral8(tiny_model):
    """Tiny Mixtral with 8 experts per layer, float32."""
    return tiny_model("mixtral", num_local_experts=E, num_hidden_layers=3, seed=3)


@pytest.fixture(scope="module")
def mixtral8_bf16(tiny_model):
    return tiny_model("mixtral", num_local_experts=E, num_hidden_layers=3, seed=3, dtype="bfloat16")


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def skewed(mixtral8, tmp_path_factory):
    """The float32 model with layer 0's experts 4..7 unreachable (routing skew for placement)."""
    return _edit_hf(mixtral8, tmp_path_factory.mktemp("skew") / "hf", lambda t: _dead_router(t, 0))


@pytest.fixture(scope="module")
def bf16_calib(mixtral8_bf16, tmp_path_factory):
    return _calib(mixtral8_bf16, tmp_path_factory.mktemp("bfcal"), _ids(8, 32))


# ---- sensitivity ------------------------------------------------------------------------------------------
def test_sensitivity_finds_planted_fragile_expert(mixtral8, tmp_path):
    layer = 1
    ids = _ids(8, 32)
    base = measure(EmbeddedEngine.from_checkpoint(convert(mixtral8, tmp_path / "a").out_dir, device="cpu"), ids,
                   formats=("int4",))
    share = base["routing"]["share"][layer]
    # The expert of median routing frequency: neither busy nor rare.
    planted = sorted(range(E), key=lambda e: share[e])[E // 2]
    assert min(share) < share[planted] < max(share)

    def scale(t):
        for w in ("w1", "w2", "w3"):
            t[MOE.format(l=layer) + f"experts.{planted}.{w}.weight"] *= 8.0

    hf = _edit_hf(mixtral8, tmp_path / "planted", scale)
    res = measure(EmbeddedEngine.from_checkpoint(convert(hf, tmp_path / "b").out_dir, device="cpu"), ids,
                  formats=("int4",))
    # Routing into layer 1 does not depend on layer 1's experts: the frequency is unchanged.
    assert res["routing"]["counts"][layer] == base["routing"]["counts"][layer]
    d = res["sensitivity"]["delta_kl"]["int4"][layer]
    ranked = sorted(range(E), key=lambda e: -d[e])
    assert ranked[0] == planted, (planted, d)
    assert d[planted] > 3 * d[ranked[1]]
    # Before planting it was not the most sensitive one: the measurement found the weights, not the slot.
    before = base["sensitivity"]["delta_kl"]["int4"][layer]
    assert max(range(E), key=lambda e: before[e]) != planted or before[planted] < d[planted] / 10


def test_calibration_localises_a_fragile_proj(mixtral8, tmp_path):
    """A planted proj that only quantization can hurt: expert ``planted``'s up row c is zeroed, so its
    activation c is exactly 0 and proj's column c can hold huge weights without changing the float
    model; int4's per-row scale (amax / 8) then rounds the rest of every proj row to zero, while
    int8's (amax / 128) still resolves them. Only the proj measurement of that expert may jump; its fc
    measurement must not."""
    layer, c = 1, 5
    ids = _ids(8, 32)
    base = measure(EmbeddedEngine.from_checkpoint(convert(mixtral8, tmp_path / "a").out_dir, device="cpu"), ids,
                   formats=("int4",))
    share = base["routing"]["share"][layer]
    planted = sorted(range(E), key=lambda e: share[e])[E // 2]

    def plant(t):
        pre = MOE.format(l=layer) + f"experts.{planted}."
        t[pre + "w3.weight"][c] = 0.0  # up row c: HF w3 is up_proj, fc = [up; gate]
        t[pre + "w2.weight"][:, c] = 30 * t[pre + "w2.weight"].abs().max()

    hf = _edit_hf(mixtral8, tmp_path / "planted", plant)
    res = measure(EmbeddedEngine.from_checkpoint(convert(hf, tmp_path / "b").out_dir, device="cpu"), ids,
                  formats=("int8", "int4"))
    mats, before = res["sensitivity"]["matrices"], base["sensitivity"]["matrices"]
    proj, fc = mats["proj"]["delta_kl"]["int4"], mats["fc"]["delta_kl"]["int4"]
    top = sorted(((proj[l][e], l, e) for l in res["moe_layers"] for e in range(E)), reverse=True)
    assert top[0][1:] == (layer, planted), top[:3]
    assert top[0][0] > 5 * top[1][0]
    assert proj[layer][planted] > 5 * before["proj"]["delta_kl"]["int4"][layer][planted]
    # fc of the planted expert is not what broke: its ΔKL stays near its value before planting and
    # far below the planted proj's.
    fc_before = before["fc"]["delta_kl"]["int4"][layer][planted]
    assert 0.3 * fc_before < fc[layer][planted] < 3 * fc_before
    assert fc[layer][planted] < proj[layer][planted] / 10
    # The expert-level sensitivity is the sum, so expert plans see the planted expert as fragile too.
    d = res["sensitivity"]["delta_kl"]["int4"][layer]
    assert max(range(E), key=lambda e: d[e]) == planted
    assert d[planted] == pytest.approx(fc[layer][planted] + proj[layer][planted], rel=1e-12)
    # The plan puts the bits there: with room for exactly one proj in int8 (an fc costs twice that),
    # the graded matrix plan spends it on the planted proj.
    units = build_units(res, "matrix", torch.float32, ["int8", "int4"])
    up = next(u for u in units if u.key[2] == "proj")
    room = sum(u.costs_bits["int4"] for u in units) + up.costs_bits["int8"] - up.costs_bits["int4"]
    plan = make_plan(res, "graded", budget_bpw=room / sum(u.n_weights for u in units), granularity="matrix",
                     formats=["int8", "int4"], dtype=torch.float32)
    int8 = [(l, e, m) for m in ("fc", "proj") for l, fs in plan.matrix_formats(m).items()
            for e, f in enumerate(fs) if f == "int8"]
    assert int8 == [(layer, planted, "proj")]


def test_load_calib_refuses_other_layout_versions(mixtral8, tmp_path):
    from trtmoe.errors import InputError
    from trtmoe.quant.calibrate import CALIB_VERSION, load_calib

    cal = json.loads((_calib(mixtral8, tmp_path, _ids(4, 16), formats=("int8",)) / "calib.json").read_text())
    assert cal["version"] == CALIB_VERSION == 2
    assert load_calib(tmp_path / "calib")["version"] == 2
    # A version-1 file (whole-expert ΔKL only) is refused with a clear instruction, not misread.
    old = {k: v for k, v in cal.items()}
    old["version"] = 1
    old["sensitivity"] = {k: v for k, v in cal["sensitivity"].items() if k != "matrices"}
    (tmp_path / "v1.json").write_text(json.dumps(old))
    with pytest.raises(InputError, match="version 1.*recalibrate"):
        load_calib(tmp_path / "v1.json")
    # The same check guards plans made from a dict that never went through load_calib.
    with pytest.raises(InputError, match="recalibrate"):
        make_plan(old, "graded", budget_bpw=10.0, dtype=torch.float32)
    newer = dict(cal, version=CALIB_VERSION + 1)
    (tmp_path / "v3.json").write_text(json.dumps(newer))
    with pytest.raises(InputError, match="newer trtmoe"):
        load_calib(tmp_path / "v3.json")


# ---- coverage -----------------------------------------------------------------------------------------------
def test_unreached_experts_still_plan_and_warn(mixtral8_bf16, tokdir, tmp_path):
    hf = _edit_hf(mixtral8_bf16, tmp_path / "hf", lambda t: _dead_router(t, 0))
    text = tmp_path / "calib.txt"
    from trtmoe.data import write_split_text

    write_split_text("calib", text, max_bytes=20_000)
    res = cli("calibrate", hf, "--data", text, "--tokenizer", tokdir, "--samples", 4, "--seq-len", 32,
              "--formats", "int8,int4", "-o", tmp_path / "calib")
    out = res.output
    assert "warning" in out and "calibration tokens" in out
    flat = " ".join(out.split())
    assert f"layer 0: {len(DEAD)} of 8 experts saw fewer than" in flat
    for e in DEAD:
        assert f"{e} (0)" in flat
    cal = json.loads((tmp_path / "calib" / "calib.json").read_text())
    dead = {(d["layer"], d["expert"]) for d in cal["routing"]["dead"]}
    assert {(0, e) for e in DEAD} <= dead
    # Never-routed experts still get a non-zero sensitivity, per matrix (estimated from all-token
    # output error), and the expert's is the sum of its two matrices'.
    mats = cal["sensitivity"]["matrices"]
    for e in DEAD:
        for m in ("fc", "proj"):
            assert mats[m]["delta_kl"]["int4"][0][e] > 0
            assert mats[m]["measured"]["int4"][0][e] == 0
        assert cal["sensitivity"]["delta_kl"]["int4"][0][e] == pytest.approx(
            mats["fc"]["delta_kl"]["int4"][0][e] + mats["proj"]["delta_kl"]["int4"][0][e], rel=1e-12)
    cli("convert", hf, "-o", tmp_path / "ck", "--calib", tmp_path / "calib", "--budget", "6", "--formats",
        "fp16,int8,int4")
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())["quantization"]
    # The embedded target's default granularity for a budget: each expert's fc and proj apart.
    assert m["policy"] == "graded" and m["granularity"] == "matrix" and abs(m["avg_bpw"] - 6) <= 0.5
    eng = EmbeddedEngine.from_checkpoint(tmp_path / "ck", device="cpu")
    assert torch.isfinite(eng.logits(_ids(1, 8))).all()


# ---- what is never quantized -------------------------------------------------------------------------------
def test_router_gate_embeddings_head_norms_stay_float(tiny_model, tmp_path):
    hf = tiny_model("qwen2_moe", seed=1, dtype="bfloat16")
    cal = _calib(hf, tmp_path, _ids(4, 32))
    cli("convert", hf, "-o", tmp_path / "ck", "--calib", cal, "--budget", "4.4", "--formats", "fp16,int8,int4",
        "--rounding", "rtn")  # _calib keeps no activation statistics
    ck = tmp_path / "ck"
    manifest = json.loads((ck / "manifest.json").read_text())
    excluded = manifest["quantization"]["excluded"]
    for pat in ("*router", "*shared_expert_gate", "*vocab_embedding", "*lm_head", "*layernorm*", "*ln_f"):
        assert pat in excluded
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["trtmoe"]["quantization"]["excluded"] == excluded
    f = SafetensorsFile(ck / "rank0.safetensors")
    try:
        kinds = {"router": 0, "shared_expert_gate": 0, "vocab_embedding": 0, "lm_head": 0, "layernorm": 0,
                 "ln_f": 0, "shared_expert.": 0, "experts_int": 0}
        for name, info in f.tensors.items():
            for k in list(kinds)[:-1]:
                if k in name:
                    kinds[k] += 1
                    assert info.dtype in (torch.bfloat16, torch.float32), (name, info.dtype)
            if ".mlp.experts." in name and name.endswith(".weight") and info.dtype == torch.int8:
                kinds["experts_int"] += 1
    finally:
        f.close()
    assert all(v > 0 for v in kinds.values()), kinds


# ---- packed bytes in the engine ------------------------------------------------------------------------------
def _manual_matrix(f: SafetensorsFile, pre: str, fmt: str, pick=lambda t: t) -> torch.Tensor:
    """One expert matrix [out, in] in float32, dequantized straight from the rank file's tensors under
    ``pre`` independently of trtmoe.quant.formats (``pick`` selects the expert of a stacked tensor)."""
    w = pick(f.read(pre + "weight"))
    if fmt == "float":
        return w.float()
    if fmt.startswith("int4_g"):
        return _dequant_group_int4(w, pick(f.read(pre + "weights_scaling_factor")),
                                   f.read(pre + "prequant_scaling_factor"))
    s = pick(f.read(pre + "per_channel_scale")).float()  # [out]
    if fmt == "int8":
        q = w.float()  # [in, out]
    else:  # int4 per channel: [in, out/2], column 2j in the low nibble
        b = w.view(torch.uint8).to(torch.int16)
        lo, hi = b & 0xF, b >> 4
        lo, hi = lo - 16 * (lo >= 8), hi - 16 * (hi >= 8)
        q = torch.stack((lo, hi), -1).flatten(-2).float()
    return (q * s).t()


def _manual_expert_weights(ck: Path, layer: int, slot: int, fmt: str, proj_fmt: str | None = None):
    """[fc, proj] of one per-expert slot, dequantized straight from the rank file."""
    f = SafetensorsFile(ck / "rank0.safetensors")
    try:
        return [_manual_matrix(f, f"transformer.layers.{layer}.mlp.experts.{slot}.{mod}.", name)
                for mod, name in (("fc", fmt), ("proj", proj_fmt or fmt))]
    finally:
        f.close()


def test_graded_plan_runs_from_packed_int8_bytes(mixtral8, tmp_path):
    cal = json.loads((_calib(mixtral8, tmp_path, _ids(8, 32)) / "calib.json").read_text())
    plan = make_plan(cal, "graded", budget_bpw=8.0, formats=["float", "int8", "int4"], dtype=torch.float32)
    assert {"int8", "int4"} <= plan.used_formats()
    ck = convert(mixtral8, tmp_path / "ck", quant=plan).out_dir
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    manual = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    n_int8 = 0
    for l, lay in enumerate(eng.layers):
        bank = lay.experts
        assert isinstance(bank, PackedExperts)
        fcs, projs = [], []
        for s in range(E):
            fmt = plan.formats[l][s]
            assert bank.format_of(s) == fmt
            (sh,) = bank.shards[s]
            fc, proj = sh.fc, sh.proj
            assert bank.formats_of(s) == (fmt, fmt) and sh.fc_fmt.name == sh.proj_fmt.name
            if fmt == "int8":
                n_int8 += 1
                assert fc["weight"].dtype == torch.int8 and proj["weight"].dtype == torch.int8
                assert tuple(fc["weight"].shape) == (64, 2 * 48)  # [in, out]: the packed TensorRT-LLM layout
            mfc, mproj = _manual_expert_weights(ck, l, s, fmt)
            fcs.append(mfc)
            projs.append(mproj)
        manual.layers[l].experts = FloatExperts(torch.stack(fcs), torch.stack(projs), "float32")
    assert n_int8 > 0
    ids = _ids(2, 24, seed=5)
    a, b = eng.logits(ids), manual.logits(ids)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    # And the quantization is real: the float model differs.
    ref = EmbeddedEngine.from_checkpoint(convert(mixtral8, tmp_path / "fp").out_dir, device="cpu").logits(ids)
    assert (ref - a).abs().max() > 1e-3


# ---- granularity follows the target ---------------------------------------------------------------------------
def test_target_sets_granularity(mixtral8_bf16, bf16_calib, tmp_path):
    fm = ("--formats", "fp16,int8,int4")
    # TensorRT-LLM's layer layout cannot keep the awq_gptq codes the calibration measured int4 with
    # (refused as a candidate there: tests/test_hostile_input.py), so that target plans with int8.
    cli("convert", mixtral8_bf16, "-o", tmp_path / "trt", "--calib", bf16_calib, "--budget", "9",
        "--formats", "fp16,int8", "--target", "tensorrt-llm")
    cfg = json.loads((tmp_path / "trt" / "config.json").read_text())
    q = cfg["trtmoe"]["quantization"]
    assert q["granularity"] == "layer"
    per_layer = {l: set(fs) for l, fs in q["expert_formats"].items()}
    assert all(len(s) == 1 for s in per_layer.values()), per_layer
    algo = cfg["quantization"]["quant_algo"]
    if len(set().union(*per_layer.values())) > 1:
        assert algo == "MIXED_PRECISION"
        qc = json.loads((tmp_path / "trt" / "quant_cfg.json").read_text())
        assert "trtmoe_granularity" not in qc
        assert qc["quantized_layers"] and all(k.endswith((".mlp.fc", ".mlp.proj")) and ".experts." not in k
                                              for k in qc["quantized_layers"])
    else:
        assert algo in ("W8A16", "W4A16")
    # This calibration keeps no activation statistics (calib.json alone): int4 is rounded to nearest.
    cli("convert", mixtral8_bf16, "-o", tmp_path / "emb", "--calib", bf16_calib, "--budget", "6.5", *fm,
        "--rounding", "rtn")
    q = json.loads((tmp_path / "emb" / "config.json").read_text())["trtmoe"]["quantization"]
    assert q["granularity"] == "matrix" and "expert_formats" not in q
    mf = q["matrix_formats"]
    assert set(mf) == {"fc", "proj"} and set(mf["fc"]) == set(mf["proj"]) == {"0", "1", "2"}
    assert mf["fc"] != mf["proj"], mf  # the allocator used the freedom to part an expert's matrices
    qc = json.loads((tmp_path / "emb" / "quant_cfg.json").read_text())
    assert qc["trtmoe_granularity"] == "trtmoe-per-expert"
    assert any(".experts." in k for k in qc["quantized_layers"])
    for l, fs in mf["fc"].items():
        for s, f in enumerate(fs):
            for mod, name in (("fc", f), ("proj", mf["proj"][l][s])):
                entry = qc["quantized_layers"].get(f"transformer.layers.{l}.mlp.experts.{s}.{mod}")
                assert (entry is None) == (name == "float")
                if entry is not None:
                    assert entry == FORMATS[name].trtllm_layer_config()
    cli("convert", mixtral8_bf16, "-o", tmp_path / "embx", "--calib", bf16_calib, "--budget", "6.5", *fm,
        "--granularity", "expert", "--rounding", "rtn")
    q = json.loads((tmp_path / "embx" / "config.json").read_text())["trtmoe"]["quantization"]
    assert q["granularity"] == "expert" and "matrix_formats" not in q
    assert any(len(set(fs)) > 1 for fs in q["expert_formats"].values()), q["expert_formats"]
    # All three run in the embedded engine.
    for d in ("trt", "emb", "embx"):
        assert torch.isfinite(EmbeddedEngine.from_checkpoint(tmp_path / d, device="cpu").logits(_ids(1, 8))).all()


def test_matrix_granularity_for_tensorrt_llm_is_exit_2(mixtral8_bf16, bf16_calib, tmp_path):
    res = cli("convert", mixtral8_bf16, "-o", tmp_path / "ck", "--calib", bf16_calib, "--budget", "6",
              "--formats", "fp16,int8,int4", "--target", "tensorrt-llm", "--granularity", "matrix", expect=2)
    out = " ".join(res.output.split())
    assert "one format per MoE layer" in out and "fc and proj" in out and "embedded engine" in out, out
    assert "--granularity layer" in out
    assert not (tmp_path / "ck").exists()


# ---- placement -------------------------------------------------------------------------------------------------
def test_balanced_placement_leaves_logits_unchanged(skewed, tmp_path):
    cal = _calib(skewed, tmp_path, _ids(8, 32))
    lay = ("--tp", "2", "--moe-ep", "2", "--dtype", "float32")
    cli("convert", skewed, "-o", tmp_path / "ident", *lay)
    res = cli("convert", skewed, "-o", tmp_path / "bal", *lay, "--calib", cal, "--placement", "balanced", "--json")
    place = json.loads((tmp_path / "bal" / "config.json").read_text())["trtmoe"]["quantization"]["placement"]
    assert place["0"] != list(range(E))  # layer 0 is skewed: it must be permuted
    summary = json.loads(res.output)
    rep = summary["quantization"]["placement"]["0"]
    assert rep["after_max_over_mean"] < rep["before_max_over_mean"]
    ids = _ids(3, 20, seed=9)
    a = EmbeddedEngine.from_checkpoint(tmp_path / "ident", device="cpu").logits(ids)
    b = EmbeddedEngine.from_checkpoint(tmp_path / "bal", device="cpu").logits(ids)
    assert float((a - b).abs().max() / a.abs().max()) <= 1e-5
    # The evaluation maps slots back to expert ids: routing agrees exactly despite the permutation.
    ev = Reference(tmp_path / "ident", ids).compare(tmp_path / "bal")
    assert all(v["topk_set_agreement"] == 1.0 for v in ev["router"]["layers"].values())
    assert ev["kl"]["max"] <= 1e-6


# ---- bad input ---------------------------------------------------------------------------------------------------
def test_empty_calibration_data_is_exit_2(mixtral8_bf16, tokdir, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    res = cli("calibrate", mixtral8_bf16, "--data", tmp_path / "empty.txt", "--tokenizer", tokdir,
              "-o", tmp_path / "c", expect=2)
    assert "error" in res.output.lower() and not (tmp_path / "c" / "calib.json").exists()


@pytest.mark.parametrize("budget", ["2", "17"])
def test_budget_outside_feasible_range_is_exit_2(mixtral8_bf16, bf16_calib, tmp_path, budget):
    res = cli("convert", mixtral8_bf16, "-o", tmp_path / "ck", "--calib", bf16_calib, "--budget", budget,
              "--formats", "fp16,int8,int4", expect=2)
    assert "feasible range" in res.output and not (tmp_path / "ck").exists()


def test_expert_granularity_for_tensorrt_llm_is_exit_2(mixtral8_bf16, bf16_calib, tmp_path):
    y = tmp_path / "q.yaml"
    y.write_text(yaml.safe_dump({"quantize": {"granularity": "expert", "budget_bpw": 6.0,
                                              "calib": str(bf16_calib)}}))
    res = cli("convert", mixtral8_bf16, "-o", tmp_path / "ck", "-c", y, "--target", "tensorrt-llm", expect=2)
    assert "one format per MoE layer" in " ".join(res.output.split())
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("fmt,group", [("int4_g128", 128), ("int4_g64", 64)])
def test_group_int4_on_small_dims_is_exit_2(mixtral8_bf16, tmp_path, fmt, group):
    # H=64 fits a 64-group but the expert FFN size 48 fits neither group size.
    res = cli("convert", mixtral8_bf16, "-o", tmp_path / "ck", "--policy", "uniform", "--format", fmt, expect=2)
    assert f"multiples of {group}" in " ".join(res.output.split())
    assert not (tmp_path / "ck").exists()


def test_report_without_inputs_is_exit_2(tmp_path):
    res = cli("report", "--ref", tmp_path, "-o", tmp_path / "r", expect=2)
    assert "nothing to report" in res.output


# ---- the plan as the engine sees it ---------------------------------------------------------------------------------
def test_placement_and_formats_round_trip_through_the_checkpoint(skewed, tmp_path):
    from trtmoe.report.quality import expert_format_grid, placement_of

    cal = json.loads((_calib(skewed, tmp_path, _ids(8, 32)) / "calib.json").read_text())
    from trtmoe.quant.policies import placement

    plan = make_plan(cal, "graded", budget_bpw=10.0, formats=["float", "int8", "int4"], dtype=torch.float32)
    plan = plan.placed(placement(cal, Mapping.create(tp=2, moe_ep=2))[0])
    ck = convert(skewed, tmp_path / "ck", tp=2, moe_ep=2, quant=plan).out_dir
    assert placement_of(ck) == {l: p for l, p in plan.permutations.items()}
    assert expert_format_grid(ck) == plan.formats
    assert isinstance(plan, QuantPlan)
    # Per matrix: both grids come back per original expert id, through the same permutation.
    from trtmoe.report.quality import matrix_format_grid

    mplan = make_plan(cal, "graded", budget_bpw=6.0, granularity="matrix", formats=["float", "int8", "int4"],
                      dtype=torch.float32)
    assert mplan.formats != mplan.proj_formats  # the case worth checking: fc and proj parted somewhere
    mplan = mplan.placed(plan.permutations)
    ck = convert(skewed, tmp_path / "ckm", tp=2, moe_ep=2, quant=mplan).out_dir
    assert matrix_format_grid(ck) == {"fc": mplan.formats, "proj": mplan.proj_formats}
    assert QuantPlan.from_dict(json.loads(json.dumps(mplan.to_dict()))).proj_formats == mplan.proj_formats


# ---- group-wise INT4 with two group sizes (g64 / g128) ------------------------------------------------------
GROUP_CYCLE = ["int4_g64", "int4_g128", "int8", "float"]


@pytest.fixture(scope="module")
def mixtral_h128(tiny_model):
    """Tiny Mixtral (float32) whose expert GEMMs fit both group sizes: hidden 128, expert FFN 128."""
    return tiny_model("mixtral", num_local_experts=E, num_hidden_layers=3, seed=4, hidden_size=128,
                      intermediate_size=128, head_dim=32)


def _hf_expert(model: Path, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc = [up; gate], proj) of HF expert ``e``, read straight from the source file."""
    t = load_file(str(model / "model.safetensors"))
    pre = MOE.format(l=layer) + f"experts.{e}."
    return torch.cat([t[pre + "w3.weight"], t[pre + "w1.weight"]]), t[pre + "w2.weight"]


def _dequant_group_int4(weight: torch.Tensor, scale: torch.Tensor, prequant: torch.Tensor) -> torch.Tensor:
    """W4A16_AWQ bytes [..., out/2, in] (row 2j low nibble) + scales [..., out, in/g] -> [..., out, in],
    written independently of trtmoe.quant.formats; the group size is read off the shapes."""
    b = weight.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, b >> 4
    lo, hi = lo - 16 * (lo >= 8), hi - 16 * (hi >= 8)
    q = torch.stack((lo, hi), dim=-2).flatten(-3, -2).float()  # [..., out, in]
    group = q.shape[-1] // scale.shape[-1]
    return q * scale.float().repeat_interleave(group, dim=-1) * prequant.float().reshape(-1)


def _manual_bank(ck: Path, plan: QuantPlan, layer: int) -> FloatExperts:
    """Float experts rebuilt from the rank file's bytes (per-expert or stacked layout), each matrix in
    the format the plan gives it."""
    f = SafetensorsFile(ck / "rank0.safetensors")
    try:
        fcs, projs = [], []
        for s in range(E):
            ws = []
            for mod in ("fc", "proj"):
                name = plan.slot_matrix_format(layer, s, mod, E)
                if plan.per_expert_layout:
                    ws.append(_manual_matrix(f, f"transformer.layers.{layer}.mlp.experts.{s}.{mod}.", name))
                else:
                    ws.append(_manual_matrix(f, f"transformer.layers.{layer}.mlp.{mod}.", name, lambda t: t[s]))
            fcs.append(ws[0])
            projs.append(ws[1])
        return FloatExperts(torch.stack(fcs), torch.stack(projs), "float32")
    finally:
        f.close()


def _engine_matches_manual(ck: Path, plan: QuantPlan, ref_ck: Path) -> None:
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    manual = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    for l, lay in enumerate(eng.layers):
        assert isinstance(lay.experts, PackedExperts)
        assert [lay.experts.formats_of(s) for s in range(E)] == [
            tuple(plan.slot_matrix_format(l, s, mod, E) for mod in ("fc", "proj")) for s in range(E)]
        manual.layers[l].experts = _manual_bank(ck, plan, l)
    ids = _ids(2, 24, seed=6)
    a, b = eng.logits(ids), manual.logits(ids)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    ref = EmbeddedEngine.from_checkpoint(ref_ck, device="cpu").logits(ids)
    assert (ref - a).abs().max() > 1e-3  # the quantization is real


@pytest.fixture(scope="module")
def h128_float_ck(mixtral_h128, tmp_path_factory):
    return convert(mixtral_h128, tmp_path_factory.mktemp("h128") / "fp").out_dir


def test_per_expert_mix_of_g64_g128_int8_runs_from_its_bytes(mixtral_h128, h128_float_ck, tmp_path):
    plan = QuantPlan({l: [GROUP_CYCLE[(e + l) % 4] for e in range(E)] for l in range(3)}, granularity="expert")
    ck = convert(mixtral_h128, tmp_path / "ck", quant=plan).out_dir
    f = SafetensorsFile(ck / "rank0.safetensors")
    try:
        for l in range(3):
            for s in range(E):
                name = plan.formats[l][s]
                fc, proj = _hf_expert(mixtral_h128, l, s)
                for mod, w, in_f in (("fc", fc, 128), ("proj", proj, 128)):
                    pre = f"transformer.layers.{l}.mlp.experts.{s}.{mod}."
                    if name.startswith("int4_g"):
                        g = 64 if name == "int4_g64" else 128
                        assert f.tensors[pre + "weights_scaling_factor"].shape == (w.shape[0], in_f // g)
                        assert f.tensors[pre + "weight"].shape == (w.shape[0] // 2, in_f)
                    # Byte for byte what the format packs from the HF weight.
                    want = format_obj(name, torch.float32).quantize(w, dtype=torch.float32)
                    got = {k[len(pre):]: f.read(k) for k in f.tensors if k.startswith(pre)}
                    assert got.keys() == want.keys(), (l, s, name)
                    assert all(torch.equal(got[k], want[k]) for k in want), (l, s, name)
    finally:
        f.close()
    qc = json.loads((ck / "quant_cfg.json").read_text())
    assert qc["trtmoe_granularity"] == "trtmoe-per-expert"
    for l in range(3):
        for s in range(E):
            entry = qc["quantized_layers"].get(f"transformer.layers.{l}.mlp.experts.{s}.fc")
            name = plan.formats[l][s]
            if name == "float":
                assert entry is None
            elif name == "int8":
                assert entry == {"quant_algo": "W8A16"}
            else:
                assert entry["quant_algo"] == "W4A16_AWQ" and entry["group_size"] == int(name[len("int4_g"):])
    _engine_matches_manual(ck, plan, h128_float_ck)


def test_layer_plan_mixing_g64_and_g128_is_mixed_precision(mixtral_h128, h128_float_ck, tmp_path):
    plan = QuantPlan({0: ["int4_g64"] * E, 1: ["int4_g128"] * E, 2: ["int4_g64"] * E}, granularity="layer")
    ck = convert(mixtral_h128, tmp_path / "ck", quant=plan).out_dir
    cfg = json.loads((ck / "config.json").read_text())
    # group_size is one value per plain config, so two group sizes can only be said per layer.
    assert cfg["quantization"] == {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None}
    qc = json.loads((ck / "quant_cfg.json").read_text())
    assert "trtmoe_granularity" not in qc
    want = {}
    for l, g in ((0, 64), (1, 128), (2, 64)):
        for mod in ("fc", "proj"):
            want[f"transformer.layers.{l}.mlp.{mod}"] = {"quant_algo": "W4A16_AWQ", "group_size": g,
                                                        "has_zero_point": False, "pre_quant_scale": True}
    assert qc["quantized_layers"] == want
    f = SafetensorsFile(ck / "rank0.safetensors")
    try:
        for l, g in ((0, 64), (1, 128), (2, 64)):
            p = f"transformer.layers.{l}.mlp."
            assert f.tensors[p + "fc.weight"].shape == (E, 128, 128)  # [E, 2I/2, H]
            assert f.tensors[p + "fc.weights_scaling_factor"].shape == (E, 256, 128 // g)
            assert f.tensors[p + "proj.weights_scaling_factor"].shape == (E, 128, 128 // g)
            assert f.tensors[p + "fc.prequant_scaling_factor"].shape == (1, 128)
            fc, proj = _hf_expert(mixtral_h128, l, 5)
            packed = FORMATS[f"int4_g{g}"].quantize(proj, dtype=torch.float32)
            assert torch.equal(f.read(p + "proj.weight")[5], packed["weight"])
            assert torch.equal(f.read(p + "proj.weights_scaling_factor")[5], packed["weights_scaling_factor"])
    finally:
        f.close()
    _engine_matches_manual(ck, plan, h128_float_ck)


def test_uniform_g64_is_a_plain_awq_config_and_fits_moe_tp2(mixtral_h128, tmp_path):
    res = cli("convert", mixtral_h128, "-o", tmp_path / "g64", "--policy", "uniform", "--format", "int4_g64",
              "--tp", "2", "--moe-tp", "2")
    cfg = json.loads((tmp_path / "g64" / "config.json").read_text())
    q = cfg["quantization"]
    assert (q["quant_algo"], q["group_size"], q["has_zero_point"], q["pre_quant_scale"]) == (
        "W4A16_AWQ", 64, False, True), res.output
    assert not (tmp_path / "g64" / "quant_cfg.json").exists()
    # moe_tp=2 leaves 64 FFN columns per rank: one 64-group in proj's scales, too few for g128.
    f = SafetensorsFile(tmp_path / "g64" / "rank1.safetensors")
    try:
        assert f.tensors["transformer.layers.0.mlp.proj.weights_scaling_factor"].shape == (E, 128, 1)
        assert f.tensors["transformer.layers.0.mlp.fc.weights_scaling_factor"].shape == (E, 128, 2)
    finally:
        f.close()
    eng = EmbeddedEngine.from_checkpoint(tmp_path / "g64", device="cpu")
    assert torch.isfinite(eng.logits(_ids(1, 8))).all()
    res = cli("convert", mixtral_h128, "-o", tmp_path / "g128", "--policy", "uniform", "--format", "int4_g128",
              "--tp", "2", "--moe-tp", "2", expect=2)
    out = " ".join(res.output.split())
    assert "per-rank expert FFN size (64) to be multiples of 128" in out and "int4_g64" in out
    assert not (tmp_path / "g128").exists()


def test_calibration_measures_g64_and_the_allocator_drops_what_does_not_fit(mixtral_h128, tmp_path):
    cal = json.loads((_calib(mixtral_h128, tmp_path, _ids(8, 32), formats=("int8", "int4_g128", "int4_g64"))
                      / "calib.json").read_text())
    assert cal["formats"] == ["int8", "int4_g128", "int4_g64"]
    # 64-groups cost one more scale per 128 weights, stored in the model dtype (float32 here): 32/128 bpw.
    bpw = cal["bits_per_weight"]
    assert bpw["int4_g64"] - bpw["int4_g128"] == pytest.approx(32 / 128, abs=1e-12)
    # Measured through g64's own numerics: finer groups reproduce the experts more closely.
    for m in ("fc", "proj"):
        mse = cal["sensitivity"]["matrices"][m]["output_mse"]
        assert sum(map(sum, mse["int4_g64"])) < sum(map(sum, mse["int4_g128"])), m
    names = lambda units: {f for u in units for f in u.costs_bits}  # noqa: E731
    assert names(build_units(cal, "expert", torch.float32)) == {"float", "int8", "int4_g128", "int4_g64"}
    # moe_tp=2: I_loc=64 keeps g64 and drops g128.
    assert names(build_units(cal, "expert", torch.float32, I_loc=64)) == {"float", "int8", "int4_g64"}
    plan = make_plan(cal, "graded", budget_bpw=5.0, dtype=torch.float32, I_loc=64)
    assert "int4_g64" in plan.used_formats() and "int4_g128" not in plan.used_formats()
    # Per matrix, only proj's input (the 64 FFN columns per rank) is too short for 128-groups; fc's
    # input is the hidden size (128), so fc keeps g128.
    units = build_units(cal, "matrix", torch.float32, I_loc=64)
    assert names([u for u in units if u.key[2] == "fc"]) == {"float", "int8", "int4_g128", "int4_g64"}
    assert names([u for u in units if u.key[2] == "proj"]) == {"float", "int8", "int4_g64"}


# ---- per-matrix formats (fc and proj of one expert apart) -------------------------------------------------
def _every_pair_plan(perm: dict | None = None) -> QuantPlan:
    """All 16 (fc, proj) pairs of GROUP_CYCLE over the 24 experts of three layers (i = 8·l + e)."""
    fc = {l: [GROUP_CYCLE[(8 * l + e) % 4] for e in range(E)] for l in range(3)}
    proj = {l: [GROUP_CYCLE[((8 * l + e) // 4) % 4] for e in range(E)] for l in range(3)}
    return QuantPlan(fc, granularity="matrix", proj_formats=proj, permutations=perm or {})


def test_per_matrix_mix_round_trips_byte_exact_and_runs_from_its_bytes(mixtral_h128, h128_float_ck, tmp_path):
    perm = {1: list(reversed(range(E)))}  # slots != expert ids in layer 1: both matrices must follow
    plan = _every_pair_plan(perm)
    pairs = {(plan.matrix_format(l, e, "fc"), plan.matrix_format(l, e, "proj")) for l in range(3) for e in range(E)}
    assert len(pairs) == 16
    ck = convert(mixtral_h128, tmp_path / "ck", quant=plan).out_dir
    f = SafetensorsFile(ck / "rank0.safetensors")
    try:
        for l in range(3):
            for s in range(E):
                e = plan.perm(l, E)[s]
                fc, proj = _hf_expert(mixtral_h128, l, e)
                for mod, w in (("fc", fc), ("proj", proj)):
                    name = plan.matrix_format(l, e, mod)
                    pre = f"transformer.layers.{l}.mlp.experts.{s}.{mod}."
                    want = format_obj(name, torch.float32).quantize(w, dtype=torch.float32)
                    got = {k[len(pre):]: f.read(k) for k in f.tensors if k.startswith(pre)}
                    assert got.keys() == want.keys(), (l, s, mod, name)
                    assert all(torch.equal(got[k], want[k]) for k in want), (l, s, mod, name)
    finally:
        f.close()
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["quantization"] == {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None}
    q = cfg["trtmoe"]["quantization"]
    assert q["granularity"] == "matrix" and "expert_formats" not in q
    for mod in ("fc", "proj"):
        assert q["matrix_formats"][mod] == {str(l): [plan.slot_matrix_format(l, s, mod, E) for s in range(E)]
                                            for l in range(3)}
    qc = json.loads((ck / "quant_cfg.json").read_text())
    assert qc["trtmoe_granularity"] == "trtmoe-per-expert"
    want_entries = {}
    for l in range(3):
        for s in range(E):
            for mod in ("fc", "proj"):
                name = plan.slot_matrix_format(l, s, mod, E)
                if name != "float":
                    want_entries[f"transformer.layers.{l}.mlp.experts.{s}.{mod}"] = FORMATS[name].trtllm_layer_config()
    assert qc["quantized_layers"] == want_entries
    _engine_matches_manual(ck, plan, h128_float_ck)
    # Stored bytes are what the per-matrix costs say: the allocator's accounting is the file's.
    from trtmoe.quant.policies import matrix_cost_bits
    from trtmoe.report.quality import checkpoint_footprint

    bits = sum(matrix_cost_bits(plan.matrix_format(l, e, m), m, 128, 128, torch.float32)
               for l in range(3) for e in range(E) for m in ("fc", "proj"))
    fp = checkpoint_footprint(ck)
    assert 8 * fp["ranks"][0]["routed_expert_bytes_stored"] == bits
    # verify rechecks the files and the config; the per-expert layout is refused by TensorRT-LLM builds.
    res = cli("verify", ck, "--json")
    assert json.loads(res.output)["kind"] == "trtllm-checkpoint"


def test_per_matrix_shapes_are_checked_per_matrix(mixtral_h128, tmp_path):
    """moe_tp=2 leaves 64 FFN columns per rank: g128 still fits fc (input = hidden size 128) but not proj."""
    from trtmoe.errors import UnsupportedError

    ok = QuantPlan({l: ["int4_g128"] * E for l in range(3)}, granularity="matrix",
                   proj_formats={l: ["int4_g64"] * E for l in range(3)})
    ck = convert(mixtral_h128, tmp_path / "ok", tp=2, moe_tp=2, quant=ok).out_dir
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    assert eng.layers[0].experts.formats_of(3) == ("int4_g128", "int4_g64")
    assert len(eng.layers[0].experts.shards[3]) == 2  # one shard per moe_tp rank, summed
    ref = EmbeddedEngine.from_checkpoint(convert(mixtral_h128, tmp_path / "ok1", quant=ok).out_dir, device="cpu")
    ids = _ids(2, 16, seed=8)
    # Per-rank groups and scales differ from tp=1 only in how proj's columns are grouped; g64 groups
    # never straddle the split, so both layouts compute the same expert outputs up to summation order.
    a, b = eng.logits(ids), ref.logits(ids)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    bad = QuantPlan({l: ["int4_g64"] * E for l in range(3)}, granularity="matrix",
                    proj_formats={l: ["int4_g128"] * E for l in range(3)})
    with pytest.raises(UnsupportedError, match=r"int4_g128 cannot store the experts' proj \[128, 64\]"):
        convert(mixtral_h128, tmp_path / "bad", tp=2, moe_tp=2, quant=bad)
    assert not (tmp_path / "bad").exists()
