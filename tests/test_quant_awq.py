"""Activation-aware INT4 (``--rounding awq``): statistics from calibration, never worse than
round-to-nearest on the routed tokens, the pre-quant scale where TensorRT-LLM declares one (shared per
stacked fc/proj for its layout, per expert matrix for the embedded engine) and applied by the embedded
engine, the weights written being the ones calibration measured, and ``rtn`` byte-identical to before."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file

from trtmoe.checkpoint.schema import moe_prequant_problems
from trtmoe.checkpoint.writer import convert
from trtmoe.cli import main
from trtmoe.hf.safetensors_io import SafetensorsFile
from trtmoe.quant import awq
from trtmoe.quant.calibrate import write_calibration, measure
from trtmoe.quant.formats import FORMATS, unpack_int4
from trtmoe.quant.plan import QuantPlan, uniform_plan
from trtmoe.runtime.engine import EmbeddedEngine
from trtmoe.runtime.experts import PackedExperts

E, L = 8, 2
INT4 = ("int4", "int4_g128", "int4_g64")
MOE = "model.layers.{l}.block_sparse_moe."


def cli(*args, expect=0):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == expect, res.output
    return res


@pytest.fixture(scope="module")
def model(tiny_model):
    """bf16 Mixtral whose expert GEMMs fit both group sizes (hidden 128, expert FFN 128)."""
    return tiny_model("mixtral", num_local_experts=E, num_hidden_layers=L, seed=7, hidden_size=128,
                      intermediate_size=128, head_dim=32, dtype="bfloat16")


@pytest.fixture(scope="module")
def calib(model, tmp_path_factory):
    """A calibration artifact (calib.json + activations.safetensors) measured with awq rounding, and
    the statistics object measure() filled."""
    tmp = tmp_path_factory.mktemp("awqcal")
    ck = convert(model, tmp / "ck").out_dir
    ids = torch.randint(0, 250, (8, 32), generator=torch.Generator().manual_seed(0))
    acts = awq.ActivationStats()
    res = measure(EmbeddedEngine.from_checkpoint(ck, device="cpu"), ids, formats=("int8",) + INT4,
                  activations=acts, rounding="awq")
    out = tmp / "calib"
    out.mkdir()
    acts.save(out / awq.ACT_FILE)
    write_calibration(out, res)
    return {"dir": out, "res": res, "acts": acts, "ids": ids, "float_ck": ck}


def _hf_expert(model, l, e):
    t = load_file(str(model / "model.safetensors"))
    pre = MOE.format(l=l) + f"experts.{e}."
    return {"fc": torch.cat([t[pre + "w3.weight"], t[pre + "w1.weight"]]), "proj": t[pre + "w2.weight"]}


def _awq_plan(plan: QuantPlan, calib_dir) -> QuantPlan:
    plan = awq.attach(plan, "awq", calib_dir)
    assert plan.meta["rounding"] == "awq"
    return plan


def _tokenized_model(tiny_model, tmp, seed: int, dtype: str = "bfloat16"):
    """A 4-expert Mixtral (bf16 unless ``dtype`` says otherwise) (both group sizes fit) with the trained fixture's tokenizer, and
    calibration text beside it: what ``calibrate`` needs."""
    import shutil

    from conftest import TRAINED_MIXTRAL

    from trtmoe.data import write_split_text

    src = tiny_model("mixtral", num_local_experts=4, num_hidden_layers=L, seed=seed, hidden_size=128,
                     intermediate_size=128, head_dim=32, dtype=dtype, vocab_size=2048)
    model = shutil.copytree(src, tmp / "m")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(TRAINED_MIXTRAL / f, model / f)
    text = tmp / "calib.txt"
    write_split_text("calib", text, max_bytes=20000)
    return model, text


def _read(ck, prefix):
    f = SafetensorsFile(ck / "rank0.safetensors")
    try:
        return {n[len(prefix):]: f.read(n) for n in f.tensors if n.startswith(prefix)}
    finally:
        f.close()


def test_statistics_are_routed_tokens_and_deterministic(calib, tmp_path):
    res, acts = calib["res"], calib["acts"]
    assert res["rounding"] == "awq" and res["activations"]["file"] == awq.ACT_FILE
    counts = res["routing"]["counts"]
    for l in res["moe_layers"]:
        for e in range(E):
            for m, width in (("fc", 128), ("proj", 128)):
                s = acts.get(l, e, m)
                assert s.count == counts[l][e]
                assert s.rows.shape == (min(s.count, awq.MAX_ROWS) if s.source == "routed" else 256, width)
                assert s.act_mean.shape == (width,) and bool((s.act_mean >= 0).all())
    back = awq.ActivationStats.load(calib["dir"] / awq.ACT_FILE)
    assert back.stats.keys() == acts.stats.keys()
    # A loaded proj rebuilds its rows from the stored MoE inputs through its expert's fc, given then.
    loaded = lambda k: back.get(*k).with_fc(acts.stats[k].inputs.fc)  # noqa: E731
    assert all(torch.equal(loaded(k).rows, acts.stats[k].rows) and
               torch.equal(loaded(k).act_mean, acts.stats[k].act_mean) for k in sorted(acts.stats))
    assert len(back._rows_from.read) == 2  # the sampled rows of at most two layers are held at a time
    back.save(tmp_path / "again.safetensors")
    assert (tmp_path / "again.safetensors").read_bytes() == (calib["dir"] / awq.ACT_FILE).read_bytes()


def test_loaded_statistics_missing_a_matrix_rows_are_refused_when_opened(calib, tmp_path):
    """Rows are read per layer when convert uses them, but a file lacking one matrix's rows is
    refused when it is opened (one InputError naming the tensor), not halfway through a convert."""
    from safetensors.torch import save_file

    from trtmoe.errors import InputError

    src = calib["dir"] / awq.ACT_FILE
    f = SafetensorsFile(src)
    meta = dict(f.metadata or {})
    f.close()
    tensors = load_file(src)
    victim = sorted(k for k in tensors if k.endswith(".rows_from_inputs"))[-1]  # the last layer's: read last
    del tensors[victim]
    bad = tmp_path / awq.ACT_FILE
    save_file(tensors, bad, metadata=meta)
    with pytest.raises(InputError) as e:
        awq.ActivationStats.load(bad)
    assert "malformed" in str(e.value) and victim in str(e.value) and str(bad) in str(e.value)


def test_fc_statistics_are_the_hidden_states_routed_to_the_expert():
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    routed = torch.randint(0, 4, (64, 2))
    fc, proj = torch.randn(4, 24, 16), torch.randn(4, 16, 12)
    st = awq.collect_layer(fc, proj, x, routed, min_routed=1)
    for e in range(4):
        mask = routed.eq(e).any(-1)
        assert torch.equal(st[(e, "fc")].rows, x[mask])
        up, gate = (x[mask] @ fc[e].t()).chunk(2, -1)
        assert torch.allclose(st[(e, "proj")].rows, F.silu(gate) * up)
        assert torch.allclose(st[(e, "fc")].act_mean, x[mask].abs().mean(0))


@pytest.mark.parametrize("name", INT4)
def test_awq_error_not_above_rtn_on_routed_tokens_per_matrix(model, calib, name):
    fmt, acts = FORMATS[name], calib["acts"]
    tot_awq = tot_rtn = 0.0
    for l in range(L):
        for e in range(E):
            w = _hf_expert(model, l, e)
            for m in ("fc", "proj"):
                s = acts.get(l, e, m)
                a = awq.output_error(fmt, awq.quantize(fmt, w[m], dtype=torch.bfloat16, stats=s), w[m], s.rows,
                                     torch.bfloat16)
                r = awq.output_error(fmt, fmt.quantize(w[m], dtype=torch.bfloat16), w[m], s.rows, torch.bfloat16)
                assert a <= r * (1 + 1e-6), (l, e, m, a, r)
                tot_awq, tot_rtn = tot_awq + a, tot_rtn + r
    assert tot_awq < 0.97 * tot_rtn, (tot_awq, tot_rtn)


def test_awq_beats_rtn_where_activations_have_outlier_channels():
    torch.manual_seed(1)
    x = torch.randn(2048, 256) * torch.where(torch.rand(256) < 0.05, 20.0, 1.0)
    w = torch.randn(192, 256) * 0.02
    st = awq.MatrixStats(x.double().abs().mean(0).float(), awq._sample(x, 512), 2048)
    held = torch.randn(1024, 256) * (x.abs().mean(0) / torch.randn(10000).abs().mean())
    for name in INT4:
        fmt = FORMATS[name]
        a = awq.output_error(fmt, awq.quantize(fmt, w, dtype=torch.float16, stats=st), w, held, torch.float16)
        r = awq.output_error(fmt, fmt.quantize(w, dtype=torch.float16), w, held, torch.float16)
        assert a < (0.9 if name != "int4" else 0.99) * r, (name, a, r)


def test_rtn_rounding_is_exactly_the_format():
    w = torch.randn(64, 128)
    x = torch.randn(100, 128)
    st = awq.MatrixStats(x.double().abs().mean(0).float(), awq._sample(x, 64), 100)
    for name in INT4:
        fmt = FORMATS[name]
        got, want = awq.quantize(fmt, w, dtype=torch.float16, stats=st, rounding="rtn"), fmt.quantize(
            w, dtype=torch.float16)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        got = awq.quantize(fmt, w, dtype=torch.float16, stats=None)
        assert all(torch.equal(got[k], want[k]) for k in want)


def _dequant_reference(name: str, packed: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(effective weight [out, in] float64 from the stored codes and scales, pre-quant scale [in])."""
    if name == "int4":
        q = unpack_int4(packed["weight"], dim=-1).double()  # [in, out]
        return (q * packed["per_channel_scale"].double()).t(), torch.ones(q.shape[0], dtype=torch.float64)
    g = FORMATS[name].group_size
    q = unpack_int4(packed["weight"], dim=-2).double()
    s = packed["weights_scaling_factor"].double().repeat_interleave(g, dim=-1)
    return q * s, packed["prequant_scaling_factor"].double().reshape(-1)


@pytest.mark.parametrize("gran", ["matrix", "layer"])
def test_engine_applies_the_prequant_scale(model, calib, tmp_path, gran):
    """Each expert the engine runs from the awq checkpoint's bytes equals the float64 reference built from
    the dequantized transformed weights with the stored pre-quant scale; dropping the scale changes it."""
    names = ["int4_g128", "int4_g64", "int4", "int4_g128"]
    if gran == "matrix":
        plan = QuantPlan({l: [names[(e + l) % 4] for e in range(E)] for l in range(L)}, granularity="matrix",
                         proj_formats={l: [names[(e + l + 1) % 4] for e in range(E)] for l in range(L)},
                         dtype=torch.bfloat16)
    else:
        plan = QuantPlan({0: ["int4_g128"] * E, 1: ["int4_g64"] * E}, granularity="layer", dtype=torch.bfloat16)
    ck = convert(model, tmp_path / "ck", quant=_awq_plan(plan, calib["dir"])).out_dir
    # The checkpoint's bytes, run by the formats' reference path; a serving engine runs the same
    # experts in the CPU kernels (trtmoe.runtime.qkernels), within the same tolerance.
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu", pack_experts=False)
    served = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    x = calib["acts"].get(0, 0, "fc").rows[:16]
    nontrivial = 0
    for l in range(L):
        bank = eng.layers[l].experts
        assert isinstance(bank, PackedExperts) and not bank.kernels
        assert served.layers[l].experts.kernels
        for e in range(E):
            sh = bank.shards[e][0]
            wf, pf = _dequant_reference(sh.fc_fmt.name, sh.fc)
            wp, pp = _dequant_reference(sh.proj_fmt.name, sh.proj)
            nontrivial += int(not torch.equal(pf, torch.ones_like(pf))) + int(not torch.equal(pp, torch.ones_like(pp)))
            # The kernel multiplies the activations by the scale in their own dtype.
            h = (x * pf.to(x.dtype)).double() @ wf.t()
            up, gate = h.to(x.dtype).chunk(2, dim=-1)
            a = F.silu(gate) * up
            want = (a * pp.to(a.dtype)).double() @ wp.t()
            for b in (bank, served.layers[l].experts):
                got = b.forward(e, x).double()
                assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())), (l, e, b.kernels)
            if not torch.equal(pf, torch.ones_like(pf)):
                no_scale = dict(sh.fc, prequant_scaling_factor=torch.ones_like(sh.fc["prequant_scaling_factor"]))
                assert not torch.allclose(sh.fc_fmt.linear(x, no_scale), sh.fc_fmt.linear(x, sh.fc))
    assert nontrivial > 0


def test_embedded_checkpoint_holds_the_weights_calibration_measured(model, calib, tmp_path):
    """Per expert matrix, the checkpoint's tensors are what calibration's ΔKL quantized (same rounding,
    same statistics) — so the sensitivity is measured on the weights actually written."""
    plan = QuantPlan({l: [INT4[(e + l) % 3] for e in range(E)] for l in range(L)}, granularity="matrix",
                     proj_formats={l: [INT4[(e + l + 1) % 3] for e in range(E)] for l in range(L)},
                     dtype=torch.bfloat16)
    plan = _awq_plan(plan, calib["dir"])
    ck = convert(model, tmp_path / "ck", quant=plan).out_dir
    acts = calib["acts"]
    for l in range(L):
        for e in range(E):
            w = _hf_expert(model, l, e)
            for m in ("fc", "proj"):
                fmt = FORMATS[plan.matrix_format(l, e, m)]
                want = awq.quantize(fmt, w[m], dtype=torch.bfloat16, stats=acts.get(l, e, m))
                got = _read(ck, f"transformer.layers.{l}.mlp.experts.{e}.{m}.")
                assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (l, e, m)
    assert plan.meta["activations"]["path"] == str((calib["dir"] / awq.ACT_FILE).resolve())


def test_calibration_delta_kl_uses_the_rounding(calib):
    eng = EmbeddedEngine.from_checkpoint(calib["float_ck"], device="cpu")
    rtn = measure(eng, calib["ids"], formats=("int8", "int4_g128"), rounding="rtn")
    got = calib["res"]["sensitivity"]["matrices"]
    want = rtn["sensitivity"]["matrices"]
    for m in ("fc", "proj"):
        assert got[m]["measured"]["int8"] == want[m]["measured"]["int8"]
        assert got[m]["measured"]["int4_g128"] != want[m]["measured"]["int4_g128"]
    assert rtn["rounding"] == "rtn"


def test_rtn_is_byte_identical_to_before(model, calib, tmp_path):
    """--rounding rtn writes exactly what a plan without any rounding wrote (the former path), even
    with a calibration that carries activation statistics; awq changes the int4 bytes."""
    from trtmoe.hf.reader import HFCheckpoint

    with HFCheckpoint(model) as src:
        m = src.model
    plans = {"uniform int4_g128": lambda: uniform_plan(m, "int4_g128"), "uniform int4": lambda: uniform_plan(m, "int4"),
             "per matrix": lambda: QuantPlan({l: [INT4[(e + l) % 3] for e in range(E)] for l in range(L)},
                                             granularity="matrix",
                                             proj_formats={l: [INT4[(e + 2 * l + 1) % 3] for e in range(E)]
                                                           for l in range(L)})}
    for label, make in plans.items():
        before, rtn, aw = make(), make(), make()
        rtn = awq.attach(rtn, "rtn", calib["dir"])
        aw = _awq_plan(aw, calib["dir"])
        outs = [convert(model, tmp_path / f"{label}-{i}", quant=p).out_dir for i, p in enumerate((before, rtn, aw))]
        for f in ("rank0.safetensors", "config.json"):
            assert (outs[0] / f).read_bytes() == (outs[1] / f).read_bytes(), (label, f)
        assert (outs[0] / "rank0.safetensors").read_bytes() != (outs[2] / "rank0.safetensors").read_bytes(), label
        assert (outs[0] / "config.json").read_bytes() == (outs[2] / "config.json").read_bytes(), label
    c = tmp_path / "cli"
    cli("convert", model, "-o", c, "--calib", calib["dir"], "--policy", "uniform", "--format", "int4_g128",
        "--target", "tensorrt-llm", "--rounding", "rtn")
    assert json.loads((c / "manifest.json").read_text())["quantization"]["rounding"] == "rtn"
    d = tmp_path / "cli-default"
    cli("convert", model, "-o", d, "--calib", calib["dir"], "--policy", "uniform", "--format", "int4_g128",
        "--target", "tensorrt-llm")
    assert json.loads((d / "manifest.json").read_text())["quantization"]["rounding"] == "awq"
    assert (c / "rank0.safetensors").read_bytes() != (d / "rank0.safetensors").read_bytes()


def test_awq_without_calibration_rounds_to_nearest_and_says_so(model, tmp_path):
    out = tmp_path / "u"
    cli("convert", model, "-o", out, "--policy", "uniform", "--format", "int4_g128")
    q = json.loads((out / "manifest.json").read_text())["quantization"]
    assert q["rounding"] == "rtn" and "awq needs" in q["rounding_note"]


def test_tensorrt_llm_layout_has_prequant_scale_only_where_declared(model, calib, tmp_path):
    """TensorRT-LLM's fused MoE declares one prequant_scaling_factor [1, in] per stacked fc and proj for
    W4A16_AWQ (group-wise) and none for W4A16 (per-channel, which trtllm-build quantizes from float)."""
    ck = tmp_path / "g"
    cli("convert", model, "-o", ck, "--calib", calib["dir"], "--policy", "uniform", "--format", "int4_g128",
        "--target", "tensorrt-llm")
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "W4A16_AWQ" and cfg["quantization"]["pre_quant_scale"] is True
    f = SafetensorsFile(ck / "rank0.safetensors")
    try:
        pq = {n: f.read(n) for n in f.tensors if n.endswith("prequant_scaling_factor")}
        shapes = {n: tuple(f.tensors[n].shape) for n in f.tensors}
    finally:
        f.close()
    ins = {"fc": 128, "proj": 128}
    assert moe_prequant_problems(shapes, {l: "W4A16_AWQ" for l in range(L)}, ins) == []
    assert moe_prequant_problems(shapes, {l: "W4A16" for l in range(L)}, ins)  # it can fail
    assert set(pq) == {f"transformer.layers.{l}.mlp.{m}.prequant_scaling_factor" for l in range(L)
                       for m in ("fc", "proj")}
    for n, t in pq.items():
        assert t.shape == (1, 128) and t.dtype == torch.bfloat16, n
    assert any(not torch.equal(t, torch.ones_like(t)) for t in pq.values())
    # Every expert of the layer was quantized against that one shared scale.
    for l in range(L):
        stack = _read(ck, f"transformer.layers.{l}.mlp.fc.")
        rnd = awq.CheckpointRounding(calib["acts"], torch.bfloat16)
        full = lambda x, l=l: _hf_expert(model, l, x)["fc"]  # noqa: E731
        fmt = FORMATS["int4_g128"]
        assert torch.equal(stack["prequant_scaling_factor"],
                           rnd.shared_prequant(fmt, l, "fc", (0, 128), full, list(range(E))))
        for e in range(E):
            w = full(e)
            want = awq.apply(fmt, w, torch.bfloat16, rnd.recipe(fmt, l, e, "fc", (0, 128), w, full, list(range(E))))
            assert torch.equal(stack["weight"][e], want["weight"])
            assert torch.equal(stack["weights_scaling_factor"][e], want["weights_scaling_factor"])
    # Per-channel int4: no pre-quant scale; float weights clamped to the searched clip, which
    # trtllm-build's amax / 8 quantization then lands on.
    pc = tmp_path / "pc"
    cli("convert", model, "-o", pc, "--calib", calib["dir"], "--policy", "uniform", "--format", "int4",
        "--target", "tensorrt-llm")
    f = SafetensorsFile(pc / "rank0.safetensors")
    try:
        assert not [n for n in f.tensors if "prequant" in n or "scaling_factor" in n or "per_channel" in n]
        assert moe_prequant_problems({n: tuple(f.tensors[n].shape) for n in f.tensors},
                                     {l: "W4A16" for l in range(L)}, ins) == []
        clipped = 0
        for l in range(L):
            fc = f.read(f"transformer.layers.{l}.mlp.fc.weight")
            for e in range(E):
                src = _hf_expert(model, l, e)["fc"]
                assert bool((fc[e].float().abs() <= src.float().abs()).all())
                clipped += int(not torch.equal(fc[e], src))
    finally:
        f.close()
    assert clipped > 0
    assert json.loads((pc / "config.json").read_text())["quantization"]["quant_algo"] == "W4A16"


def test_moe_tp2_shares_the_fc_scale_and_slices_proj(model, calib, tmp_path):
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    for out, tp in ((one, 1), (two, 2)):
        cli("convert", model, "-o", out, "--calib", calib["dir"], "--policy", "uniform", "--format", "int4_g64",
            "--target", "tensorrt-llm", "--tp", tp, "--moe-tp", tp)
    read = lambda d, r, n: SafetensorsFile(d / f"rank{r}.safetensors").read(n)  # noqa: E731
    for l in range(L):
        p = f"transformer.layers.{l}.mlp."
        full_fc, full_proj = read(one, 0, p + "fc.prequant_scaling_factor"), read(one, 0, p + "proj.prequant_scaling_factor")
        assert torch.equal(read(two, 0, p + "fc.prequant_scaling_factor"), full_fc)
        assert torch.equal(read(two, 1, p + "fc.prequant_scaling_factor"), full_fc)
        assert torch.equal(torch.cat([read(two, r, p + "proj.prequant_scaling_factor") for r in (0, 1)], -1), full_proj)
    e1, e2 = EmbeddedEngine.from_checkpoint(one, device="cpu"), EmbeddedEngine.from_checkpoint(two, device="cpu")
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(3))
    l1, l2 = e1.logits(ids).float(), e2.logits(ids).float()
    ref = EmbeddedEngine.from_checkpoint(calib["float_ck"], device="cpu").logits(ids).float()
    # Different shards clip differently, so the two are not equal, but both stay close to the reference.
    for lg in (l1, l2):
        assert float((lg - ref).abs().max()) < 0.5 * float(ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["int4_g128", "int4_g64", "int4"])
def test_search_numerics_are_the_formats_own(name, dtype):
    """The scale/clip search scores candidates with a fast restatement of the int4 formats; it must
    give exactly what the format stores and dequantizes (in the model dtype), clipped or not."""
    from trtmoe.quant.awq import _fake_channel, _fake_group
    from trtmoe.quant.formats import FORMATS

    torch.manual_seed(3)
    f = FORMATS[name]
    w = (torch.randn(32, 256) * 0.05).to(dtype)
    g = getattr(f, "group_size", 256)
    amax = w.float().reshape(32, -1, g).abs().amax(-1)
    for clip in (None, (amax * 0.7).to(dtype).float()):  # the search keeps clip values model-dtype exact
        wc = w.float().reshape(32, -1, g)
        if clip is not None:
            wc = torch.maximum(torch.minimum(wc, clip.unsqueeze(-1)), -clip.unsqueeze(-1))
        stored = f.dequantize(f.quantize(wc.reshape(32, 256).to(dtype), dtype=dtype), dtype=dtype).float()
        fake = (_fake_group(w.float(), g, dtype, clip) if name != "int4"
                else _fake_channel(w.float(), dtype, None if clip is None else clip.reshape(32)))
        assert torch.equal(stored, fake), (name, dtype, clip is None, (stored - fake).abs().max())


def test_tensorrt_llm_target_plans_on_the_weights_its_stacked_layout_writes(tiny_model, tmp_path):
    """Under awq, Fisher calibration scores each group-int4 expert matrix twice: with its own pre-quant
    scale (the embedded engine's layout) and with the layer-shared one TensorRT-LLM's stacked layout
    writes (``sensitivity.stacked``). The weights the second scored are the ones ``convert --target
    tensorrt-llm`` writes, byte for byte, and that target's plan predicts its ΔKL from them."""
    from trtmoe.quant.calib_schema import stacked_view
    from trtmoe.quant.calibrate import _AwqRounding, calibrate
    from trtmoe.quant.policies import predicted_delta_kl

    model, text = _tokenized_model(tiny_model, tmp_path, seed=3)
    plain = calibrate(model, text, tmp_path / "plain", samples=4, seq_len=32, formats=("int8", "int4", "int4_g128"),
                      rounding="awq")
    assert "stacked" not in plain["sensitivity"]  # the embedded target's calibration (the default)
    cal = calibrate(model, text, tmp_path / "cal", samples=4, seq_len=32, formats=("int8", "int4", "int4_g128"),
                    target="tensorrt-llm", rounding="awq")
    sens = cal["sensitivity"]
    assert sens["matrices"] == plain["sensitivity"]["matrices"]  # the per-matrix scores are unchanged
    assert sens["cost_forward_passes"] > plain["sensitivity"]["cost_forward_passes"]
    assert sens["stacked"]["formats"] == ["int4_g128"]  # int8 and per-channel int4 have no pre-quant scale
    assert sens["stacked"]["delta_kl"]["int4_g128"] != sens["delta_kl"]["int4_g128"]

    ck = tmp_path / "trt"
    cli("convert", model, "-o", ck, "--calib", tmp_path / "cal", "--policy", "uniform", "--format", "int4_g128",
        "--target", "tensorrt-llm")
    got = load_file(str(ck / "rank0.safetensors"))
    eng = EmbeddedEngine.from_checkpoint(convert(model, tmp_path / "float").out_dir, device="cpu")
    rounding = _AwqRounding(awq.ActivationStats.load(tmp_path / "cal" / awq.ACT_FILE), "awq")
    fmt = FORMATS["int4_g128"]
    for l in range(L):
        for m in ("fc", "proj"):
            for e in range(4):
                want = rounding.quantize_stacked(fmt, eng.layers[l].experts, l, e, m, eng.dtype)
                for k, v in want.items():
                    t = got[f"transformer.layers.{l}.mlp.{m}.{k}"]
                    assert torch.equal(t if k == "prequant_scaling_factor" else t[e], v), (l, m, e, k)

    res = cli("convert", model, "-o", tmp_path / "graded", "--calib", tmp_path / "cal", "--budget", "4.3",
              "--target", "tensorrt-llm", "--json")
    q = json.loads(res.output)["quantization"]
    assert "int4_g128" in q["formats_used"]
    assert not any("own pre-quant scale" in n for n in q["notes"])
    per_matrix = cli("convert", model, "-o", tmp_path / "graded-pm", "--calib", tmp_path / "plain", "--budget", "4.3",
                     "--target", "tensorrt-llm", "--json")
    assert any("own pre-quant scale" in n for n in json.loads(per_matrix.output)["quantization"]["notes"])
    written = json.loads((tmp_path / "graded" / "config.json").read_text())["trtmoe"]["quantization"]
    plan = QuantPlan({int(l): fs for l, fs in written["expert_formats"].items()}, granularity="layer")
    assert q["predicted_delta_kl"] == pytest.approx(predicted_delta_kl(plan, stacked_view(cal)), rel=1e-12)
    assert q["predicted_delta_kl"] != pytest.approx(predicted_delta_kl(plan, cal), rel=1e-3)


@pytest.fixture(scope="module")
def searched(tiny_model, tmp_path_factory):
    """A Fisher calibration (awq_gptq, the default rounding, scored for both targets) of a small bf16
    Mixtral with a tokenizer; its artifact keeps the recipes its searches chose."""
    from trtmoe.quant.calibrate import calibrate

    tmp = tmp_path_factory.mktemp("recipes")
    model, text = _tokenized_model(tiny_model, tmp, seed=5)
    calibrate(model, text, tmp / "cal", samples=4, seq_len=32, formats=("int8",) + INT4, target="tensorrt-llm")
    return model, tmp / "cal"


def _no_search(monkeypatch):
    """Every activation-aware search, and every error evaluation of error feedback's candidates, fails
    the test if it runs."""
    def refuse(*a, **k):
        raise AssertionError("searched although calibration stored the recipe and its choice")
    for name in ("search_prequant", "_clip_group", "_clip_channel", "_err", "_gram_err", "_rows_err"):
        monkeypatch.setattr(awq, name, refuse)


@pytest.mark.parametrize("args", [
    ("--policy", "uniform", "--format", "int4_g128", "--target", "tensorrt-llm"),  # layer-shared pre-quant scale
    ("--budget", "4.4", "--granularity", "matrix"),  # every int4 kind, a scale per expert matrix
], ids=["tensorrt-llm-shared-scale", "embedded-per-matrix"])
def test_convert_takes_calibrations_recipes_instead_of_searching_and_writes_the_same_bytes(
        searched, tmp_path, monkeypatch, args):
    """Calibration keeps the pre-quant scales and clips it searched and which error-feedback candidate
    won (``recipes/``, named with their sha256 in the activation statistics, keyed by the weight's
    fingerprint); convert at moe_tp=1 then runs none of the searches and computes only the winner's
    codes, and its checkpoint is byte-identical to one that searched again."""
    model, cal = searched
    meta = json.loads(SafetensorsFile(cal / awq.ACT_FILE).metadata["recipes"])
    assert sorted(meta["layers"]) == [str(l) for l in range(L)] and meta["search"] == awq.RECIPE_SEARCH
    assert sorted(p.name for p in (cal / awq.RECIPES_DIR).iterdir()) == [f"{l}.safetensors" for l in range(L)]
    awq._RECIPES.clear()  # no transforms this process remembers from earlier tests
    with monkeypatch.context() as m:
        m.setattr(awq.RecipeStore, "get", lambda *a, **k: None)  # as if calibration had stored none
        again = json.loads(cli("convert", model, "-o", tmp_path / "searched", "--calib", cal, *args,
                               "--json").output)["recipes"]
    awq._RECIPES.clear()  # nor the ones the first convert found
    with monkeypatch.context() as m:
        _no_search(m)
        stored = json.loads(cli("convert", model, "-o", tmp_path / "stored", "--calib", cal, *args,
                                "--json").output)["recipes"]
    a, b = (tmp_path / d / "rank0.safetensors" for d in ("searched", "stored"))
    assert a.read_bytes() == b.read_bytes()
    used = json.loads((tmp_path / "stored" / "manifest.json").read_text())["quantization"]["formats_used"]
    assert set(used) & set(INT4), used
    # The summary counts the int4 expert matrices each way: all searched, then all from calibration.
    n = again["searched"]
    assert n > 0 and again == {"stored": 0, "searched": n, "reused": 0}
    assert stored == {"stored": n, "searched": 0, "reused": 0}
    if "--policy" in args:  # uniform int4: every expert matrix of every layer
        assert n == L * 4 * 2  # the 4-expert model
    human = cli("convert", model, "-o", tmp_path / "stored", "--calib", cal, *args, "--force").output
    assert f"int4 transforms: 0 from the calibration, 0 searched now, {n} reused" in human


@pytest.fixture(scope="module")
def searched_fp32(tiny_model, tmp_path_factory):
    """``searched`` for a float32 model: its recipes are searched (and keyed) in float32."""
    from trtmoe.quant.calibrate import calibrate

    tmp = tmp_path_factory.mktemp("recipes32")
    model, text = _tokenized_model(tiny_model, tmp, seed=6, dtype="float32")
    calibrate(model, text, tmp / "cal", samples=4, seq_len=32, formats=("int8",) + INT4, target="tensorrt-llm")
    return model, tmp / "cal"


@pytest.mark.parametrize("args", [
    ("--policy", "uniform", "--format", "int4_g128", "--target", "tensorrt-llm"),
    ("--budget", "4.4", "--granularity", "matrix"),
], ids=["tensorrt-llm-shared-scale", "embedded-per-matrix"])
def test_a_bf16_convert_of_an_fp32_calibration_takes_its_recipes(searched_fp32, tmp_path, monkeypatch, args):
    """A float32 calibration's recipes carry over to a bfloat16 checkpoint of the same weights: no
    search and no candidate evaluation runs (without them every int4 matrix is searched again), and
    every pre-quant scale written is a float32 one the calibration chose, rounded to bfloat16."""
    model, cal = searched_fp32
    meta = json.loads(SafetensorsFile(cal / awq.ACT_FILE).metadata["recipes"])
    assert meta["layers"]
    awq._RECIPES.clear()
    with monkeypatch.context() as m:
        m.setattr(awq.RecipeStore, "get", lambda *a, **k: None)
        before = json.loads(cli("convert", model, "-o", tmp_path / "searched", "--calib", cal, *args,
                                "--dtype", "bfloat16", "--json").stdout)["recipes"]
    awq._RECIPES.clear()
    with monkeypatch.context() as m:
        _no_search(m)
        after = json.loads(cli("convert", model, "-o", tmp_path / "carried", "--calib", cal, *args,
                               "--dtype", "bfloat16", "--json").stdout)["recipes"]
    n = before["searched"]
    assert n > 0 and after == {"stored": n, "searched": 0, "reused": 0}
    chosen = []
    for l in range(L):
        f = SafetensorsFile(cal / awq.RECIPES_DIR / f"{l}.safetensors")
        try:
            index = json.loads(f.metadata["entries"])
            chosen += [f.read(f"{i}.pq") for i, (rid, _, has_pq, _, _) in enumerate(index)
                       if has_pq and rid.endswith("|torch.float32")]
        finally:
            f.close()
    assert chosen and all(t.dtype == torch.float32 for t in chosen)
    written = [t for name, t in _read(tmp_path / "carried", "").items() if name.endswith("prequant_scaling_factor")]
    assert written and all(t.dtype == torch.bfloat16 for t in written)
    for t in written:
        if not bool((t == 1).all()):  # ones: no scale searched for that matrix
            assert any(torch.equal(t.reshape(-1), pq.to(torch.bfloat16)) for pq in chosen)


def test_stale_or_damaged_recipes_are_searched_again(searched, tmp_path, monkeypatch):
    """A recipe kept for other weights (another model in the same directory layout), or a damaged
    recipes file, is never applied: convert searches, and a search-only tree writes the same bytes."""
    import shutil

    model, cal = searched
    args = ("--policy", "uniform", "--format", "int4_g64")
    cli("convert", model, "-o", tmp_path / "ref", "--calib", cal, *args)
    ref = (tmp_path / "ref" / "rank0.safetensors").read_bytes()
    # The same calibration with one recipes file damaged (its recorded sha256 no longer matches).
    bad = tmp_path / "bad-cal"
    shutil.copytree(cal, bad)
    f = bad / awq.RECIPES_DIR / "1.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    awq._RECIPES.clear()
    calls = []
    real = awq.search_prequant
    monkeypatch.setattr(awq, "search_prequant", lambda *a, **k: calls.append(1) or real(*a, **k))
    counts = json.loads(cli("convert", model, "-o", tmp_path / "bad", "--calib", bad, *args, "--json").output)
    assert calls  # layer 1 searched again, layer 0 taken from its intact file
    assert counts["recipes"] == {"stored": 4 * 2, "searched": 4 * 2, "reused": 0}
    assert (tmp_path / "bad" / "rank0.safetensors").read_bytes() == ref
    # Weights that differ from the calibrated ones: the fingerprints do not match, nothing is reused.
    store = awq.ActivationStats.load(cal / awq.ACT_FILE).recipes
    rid = awq.recipe_id("int4_g64", 0, "fc", (0, 128), False, torch.bfloat16)
    w = _hf_expert(model, 0, 0)["fc"]
    assert store.get(0, rid, awq.weight_fingerprint(w, torch.bfloat16)) is not None
    assert store.get(0, rid, awq.weight_fingerprint(w + 1, torch.bfloat16)) is None


def test_a_recipe_written_after_its_layer_was_looked_up_is_found(tmp_path):
    """A lookup that missed before the layer's file existed is not remembered as the file's content."""
    store = awq.RecipeStore(tmp_path / awq.RECIPES_DIR)
    rid = awq.recipe_id("int4_g128", 0, "fc", (0, 8), False, torch.bfloat16)
    assert store.get(3, rid, "fp") is None
    store.keep(3, rid, "fp", torch.ones(16, dtype=torch.bfloat16), None)
    store.keep_choice(3, rid, 1)
    store.flush(3)
    pq, clip, choice = store.get(3, rid, "fp")
    assert torch.equal(pq, torch.ones(16, dtype=torch.bfloat16)) and clip is None and choice == 1


@pytest.mark.parametrize("pq, clip, fits", [
    (torch.full((16,), 0.5), torch.ones(8, 2), True),
    (None, torch.ones(8), True),
    (torch.full((12,), 0.5), None, False),  # another input width
    (torch.zeros(16), None, False),  # a scale the weight would be divided by
    (None, torch.ones(4, 2), False),  # another number of rows
    (None, torch.full((8, 2), float("nan")), False),
], ids=["group", "per-channel", "width", "zero-scale", "rows", "nan-clip"])
def test_a_stored_recipe_that_does_not_fit_its_matrix_is_searched_again(tmp_path, pq, clip, fits):
    """Entries whose file passed its sha256 check but whose values cannot apply to the matrix (a
    store written by hand or by a broken tool) are never applied: convert searches instead."""
    store = awq.RecipeStore(tmp_path)
    rid = awq.recipe_id("int4_g128", 0, "fc", (0, 4), False, torch.float32)
    store.keep(0, rid, "fp", pq, clip)
    searched = []
    fresh = awq.Recipe(torch.ones(16), None)
    rec, _ = awq._stored_or_searched(store, 0, rid, "fp", lambda: searched.append(1) or fresh, (8, 16))
    assert (rec is not fresh and not searched) if fits else (rec is fresh and searched)


def test_clip_search_from_few_rows_is_the_gram_search():
    """With fewer sampled rows than a group has inputs the clip search measures each group's error
    through the rows instead of the group's Gram matrix: the same clips as the Gram matrix gives (the
    same rows four times over, which takes the Gram path, scales every error by four)."""
    g = torch.Generator().manual_seed(3)
    wd = awq._in_dtype(torch.randn(64, 256, generator=g) * 0.05, torch.bfloat16)
    x = (torch.randn(40, 256, generator=g) * torch.linspace(0.1, 3.0, 256)).to(torch.bfloat16)
    pq = (torch.rand(256, generator=g) + 0.5).to(torch.bfloat16)
    wt = awq._in_dtype(wd / pq.float(), torch.bfloat16)
    few = awq._clip_group(wt, wd, x, pq, 128, torch.bfloat16)
    many = awq._clip_group(wt, wd, x.repeat(4, 1), pq, 128, torch.bfloat16)
    assert few is not None and torch.equal(few, many)
    assert bool((few < wt.reshape(64, 2, 128).abs().amax(-1)).any())  # something was clipped


def test_clip_grid_is_searched_coarse_to_fine_per_group():
    """The clip grid is searched at every ``GRID_STEP``-th point and its last, then at each element's
    two neighbours of its best: with an error that has one minimum per element at any grid point, each
    element gets its own minimum, in that many evaluations (10 of 21)."""
    grid = awq.CLIP_GRID
    target = torch.arange(len(grid)).reshape(3, 7)  # each element's best grid index: every one once
    want = torch.tensor(grid)[target]
    calls = []

    def evaluate(r):
        calls.append(r)
        r = torch.as_tensor(r, dtype=torch.float32).expand(target.shape)
        idx = torch.round((1.0 - r) * 40)  # the grid index of r (CLIP_GRID: 1 - i / 40)
        return (idx - target).abs() ** 1.5, r.clone()

    got = awq._refined(grid, evaluate)
    assert torch.equal(got, want)
    assert len(calls) == len(awq._coarse(len(grid))) + 2 == 10


def test_coarse_clip_search_is_never_worse_than_its_coarse_points():
    """On a real matrix, each (row, group)'s searched clip has an error no larger than that of every
    coarse grid point (the refinement only replaces a point by a better neighbour)."""
    g = torch.Generator().manual_seed(4)
    wd = awq._in_dtype(torch.randn(32, 256, generator=g) * 0.05, torch.bfloat16)
    x = (torch.randn(300, 256, generator=g) * torch.linspace(0.1, 3.0, 256)).to(torch.bfloat16)
    clip = awq._clip_group(wd, wd, x, None, 128, torch.bfloat16)
    assert clip is not None
    xs = x.float().reshape(-1, 2, 128)
    gram = torch.einsum("ngk,ngl->gkl", xs, xs)
    amax = wd.reshape(32, 2, 128).abs().amax(-1)

    def err(c):
        d = (wd - awq._fake_group(wd, 128, torch.bfloat16, c, amax)).reshape(32, 2, 128)
        return torch.einsum("ogk,gkl,ogl->og", d, gram, d)

    e = err(clip)
    for i in awq._coarse(len(awq.CLIP_GRID)):
        assert bool((e <= err(awq._in_dtype(amax * awq.CLIP_GRID[i], torch.bfloat16)) * (1 + 1e-6)).all())
