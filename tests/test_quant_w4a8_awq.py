"""Activation-aware search (pre-quant scale, clip) for W4A8 AWQ, measured as the kernel runs it."""

from conftest import no_w4a8_search
import pytest
import torch

from trtmoe.errors import InputError
from trtmoe.quant.awq import search_w4a8, w4a8_output_error
from trtmoe.quant.formats import FORMATS

FMT = FORMATS["w4a8_awq"]


def _case(seed: int, outliers: bool):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(512, 256, generator=g)
    if outliers:  # a few input channels much larger than the rest, as in real activations
        scale = torch.ones(256)
        scale[torch.randperm(256, generator=g)[:8]] = 30.0
        x = x * scale * torch.exp(0.5 * torch.randn(256, generator=g))
    return w, x.to(torch.bfloat16).float()


@pytest.mark.parametrize("seed", [0, 1])
def test_search_lowers_output_error_vs_plain_rounding(seed):
    w, x = _case(seed, outliers=True)
    packed, info = search_w4a8(FMT, w, x, dtype=torch.bfloat16)
    rtn = FMT.quantize(w, dtype=torch.bfloat16, input_amax=x.abs().amax(0).to(torch.bfloat16))
    y = x @ w.float().T
    rtn_err = w4a8_output_error(FMT, rtn, x, y)
    err = w4a8_output_error(FMT, packed, x, y)
    assert info["rtn_error"] == pytest.approx(rtn_err, rel=1e-6)
    assert info["error"] == pytest.approx(err, rel=1e-6)
    assert err < 0.8 * rtn_err, (err, rtn_err, info)
    assert info["alpha"] > 0 and not torch.all(packed["pre_quant_scale"] == 1)
    # the result is an ordinary packed matrix of the format: the pre-quant scale is positive, the input
    # scale follows the pre-scaled inputs' amax
    assert bool((packed["pre_quant_scale"].float() > 0).all())
    pq = packed["pre_quant_scale"].float()
    amax = float((x.abs().amax(0).to(torch.bfloat16).float() * pq).max())
    assert float(packed["input_scale"]) == pytest.approx(amax / 448.0, rel=1e-2)


def test_search_never_worse_than_plain_rounding():
    w, x = _case(2, outliers=False)
    _, info = search_w4a8(FMT, w, x, dtype=torch.bfloat16)
    assert info["error"] <= info["rtn_error"]


def test_search_refuses_other_formats_and_shapes():
    w, x = _case(3, outliers=False)
    with pytest.raises(InputError):
        search_w4a8(FORMATS["int4_g128"], w, x, dtype=torch.bfloat16)
    with pytest.raises(InputError):
        search_w4a8(FMT, w, x[:, :128], dtype=torch.bfloat16)


def _correlated(seed: int, n: int, draw: int):
    """``n`` rows (draw ``draw``) of one distribution (``seed``) whose input channels are correlated and
    unevenly scaled, as a layer's activations are."""
    mix = torch.eye(256) + 0.3 * torch.randn(256, 256, generator=torch.Generator().manual_seed(seed)) / 16
    g = torch.Generator().manual_seed(1000 * seed + draw)
    return ((torch.randn(n, 256, generator=g) * torch.linspace(0.2, 3.0, 256)) @ mix).to(torch.bfloat16).float()


@pytest.mark.parametrize("seed", [0, 1])
def test_error_feedback_codes_lower_the_w4a8_output_error_on_other_tokens(seed):
    """Under awq_gptq the searched recipe (pre-quant scale, clip) gets error-feedback codes: every tensor
    but the INT4 weight is the recipe's, the codes are INT4's, and the kernel's output error is lower on
    tokens the codes were not chosen on."""
    from trtmoe.quant import awq

    g = torch.Generator().manual_seed(100 + seed)
    w = (torch.randn(256, 256, generator=g) * 0.05).to(torch.bfloat16)
    x, x_new = _correlated(seed, 2048, 0), _correlated(seed, 2048, 1)
    amax = torch.maximum(x.abs().amax(0), x_new.abs().amax(0))
    base = awq.w4a8_recipe(FMT, w, x, dtype=torch.bfloat16, input_amax=amax)
    stats = awq.MatrixStats(x.abs().mean(0), x, x.shape[0], gram=x.T @ x)
    chose = []
    rec = awq.with_codes(FMT, w, torch.bfloat16, stats, base, on_choice=chose.append)
    assert chose == [0] and rec.codes is not None and int(rec.codes.min()) >= -8 and int(rec.codes.max()) <= 7
    a, b = (awq.apply(FMT, w, torch.bfloat16, r, input_amax=amax) for r in (base, rec))
    assert a.keys() == b.keys() and not torch.equal(a["weight"], b["weight"])
    assert all(torch.equal(a[k], b[k]) for k in a if k != "weight")
    y = x_new @ w.float().T
    assert w4a8_output_error(FMT, b, x_new, y) < 0.95 * w4a8_output_error(FMT, a, x_new, y)
    # what is chosen is what is computed again from the same choice
    again = awq.with_codes(FMT, w, torch.bfloat16, stats, base, choice=0)
    assert torch.equal(again.codes, rec.codes)


# ---- the search wired into calibrate and convert --------------------------------------------------
# A 4-expert bf16 Mixtral (hidden 128 and expert FFN 128: one group of 128 inputs per row of each
# matrix) calibrated with awq rounding on W4A8 alone; its artifact keeps the recipes the search chose.

L, E = 2, 4
DT = torch.bfloat16


@pytest.fixture(scope="module")
def w4cal(tiny_model, tmp_path_factory):
    import shutil

    from conftest import TRAINED_MIXTRAL

    from trtmoe.data import write_split_text
    from trtmoe.quant.calibrate import calibrate

    tmp = tmp_path_factory.mktemp("w4a8cal")
    src = tiny_model("mixtral", num_local_experts=E, num_hidden_layers=L, seed=11, hidden_size=128,
                     intermediate_size=128, head_dim=32, dtype="bfloat16", vocab_size=2048)
    model = shutil.copytree(src, tmp / "m")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(TRAINED_MIXTRAL / f, model / f)
    text = tmp / "calib.txt"
    write_split_text("calib", text, max_bytes=20000)
    cal = tmp / "cal"
    calibrate(model, text, cal, samples=4, seq_len=32, formats=("w4a8_awq",), rounding="awq")
    return model, cal


def _expert(model, l, e):
    from safetensors.torch import load_file

    t = load_file(str(model / "model.safetensors"))
    p = f"model.layers.{l}.block_sparse_moe.experts.{e}."
    return {"fc": torch.cat([t[p + "w3.weight"], t[p + "w1.weight"]]), "proj": t[p + "w2.weight"]}


def _calib_state(cal):
    import json

    from trtmoe.quant import awq

    c = json.loads((cal / "calib.json").read_text())
    amax = {int(l): {m: torch.tensor(v) for m, v in d.items()} for l, d in c["input_amax"].items()}
    return c, amax, awq.ActivationStats.load(cal / awq.ACT_FILE)


def _searched(model, cal):
    """Per (layer, expert, matrix): the weight, its routed-token rows, the layer's input amax and the
    recipe the search finds on them now (what calibration should have stored)."""
    from trtmoe.quant import awq

    _, amax, acts = _calib_state(cal)
    out = {}
    for l in range(L):
        for e in range(E):
            ws = _expert(model, l, e)
            for m in ("fc", "proj"):
                st = acts.get(l, e, m)
                if m == "proj":
                    st = st.with_fc(lambda e=e, ws=ws: ws["fc"])
                rows = st.rows
                rec = awq.w4a8_recipe(FMT, ws[m], rows, dtype=DT, input_amax=amax[l][m])
                out[l, e, m] = (ws[m], rows, amax[l][m], rec)
    return out


def test_calibration_stores_w4a8_recipes_and_they_beat_rounding_to_nearest(w4cal):
    """Calibration searches every W4A8 expert matrix (per-channel input amax of the layer, FP8 inputs) and
    keeps the pre-quant scale and clip it chose; re-searching the same rows gives the same recipe, and
    on the calibration inputs its output error is never above round-to-nearest's (and below it for
    some matrices, with pre-quant scales that are not all ones)."""
    from trtmoe.quant import awq

    model, cal = w4cal
    c, _, acts = _calib_state(cal)
    assert c["rounding"] == "awq" and "w4a8_awq" in c["formats"]
    found = _searched(model, cal)
    scaled = better = 0
    for (l, e, m), (w, rows, amax, rec) in found.items():
        rid = awq.recipe_id("w4a8_awq", e, m, (0, 128), False, DT)
        got = acts.recipes.get(l, rid, awq.weight_fingerprint(w, DT))
        assert got is not None, (l, e, m)
        pq, clip, _ = got
        want_pq = None if rec is None else rec.pq
        want_clip = None if rec is None else rec.clip
        assert (pq is None) == (want_pq is None) and (pq is None or torch.equal(pq, want_pq)), (l, e, m)
        assert (clip is None) == (want_clip is None) and (clip is None or torch.equal(clip, want_clip)), (l, e, m)
        y = rows.float() @ w.to(DT).float().T
        rtn = awq.w4a8_output_error(FMT, FMT.quantize(w, dtype=DT, input_amax=amax), rows.float(), y)
        err = awq.w4a8_output_error(FMT, awq.apply(FMT, w, DT, rec, input_amax=amax), rows.float(), y)
        assert err <= rtn, (l, e, m, err, rtn)
        better += err < rtn
        scaled += pq is not None and not bool(torch.all(pq == 1))
    assert scaled > 0 and better > 0, (scaled, better)


def test_convert_reapplies_the_calibrations_w4a8_recipes(w4cal, tmp_path, monkeypatch):
    """An embedded per-expert checkpoint of the calibration's plan takes the stored recipes without
    searching, and each expert matrix holds exactly the tensors the search's recipe gives (pre-quant
    scale included; the input scale that of the pre-scaled inputs)."""
    from trtmoe.checkpoint.writer import convert
    from trtmoe.hf.safetensors_io import SafetensorsFile
    from trtmoe.quant import awq
    from trtmoe.quant.plan import QuantPlan

    model, cal = w4cal
    c, amax, _ = _calib_state(cal)
    plan = QuantPlan({l: ["w4a8_awq"] * E for l in range(L)}, granularity="matrix", dtype=DT,
                     meta={"input_amax": {str(l): {m: v.tolist() for m, v in d.items()} for l, d in amax.items()}})
    plan = awq.attach(plan, "awq", cal)
    awq._RECIPES.clear()
    with monkeypatch.context() as mp:
        no_w4a8_search(mp)
        ck = convert(model, tmp_path / "ck", quant=plan).out_dir
    f = SafetensorsFile(ck / "rank0.safetensors")
    try:
        t = {n: f.read(n) for n in f.tensors}
    finally:
        f.close()
    for (l, e, m), (w, rows, a, rec) in _searched(model, cal).items():
        want = awq.apply(FMT, w, DT, rec, input_amax=a)
        p = f"transformer.layers.{l}.mlp.experts.{e}.{m}."
        got = {k[len(p):]: v for k, v in t.items() if k.startswith(p)}
        assert got.keys() == want.keys(), (got.keys(), want.keys())
        for k in want:
            assert torch.equal(got[k].reshape(want[k].shape), want[k]), (l, e, m, k)
        pq = want["pre_quant_scale"].float()
        assert float(want["input_scale"]) == pytest.approx(float((a.float() * pq).max().to(DT)) / 448, rel=1e-6)


@pytest.fixture(scope="module")
def w4unified(w4cal, tmp_path_factory):
    """The calibration's uniform W4A8 unified-HF export (routed experts), and one rounded to nearest."""
    from trtmoe.build.unified_hf import convert_unified
    from trtmoe.quant import awq

    model, cal = w4cal
    tmp = tmp_path_factory.mktemp("w4u")
    awq._RECIPES.clear()
    convert_unified(model, tmp / "searched", target="trtllm-pytorch", layer_formats=[f"{l}=w4a8_awq" for l in range(L)], calib=cal)
    return model, cal, tmp / "searched"


def _tensors(ck):
    from safetensors import safe_open

    t = {}
    for f in sorted(ck.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            t.update({k: fh.get_tensor(k) for k in fh.keys()})
    return t


def test_unified_export_writes_the_searched_w4a8_recipe_per_expert(w4unified):
    """Per expert: w1 and w3 carry the same pre-quant scale, weight_scale_2 and input scale (the fused
    [up; gate] matrix's recipe, split), w2 its own; the tensors are the search's; some pre-quant scales
    are not all ones."""
    import json

    from trtmoe.quant import awq

    model, cal, ck = w4unified
    t = _tensors(ck)
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest.get("rounding") == "awq"
    found = _searched(model, cal)
    nontrivial = 0
    for l in range(L):
        p = f"model.layers.{l}.block_sparse_moe.experts"
        for e in range(E):
            w1, w3, w2 = (f"{p}.{e}.{n}" for n in ("w1", "w3", "w2"))
            for k in ("pre_quant_scale", "weight_scale_2", "input_scale"):
                assert torch.equal(t[f"{w1}.{k}"], t[f"{w3}.{k}"]), (l, e, k)
            w, _, a, rec = found[l, e, "fc"]
            fc = awq.apply(FMT, w, DT, rec, input_amax=a)
            up, gate = fc["weight"].chunk(2), fc["weight_scale"].chunk(2)
            assert torch.equal(t[f"{w3}.weight"], up[0]) and torch.equal(t[f"{w1}.weight"], up[1])
            assert torch.equal(t[f"{w3}.weight_scale"], gate[0]) and torch.equal(t[f"{w1}.weight_scale"], gate[1])
            assert torch.equal(t[f"{w1}.pre_quant_scale"], fc["pre_quant_scale"])
            assert torch.equal(t[f"{w1}.input_scale"].reshape(()), fc["input_scale"].reshape(()))
            w, _, a, rec = found[l, e, "proj"]
            proj = awq.apply(FMT, w, DT, rec, input_amax=a)
            for k, v in proj.items():
                assert torch.equal(t[f"{w2}.{k}"].reshape(v.shape), v), (l, e, k)
            nontrivial += sum(not bool(torch.all(t[f"{n}.pre_quant_scale"] == 1)) for n in (w1, w2))
    assert nontrivial > 0


def test_embedded_engine_runs_the_searched_unified_checkpoint_as_its_own_quantization(w4unified):
    """The unified-HF checkpoint loaded by the embedded engine gives the logits of the float engine whose
    routed experts are replaced by the format's own kernel on the recipes' packed tensors; dropping the
    pre-quant scales changes them."""
    from trtmoe.checkpoint.writer import convert
    from trtmoe.quant import awq
    from trtmoe.runtime.engine import EmbeddedEngine
    from trtmoe.runtime.experts import PackedExperts, PackedShard
    from trtmoe.runtime.unified_load import load_unified_engine

    model, cal, ck = w4unified
    found = _searched(model, cal)
    ids = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(3))
    loaded = load_unified_engine(ck, device="cpu")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        ref = EmbeddedEngine.from_checkpoint(convert(model, f"{d}/f").out_dir, device="cpu")
    def bank(l, drop=False):
        packed = {m: [awq.apply(FMT, found[l, e, m][0], DT, found[l, e, m][3], input_amax=found[l, e, m][2])
                      for e in range(E)] for m in ("fc", "proj")}
        if drop:
            packed = {m: [dict(p, pre_quant_scale=torch.ones_like(p["pre_quant_scale"])) for p in ps]
                      for m, ps in packed.items()}
        return PackedExperts([[PackedShard(FMT, packed["fc"][e], FMT, packed["proj"][e])] for e in range(E)],
                             ["w4a8_awq"] * E)

    for l in range(L):
        ref.layers[l].experts = bank(l)
    got, want = loaded.logits(ids).float(), ref.logits(ids).float()
    tol = 1e-3 * float(want.abs().max())
    assert torch.allclose(got, want, atol=tol, rtol=0), float((got - want).abs().max())
    for l in range(L):
        ref.layers[l].experts = bank(l, drop=True)
    assert not torch.allclose(ref.logits(ids).float(), want, atol=tol, rtol=0)


def test_layer_uniform_checkpoint_shares_one_searched_scale_per_layer(w4cal, tmp_path):
    """The embedded engine's layer-uniform layout stores one pre-quant scale (and input scale) per MoE
    layer and matrix kind: the layer's searched scale, shared by every expert, each expert's clip
    searched under it; the experts run exactly those tensors."""
    from trtmoe.checkpoint.writer import convert
    from trtmoe.quant import awq
    from trtmoe.quant.plan import QuantPlan
    from trtmoe.runtime.engine import EmbeddedEngine

    model, cal = w4cal
    _, amax, acts = _calib_state(cal)
    plan = QuantPlan({l: ["w4a8_awq"] * E for l in range(L)}, granularity="layer", dtype=DT,
                     meta={"input_amax": {str(l): {m: v.tolist() for m, v in d.items()} for l, d in amax.items()}})
    ck = convert(model, tmp_path / "ck", quant=awq.attach(plan, "awq", cal)).out_dir
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu", pack_experts=False)
    scaled = 0
    for l in range(L):
        bank = eng.layers[l].experts
        ws = [_expert(model, l, e) for e in range(E)]
        for m in ("fc", "proj"):
            parts = [getattr(bank.shards[e][0], m) for e in range(E)]
            pq = parts[0]["pre_quant_scale"]
            assert all(torch.equal(p["pre_quant_scale"], pq) and torch.equal(p["input_scale"], parts[0]["input_scale"])
                       for p in parts)
            scaled += not bool(torch.all(pq == 1))
            for e in range(E):
                st = acts.get(l, e, m)
                if m == "proj":
                    st = st.with_fc(lambda e=e: ws[e]["fc"])
                rec = awq.w4a8_recipe(FMT, ws[e][m], st.rows, dtype=DT, input_amax=amax[l][m],
                                      pre_quant_scale=pq, search_scale=False)
                want = awq.apply(FMT, ws[e][m], DT, rec, input_amax=amax[l][m])
                for k in ("weight", "weight_scale", "weight_scale_2"):
                    assert torch.equal(parts[e][k].reshape(want[k].shape), want[k]), (l, e, m, k)
    assert scaled > 0


def test_unified_engine_dense_linear_applies_the_pre_quant_scale_to_its_inputs():
    """A W4A8 linear outside the routed experts (a unified-HF checkpoint may quantize attention so) runs
    as the format's kernel does: inputs times the pre-quant scale, then FP8 under the input scale."""
    from trtmoe.runtime.unified_load import QuantLinear

    w, x = _case(4, outliers=True)
    packed, info = search_w4a8(FMT, w, x, dtype=torch.bfloat16)
    assert info["alpha"] > 0
    lin = QuantLinear([(FMT, packed)], torch.device("cpu"), "blas")
    assert torch.allclose(lin(x), FMT.linear(x, packed), rtol=1e-5, atol=1e-5 * float(x.abs().max()))


def test_stored_w4a8_recipes_are_not_searched_again_under_error_feedback_rounding(w4cal, monkeypatch):
    """Under awq_gptq a stored W4A8 recipe's pre-quant scale and clip are taken as they are, without
    searching; the error-feedback codes are computed on them, and since this (awq) calibration stored no
    choice of codes, the matrix counts as searched, as an INT4 matrix does."""
    from trtmoe.quant import awq

    model, cal = w4cal
    _, amax, acts = _calib_state(cal)
    awq._RECIPES.clear()
    r = awq.CheckpointRounding(acts, DT, ("count-test",), "awq_gptq", {l: {m: v.tolist() for m, v in d.items()}
                                                                       for l, d in amax.items()})
    ws = _expert(model, 0, 1)
    with monkeypatch.context() as mp:
        no_w4a8_search(mp)
        rec = r.recipe(FMT, 0, 1, "fc", (0, 128), ws["fc"], lambda e: _expert(model, 0, e)["fc"],
                       matrix=lambda e, m: _expert(model, 0, e)[m])
    want = _searched(model, cal)[0, 1, "fc"][3]
    assert (rec is None) == (want is None) and (rec is None or (torch.equal(rec.pq, want.pq) if want.pq is not None
                                                                else rec.pq is None))
    assert r.counts == {"stored": 0, "searched": 1, "reused": 0}


def test_error_feedback_calibration_exports_its_w4a8_codes_and_an_older_one_is_called_stale(w4cal, tmp_path):
    """An awq_gptq calibration over W4A8 records it (``w4a8_rounding``); the export writes the searched
    recipes' scales with error-feedback weights (differing from the awq export's weights, every other
    tensor equal); a calibration without the key is called stale in the plan's notes."""
    import json
    import shutil

    from trtmoe.build.unified_hf import convert_unified
    from trtmoe.data import write_split_text
    from trtmoe.quant import awq
    from trtmoe.quant.calibrate import calibrate

    model, cal = w4cal
    text = tmp_path / "calib.txt"
    write_split_text("calib", text, max_bytes=100000)
    fb = tmp_path / "cal_fb"
    # Enough routed tokens per expert for error feedback (MIN_ROWS_PER_INPUT per input channel).
    calibrate(model, text, fb, samples=16, seq_len=64, formats=("w4a8_awq",), rounding="awq_gptq")
    calib = json.loads((fb / "calib.json").read_text())
    assert calib["w4a8_rounding"] == "awq_gptq" and not awq.stale_w4a8_codes(calib)
    kw = dict(target="trtllm-pytorch", layer_formats=[f"{l}=w4a8_awq" for l in range(L)])
    awq._RECIPES.clear()
    r = convert_unified(model, tmp_path / "fb", calib=fb, **kw)
    assert not any("predates" in n for n in r.result.plan.meta.get("notes", []))
    a = _tensors(tmp_path / "fb")
    awq._RECIPES.clear()
    b = _tensors(convert_unified(model, tmp_path / "awq", calib=fb, rounding="awq", **kw).result.out_dir)
    assert a.keys() == b.keys()
    differ = {k for k in a if not torch.equal(a[k], b[k])}
    assert differ and all(k.endswith(".weight") and ".experts." in k for k in differ), sorted(differ)[:4]

    old = tmp_path / "old_cal"
    shutil.copytree(fb, old)
    del calib["w4a8_rounding"]
    (old / "calib.json").write_text(json.dumps(calib))
    awq._RECIPES.clear()
    notes = convert_unified(model, tmp_path / "old", calib=old, **kw).result.plan.meta.get("notes", [])
    assert any("predates W4A8's error-feedback codes" in n and "awq_gptq codes" in n for n in notes), notes
    assert awq.stale_w4a8_codes(calib) and not awq.stale_w4a8_codes({**calib, "rounding": "awq"})
