"""Evaluation statistics (trtmoe.report.quality) and the `trtmoe report` page."""

from __future__ import annotations

import base64
import json
import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from trtmoe.checkpoint.writer import convert
from trtmoe.cli import main
from trtmoe.data import write_split_text
from trtmoe.quant.calibrate import measure
from trtmoe.quant.plan import QuantPlan
from trtmoe.quant.policies import make_plan
from trtmoe.report.quality import Reference, checkpoint_footprint, evaluate, kl_summary
from trtmoe.runtime.engine import EmbeddedEngine

from tests.test_quant_pipeline import make_tokenizer

E = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_stored_format_has_a_heatmap_style():
    from trtmoe.quant.formats import FORMATS
    from trtmoe.report.html import FORMAT_COLORS, FORMAT_LABELS, FORMAT_ORDER, FORMAT_SHORT, SERIES_STYLE

    names = ["float"] + [n for n, f in FORMATS.items() if f.trtllm_quant_algo]
    assert sorted(FORMAT_ORDER) == sorted(names)
    for d in (FORMAT_COLORS, FORMAT_LABELS, FORMAT_SHORT):
        assert set(d) == set(names)
        assert len(set(d.values())) == len(d)  # distinguishable in the heatmap and its legend
    assert FORMAT_ORDER.index("int4_g64") < FORMAT_ORDER.index("int4_g128")  # most to fewest bits
    assert "uniform int4_g64" in SERIES_STYLE


def _ids(n, t, seed=0):
    return torch.randint(0, 250, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    """A float32 tiny Mixtral with a tokenizer, its float checkpoint, calibration and four quantized
    checkpoints (graded per expert, graded per expert matrix, uniform int8 in layer form, uniform int4
    per expert)."""
    root = tmp_path_factory.mktemp("report")
    hf = root / "hf"
    shutil.copytree(tiny_model("mixtral", num_local_experts=E, num_hidden_layers=3, seed=11), hf)
    make_tokenizer(root / "tok")
    for f in (root / "tok").iterdir():
        shutil.copy(f, hf / f.name)  # convert copies it next to the checkpoint
    fp = convert(hf, root / "fp").out_dir
    cal = measure(EmbeddedEngine.from_checkpoint(fp, device="cpu"), _ids(8, 32), formats=("int8", "int4"))
    cal["data"] = {"path": "random ids", "samples": 8, "seq_len": 32, "tokens": 256}
    (root / "calib").mkdir()
    (root / "calib" / "calib.json").write_text(json.dumps(cal))
    L = range(3)
    plans = {
        "graded": make_plan(cal, "graded", budget_bpw=10.0, formats=["float", "int8", "int4"], dtype=torch.float32),
        "graded_matrix": make_plan(cal, "graded", budget_bpw=6.0, granularity="matrix",
                                   formats=["float", "int8", "int4"], dtype=torch.float32),
        "int8_layer": QuantPlan({l: ["int8"] * E for l in L}, granularity="layer", meta={"policy": "uniform-int8"}),
        "int4_expert": QuantPlan({l: ["int4"] * E for l in L}, granularity="expert", meta={"policy": "uniform-int4"}),
    }
    cks = {n: convert(hf, root / n, quant=p).out_dir for n, p in plans.items()}
    write_split_text("heldout", root / "heldout.txt", max_bytes=30_000)
    return {"root": root, "hf": hf, "fp": fp, "calib": cal, "cks": cks, "plans": plans}


# ---- statistics --------------------------------------------------------------------------------------------
def test_kl_summary_matches_numpy():
    x = torch.from_numpy(np.random.default_rng(0).gamma(0.5, 0.02, size=5001))
    s = kl_summary(x)
    v = x.numpy()
    assert s["mean"] == pytest.approx(v.mean())
    assert s["stderr"] == pytest.approx(v.std(ddof=1) / np.sqrt(v.size))
    for key, q in (("median", 50), ("p99", 99), ("p999", 99.9)):
        assert s[key] == pytest.approx(np.percentile(v, q))
    assert s["max"] == pytest.approx(v.max())


def test_reference_against_itself_is_exact(setup):
    ev = evaluate(setup["fp"], setup["fp"], _ids(4, 16), batch_size=3)
    assert ev["kl"]["max"] == 0 and ev["same_top1"] == 1 and ev["ppl_ratio"] == 1 and ev["rms_dp_top1"] == 0
    assert all(v["topk_set_agreement"] == 1 for v in ev["router"]["layers"].values())


def test_statistics_equal_an_independent_computation(setup):
    ids = _ids(5, 24, seed=3)
    ev = evaluate(setup["fp"], setup["cks"]["graded"], ids, batch_size=2)
    ref = EmbeddedEngine.from_checkpoint(setup["fp"], device="cpu")
    q = EmbeddedEngine.from_checkpoint(setup["cks"]["graded"], device="cpu")
    routes = {"r": {}, "q": {}}
    ref.route_hook = lambda l, i: routes["r"].setdefault(l, i.sort(-1).values)
    q.route_hook = lambda l, i: routes["q"].setdefault(l, i.sort(-1).values)
    lr = ref.logits(ids)[:, :-1].double().log_softmax(-1)
    lq = q.logits(ids)[:, :-1].double().log_softmax(-1)
    kl = F.kl_div(lq, lr, log_target=True, reduction="none").sum(-1).flatten()
    assert ev["tokens_scored"] == kl.numel() == 5 * 23
    assert ev["kl"]["mean"] == pytest.approx(float(kl.mean()), rel=1e-4)
    assert ev["kl"]["max"] == pytest.approx(float(kl.max()), rel=1e-4)
    assert ev["same_top1"] == pytest.approx(float((lr.argmax(-1) == lq.argmax(-1)).double().mean()))
    top = lr.argmax(-1, keepdim=True)
    dp = lq.gather(-1, top).exp() - lr.gather(-1, top).exp()
    assert ev["rms_dp_top1"] == pytest.approx(float(dp.pow(2).mean().sqrt()), rel=1e-4)
    tgt = ids[:, 1:, None]
    ppl_r, ppl_q = (float((-x.gather(-1, tgt)).mean().exp()) for x in (lr, lq))
    assert ev["ppl_ratio"] == pytest.approx(ppl_q / ppl_r, rel=1e-5)
    assert 0 < ev["kl"]["mean"] and ev["same_top1"] < 1  # the quantization is visible
    for l in range(3):
        same = float((routes["r"][l] == routes["q"][l]).all(-1).double().mean())
        assert ev["router"]["layers"][str(l)]["topk_set_agreement"] == pytest.approx(same)
    # Layer 0's router sees the (unquantized) attention output only: its choices cannot change.
    assert ev["router"]["layers"]["0"]["topk_set_agreement"] == 1.0


def test_footprint_counts_true_bytes(setup):
    cal = setup["calib"]
    for name, fmt in (("int8_layer", "int8"), ("int4_expert", "int4")):
        fp = checkpoint_footprint(setup["cks"][name])
        assert fp["expert_bpw"] == pytest.approx(cal["bits_per_weight"][fmt])
        r = fp["ranks"][0]
        assert r["stored_bytes"] == (setup["cks"][name] / "rank0.safetensors").stat().st_size
    # Layer-form int8 stores float weights (trtllm-build quantizes them); per-expert int4 is pre-packed.
    lay = checkpoint_footprint(setup["cks"]["int8_layer"])
    assert lay["ranks"][0]["routed_expert_bytes_stored"] == 4 * lay["routed_expert_weights"]  # float32
    assert lay["ranks"][0]["deployed_bytes"] < lay["ranks"][0]["stored_bytes"]
    pk = checkpoint_footprint(setup["cks"]["int4_expert"])["ranks"][0]
    assert pk["routed_expert_bytes_stored"] == pk["routed_expert_bytes"]
    assert checkpoint_footprint(setup["fp"])["expert_bpw"] == 32.0


# ---- the page --------------------------------------------------------------------------------------------------
def test_report_renders(setup, tmp_path):
    root, cks = setup["root"], setup["cks"]
    bench = {"rows": [], "targets": [{"name": "demo target", "value": 1.0, "threshold": "≤ 2", "ok": True}]}
    ref = Reference(setup["fp"], _ids(4, 16))
    for name, pol, budget in (("graded", "graded (expert)", 10.0), ("graded_matrix", "graded (matrix)", 6.0),
                              ("int8_layer", "uniform int8", None), ("int4_expert", "uniform int4", None)):
        ev = ref.compare(cks[name])
        bench["rows"].append({"policy": pol, "budget": budget, "bpw": ev["expert_bpw"],
                              "kl_mean": ev["kl"]["mean"], "kl_stderr": ev["kl"]["stderr"]})
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out = tmp_path / "rep"
    # One checkpoint per granularity: expert (graded), matrix (graded_matrix), layer (int8_layer).
    res = CliRunner().invoke(main, ["report", "--ref", str(setup["fp"]), "--quant", str(cks["graded"]),
                                    "--quant", str(cks["graded_matrix"]), "--quant", str(cks["int8_layer"]),
                                    "--quant", str(cks["int4_expert"]), "--calib", str(root / "calib"),
                                    "--data", str(root / "heldout.txt"), "--samples", "6", "--seq-len", "32",
                                    "--bench", str(tmp_path / "bench.json"), "-o", str(out)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    page = (out / "report.html").read_text()
    imgs = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    names = {a for a, _ in imgs}
    for want in ("KL versus bits", "router agreement per layer", "assigned format heatmaps",
                 "routed-token share heatmap", "sensitivity heatmap", "minimum routed tokens per expert",
                 "bytes per rank"):
        assert want in names
    for _, b64 in imgs:
        assert base64.b64decode(b64)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "src=\"http" not in page and "<script" not in page  # self-contained
    assert '<table class="stats">' in page and "graded" in page and "int4_expert" in page
    assert "demo target" in page
    rep = json.loads((out / "report.json").read_text())
    assert [e["name"] for e in rep["evaluations"]] == ["graded", "graded_matrix", "int8_layer", "int4_expert"]
    ev = rep["evaluations"][0]
    for k in ("kl", "same_top1", "rms_dp_top1", "ppl_ratio", "router", "footprint", "expert_bpw", "formats",
              "matrix_formats"):
        assert k in ev
    assert rep["heldout"]["samples"] == 6 and rep["heldout"]["seq_len"] == 32
    assert rep["curve"]["bench"]["uniform int8"][0]["bpw"] == pytest.approx(setup["calib"]["bits_per_weight"]["int8"])
    assert rep["curve"]["bench"]["graded (matrix)"][0]["budget"] == 6.0
    assert "Held-out statistics" in res.output
    # The matrix plan's formats come back per matrix (original expert ids) and draw as two panels.
    from trtmoe.report.html import _format_panels

    evs = {e["name"]: e for e in rep["evaluations"]}
    plan = setup["plans"]["graded_matrix"]
    mf = evs["graded_matrix"]["matrix_formats"]
    assert mf == {m: {str(l): fs for l, fs in plan.matrix_formats(m).items()} for m in ("fc", "proj")}
    assert evs["graded_matrix"]["plan"]["granularity"] == "matrix"
    assert [t for t, _ in _format_panels(evs["graded_matrix"])] == ["fc = [up; gate]", "proj = down"]
    for name in ("graded", "int8_layer", "int4_expert"):
        assert len(_format_panels(evs[name])) == 1
    assert {"graded (matrix)", "graded (expert)"} <= set(rep["curve"]["inputs"])
    # The calibration section says what an expert's sensitivity is.
    assert "fc + proj" in page


def test_report_warns_when_heldout_is_the_calibration_text(setup, tmp_path):
    root = setup["root"]
    cal = dict(setup["calib"])
    cal["data"] = {"path": str(root / "heldout.txt"), "samples": 1, "seq_len": 8, "tokens": 8}
    (tmp_path / "calib").mkdir()
    (tmp_path / "calib" / "calib.json").write_text(json.dumps(cal))
    res = CliRunner().invoke(main, ["report", "--ref", str(setup["fp"]), "--quant", str(setup["cks"]["graded"]),
                                    "--calib", str(tmp_path / "calib"), "--data", str(root / "heldout.txt"),
                                    "--samples", "2", "--seq-len", "16", "-o", str(tmp_path / "rep")],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "not held-out" in " ".join(res.output.split())
