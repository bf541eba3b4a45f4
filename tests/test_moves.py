"""What a decode step moves: ``inspect --batch``'s prediction of distinct experts per step (from a
calibration's measured routing) against what the embedded engine counts when it decodes B independent
streams of text from the same distribution, on the trained fixtures; and the engine's own count
against the route hook's picks."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from trtmoe.checkpoint.writer import convert
from trtmoe.cli import main
from trtmoe.data import write_split_text
from trtmoe.parallel.mapping import Mapping
from trtmoe.quant.calibrate import calibrate
from trtmoe.report.inspect import _describe
from trtmoe.report.moves import (GPUS, expected_distinct, parse_batches, parse_gpu, uniform_probs, used_prob,
                                 what_it_moves)
from trtmoe.report.quality import heldout_ids
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams, decode_summary
from trtmoe.runtime.load import load_tokenizer

from conftest import REPO_ROOT, require_fixture

FIXTURES = REPO_ROOT / "tests" / "fixtures"
STEPS = 63
STREAMS = 64  # held-out windows, each decoded once per batch size (8 batches of 8, 2 of 32)
WINDOW = 128  # calibration windows; a stream starts 1..64 tokens in, so it decodes within them
BATCHES = (1, 8, 32)


# ---- the expectation itself ---------------------------------------------------------------------------
def test_expected_distinct_is_the_union_of_top_k_sets_without_replacement():
    """Σ_e 1 - (1 - p_e)^B against a brute-force enumeration of top-k sets drawn without replacement."""
    import itertools
    import random

    rng = random.Random(0)
    E, k, B = 5, 2, 3
    sets = list(itertools.combinations(range(E), k))
    w = [rng.random() for _ in sets]
    w = [x / sum(w) for x in w]  # a distribution over top-k sets
    p = [sum(wi for s, wi in zip(sets, w) if e in s) for e in range(E)]
    assert sum(p) == pytest.approx(k)
    exact = sum(len(set().union(*combo)) * wprod
                for combo, wprod in ((tuple(sets[i] for i in idx), _prod(w[i] for i in idx))
                                     for idx in itertools.product(range(len(sets)), repeat=B)))
    assert expected_distinct(p, B) == pytest.approx(exact, rel=1e-12)
    assert expected_distinct(p, 1) == pytest.approx(k)
    # The with-replacement shortcut (k·B independent uniform picks) is a different, lower number.
    assert E * (1 - (1 - 1 / E) ** (k * B)) < expected_distinct([k / E] * E, B)


def _prod(xs):
    out = 1.0
    for x in xs:
        out *= x
    return out


def test_uniform_full_size_configs(tmp_path):
    """From config.json alone: a step at batch 1 reads top-k experts per layer, coverage grows to all
    of them, bytes grow with it, and the roofline's steps per second fall."""
    for name, E, k in (("Mixtral-8x7B-v0.1", 8, 2), ("Qwen3-30B-A3B", 128, 8), ("Qwen3-235B-A22B", 128, 8)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((FIXTURES / "model_configs" / f"{name}.json").read_text())
        _, m, _ = _describe(str(d))
        rep = what_it_moves(m, Mapping.create(8, 1, None, 8), torch.bfloat16, batches=[1, 32, 256])
        rows = [r["uniform"] for r in rep["batches"]]
        assert rows[0]["distinct_experts_mean"] == pytest.approx(k)
        assert rows[-1]["distinct_experts_mean"] == pytest.approx(E, rel=1e-3)
        assert [r["weight_bytes"] for r in rows] == sorted(r["weight_bytes"] for r in rows)
        assert rows[0]["steps_per_s"] > rows[1]["steps_per_s"] > rows[2]["steps_per_s"]
        # batch 1: the roofline of one H100 is the per-rank bytes over 3.35 TB/s
        top = max(x["bytes"] for x in rows[0]["ranks"])
        assert rows[0]["steps_per_s"] <= GPUS["H100"].bandwidth / top * (1 + 1e-9)
        assert rep["placement"]["placements"]["contiguous"][0]["tokens_max_over_mean"] == pytest.approx(1.0)


def test_options_are_checked():
    assert parse_batches("32,1,8") == [1, 8, 32]
    assert parse_gpu("h200").bandwidth == 4.8e12
    assert parse_gpu("2000").bandwidth == 2e12
    assert parse_gpu("3.35TB/s").bandwidth == pytest.approx(3.35e12)
    for bad in ("0", "x", "1,,-2"):
        with pytest.raises(Exception) as e:
            parse_batches(bad) if "," in bad or bad == "0" else parse_gpu(bad)
        assert type(e.value).__name__ == "InputError"
    assert used_prob(1.0, 3) == 1.0 and used_prob(0.0, 3) == 0.0


# ---- the engine's count against the prediction on the trained fixtures -------------------------------
@pytest.fixture(scope="module", params=["trained_mixtral", "trained_qwen3_moe"])
def measured(request, tmp_path_factory, one_torch_thread):
    """(fixture, its calibration on the calib split, a checkpoint, the held-out streams)."""
    fx = require_fixture(FIXTURES / request.param)
    root = tmp_path_factory.mktemp(request.param)
    text = root / "calib.txt"
    write_split_text("calib", text, max_bytes=400_000)
    cal = calibrate(fx, text, None, samples=64, seq_len=WINDOW, formats=("int8",), min_tokens=0)
    ck = convert(fx, root / "ck").out_dir
    streams = heldout_ids(load_tokenizer(fx), samples=STREAMS, seq_len=WINDOW)
    return fx, cal, ck, streams


def _decode(eng: EmbeddedEngine, streams: torch.Tensor) -> dict:
    """Decode one stream per row of ``streams`` for STEPS steps, each step fed the row's next text
    token (teacher forcing: the step decodes text, not the model's own guesses); the traffic it moved.
    The streams start at different points of their windows (a prompt of 1..64 tokens), as independent
    requests do: streams all at one position would share what routing owes to the position."""
    B = len(streams)
    starts = [1 + (b * 64) // B for b in range(B)]
    params = SamplingParams(max_new_tokens=STEPS + 1, end_id=None)
    seqs = eng.start_many([[int(x) for x in r[:n]] for r, n in zip(streams, starts)], [params] * B)
    before = eng.decode_traffic()
    for t in range(STEPS):
        for s, r, n in zip(seqs, streams, starts):
            s.tokens[-1] = int(r[n + t])
        eng.step(seqs)
    return decode_summary(eng.decode_traffic(), before, [l for l, x in enumerate(eng.cfg.moe_layers) if x])


def _merge(runs: list[dict]) -> dict:
    """Per-step means over several decode runs of the same length."""
    n = len(runs)
    per = {l: sum(r["distinct_experts_per_layer"][l] for r in runs) / n for l in runs[0]["distinct_experts_per_layer"]}
    return {"steps": sum(r["steps"] for r in runs), "tokens": sum(r["tokens"] for r in runs),
            "distinct_experts_per_layer": per, "distinct_experts_mean": sum(per.values()) / len(per),
            "bytes_per_step": {k: sum(r["bytes_per_step"][k] for r in runs) / n for k in runs[0]["bytes_per_step"]}}


def test_prediction_matches_the_engines_count(measured):
    fx, cal, ck, streams = measured
    _, m, _ = _describe(str(fx))
    pred = what_it_moves(m, Mapping(), torch.bfloat16, batches=BATCHES, calib=cal)
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    assert eng.cfg.dtype == torch.bfloat16
    for row in pred["batches"]:
        B = row["batch"]
        p = row["measured"]
        # Several batches of B streams: B windows' documents alone are a small sample of the text.
        groups = [streams[i * B:(i + 1) * B] for i in range(min(8, STREAMS // B))]
        runs = [_decode(eng, g) for g in groups]
        got = _merge(runs)
        assert got["steps"] == STEPS * len(groups) and got["tokens"] == STEPS * B * len(groups)
        if B == 1:  # a token's top-k experts are distinct: exactly k, in every layer
            assert all(v == m.top_k for v in got["distinct_experts_per_layer"].values())
        assert got["distinct_experts_mean"] == pytest.approx(p["distinct_experts_mean"], rel=0.05), (B, got, p)
        assert got["bytes_per_step"]["expert_bytes"] == pytest.approx(p["expert_bytes"], rel=0.05)
        assert got["bytes_per_step"]["nonexpert_bytes"] == p["nonexpert_bytes"]
        # Measured routing is skewed: uniform routing would predict more distinct experts at batch > 1.
        if B > 1:
            assert row["uniform"]["distinct_experts_mean"] > p["distinct_experts_mean"]


def test_engine_counts_the_experts_each_step_reads(measured):
    """``decode_traffic`` against the route hook's picks, step by step, mixed with prefills (which it
    must not count) and read between steps."""
    _, _, ck, streams = measured
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    L, E = eng.cfg.num_layers, eng.cfg.num_experts
    touched = torch.zeros(L, E, dtype=torch.int64)
    picks: dict[int, torch.Tensor] = {}
    eng.route_hook = lambda li, idx: picks.__setitem__(li, idx.clone())
    params = SamplingParams(max_new_tokens=8, end_id=None)
    seqs = eng.start_many([[int(x) for x in r[:5]] for r in streams[:6]], [params] * 6)
    steps = 0
    for t in range(6):
        if t == 3:  # a prefill in between is not a decode step
            seqs.append(eng.start([int(x) for x in streams[7][:9]], params))
        picks.clear()
        eng.step(seqs)
        steps += 1
        for li, idx in picks.items():
            touched[li, idx.reshape(-1).unique()] += 1
        if t == 2:
            assert eng.decode_traffic()["steps"] == 3
    tr = eng.decode_traffic()
    assert tr["steps"] == steps and tr["rows"] == 3 * 6 + 3 * 7
    assert torch.equal(tr["touched"], touched)
    assert tr["expert_bytes"] == int((touched * eng.expert_bytes).sum())
    eng.reset_routing_stats()
    assert eng.decode_traffic()["steps"] == 0 and int(eng.decode_traffic()["touched"].sum()) == 0


def test_inspect_cli_reports_measured_and_uniform(measured, tmp_path):
    fx, cal, _, _ = measured
    (tmp_path / "calib.json").write_text(json.dumps(cal))
    r = CliRunner().invoke(main, ["inspect", str(fx), "--calib", str(tmp_path), "--batch", "1,8", "--moe-ep", "2",
                                  "--tp", "2", "--gpu", "B200", "--json"])
    assert r.exit_code == 0, r.output
    mv = json.loads(r.output)["moves"]
    assert mv["routing"] == "measured" and mv["gpu"]["bandwidth_bytes_per_s"] == 8e12
    assert [b["batch"] for b in mv["batches"]] == [1, 8]
    assert set(mv["placement"]["placements"]) == {"contiguous", "balanced"}
    # balanced placement never leaves the hottest rank's expected tokens above contiguous's
    for c, b in zip(mv["placement"]["placements"]["contiguous"], mv["placement"]["placements"]["balanced"]):
        assert b["tokens_max_over_mean"] <= c["tokens_max_over_mean"] + 1e-9
    r = CliRunner().invoke(main, ["inspect", str(fx), "--calib", str(tmp_path), "--batch", "1,8"])
    assert r.exit_code == 0 and "What a decode step moves" in r.output


def test_run_json_and_served_metrics_report_the_engines_count(measured, tmp_path):
    """``trtmoe run --json`` carries each prompt's decode traffic; the served model's publisher turns
    the engine's ``routing_stats`` into the decode counters (a recording stand-in for Triton's
    ``pb_utils.MetricFamily``; the real server's families are the publisher's)."""
    from trtmoe.triton.metrics import DECODE_BYTES, DECODE_DISTINCT, DECODE_DISTINCT_MEAN, DECODE_STEPS, \
        RoutingMetricsPublisher

    fx, _, ck, _ = measured
    r = CliRunner().invoke(main, ["run", str(ck), "--tokenizer", str(fx), "-p", "def main(", "-n", "6", "--json"])
    assert r.exit_code == 0, r.output
    dec = json.loads(r.output)[0]["decode"]
    k = _describe(str(fx))[1].top_k
    assert dec["steps"] == 5 and dec["mean_batch"] == 1.0  # the first token comes from the prefill
    assert all(v == k for v in dec["distinct_experts_per_layer"].values())
    assert dec["bytes_per_step"]["total"] > dec["bytes_per_step"]["expert_bytes"] > 0

    class Family:
        COUNTER, GAUGE = "counter", "gauge"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels):  # noqa: N802 - Triton's spelling
            m = type("M", (), {})()
            m.family, m.labels, m.value = self.name, labels, 0.0
            m.set = lambda v, m=m: setattr(m, "value", v)
            m.increment = lambda v, m=m: setattr(m, "value", m.value + v)
            made.append(m)
            return m

    made: list = []
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu")
    pub = RoutingMetricsPublisher(type("PB", (), {"MetricFamily": Family})(), num_layers=eng.num_layers,
                                  num_experts=eng.num_experts)
    params = SamplingParams(max_new_tokens=12, end_id=None)
    seqs = eng.start_many([[1, 5], [1, 9, 4], [1, 7]], [params] * 3)
    for i in range(10):
        eng.step(seqs)
        if i in (3, 9):
            pub.update(eng.routing_stats())
    tr = eng.decode_traffic()
    val = {(m.family, tuple(sorted(m.labels.items()))): m.value for m in made}
    assert val[(DECODE_STEPS, (("model", "tensorrt_llm"),))] == tr["steps"] == 10
    for l in range(eng.num_layers):
        assert val[(DECODE_DISTINCT, (("layer", str(l)), ("model", "tensorrt_llm")))] == int(tr["distinct_sum"][l])
        assert 0 < val[(DECODE_DISTINCT_MEAN, (("layer", str(l)), ("model", "tensorrt_llm")))] <= 3 * k
    assert val[(DECODE_BYTES, (("kind", "experts"), ("model", "tensorrt_llm")))] == tr["expert_bytes"]
    assert val[(DECODE_BYTES, (("kind", "kv_cache"), ("model", "tensorrt_llm")))] == tr["kv_bytes"]


# ---- router what-ifs ------------------------------------------------------------------------------------
def test_router_override_capacity_top_k_and_temperature(measured):
    """The override hook: a capacity keeps exactly the first ceil(f·N·k/E) picks of each expert in token
    order; top-k − 1 runs k − 1 picks; a temperature leaves the first MoE layer's picks as they were."""
    from trtmoe.runtime.engine import RouterOverride

    ov = RouterOverride(capacity_factor=1.0)
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # E = 4, N = 4, k = 2: capacity 2 per expert
    assert ov.keep(idx, 4).tolist() == [[True, True], [True, True], [False, True], [True, False]]
    with pytest.raises(Exception):
        RouterOverride(temperature=0.0)
    _, _, ck, streams = measured
    eng = EmbeddedEngine.from_checkpoint(ck, device="cpu", pack_experts=False)
    k = eng.cfg.top_k
    ids = streams[:2, :32]
    seen: dict = {}
    eng.route_hook = lambda li, i: seen.setdefault(li, i.clone())
    ref = eng.logits(ids)
    first = min(seen)
    base = seen[first]
    for override, check in ((RouterOverride(top_k=k - 1), lambda i: i.shape[1] == k - 1),
                            (RouterOverride(temperature=2.0), lambda i: torch.equal(i, base)),
                            (RouterOverride(capacity_factor=1.0), lambda i: bool((i < 0).any()))):
        seen.clear()
        eng.router_override = override
        out = eng.logits(ids)
        eng.router_override = None
        assert check(seen[first]), override
        assert not torch.allclose(out, ref)
    seen.clear()
    assert torch.equal(eng.logits(ids), ref)  # nothing left behind


def test_report_has_what_it_moves_and_router_what_ifs(measured, tmp_path):
    from trtmoe.report.assemble import write_report

    fx, cal, ck, _ = measured
    cdir = tmp_path / "calib"
    cdir.mkdir()
    (cdir / "calib.json").write_text(json.dumps(cal))
    res = write_report(ck, tmp_path / "report", calib=cdir, samples=4, seq_len=32, batch_size=2, tokenizer=fx,
                       what_ifs=True)
    rep = res.report
    wi = {r["name"]: r for r in rep["router_what_ifs"]["what_ifs"]}
    k = cal["top_k"]
    assert wi[f"top-{k - 1} (k − 1)"]["dropped"] == pytest.approx(1 / k)
    assert wi["temperature 2"]["dropped"] == 0.0
    caps = [wi[f"capacity {f}"] for f in ("1", "1.25", "2")]
    assert caps[0]["dropped"] >= caps[1]["dropped"] >= caps[2]["dropped"]
    assert all(r["kl"]["mean"] > 0 for r in wi.values())
    mv = rep["moves"]
    cover = [b["measured"]["expert_coverage"] for b in mv["batches"]]
    assert cover == sorted(cover) and mv["batches"][0]["measured"]["distinct_experts_mean"] == pytest.approx(k)
    page = res.paths["html"].read_text()
    assert "What it moves" in page and "Router what-ifs" in page
    assert res.paths["moves"].stat().st_size > 0 and res.paths["what_ifs"].stat().st_size > 0


def test_inspect_plan_takes_the_checkpoints_formats(tmp_path):
    """``--plan ckpt/``: the experts a step reads are counted at the checkpoint's formats (int8 here:
    half of bfloat16's bytes, plus a scale per output row)."""
    from trtmoe.quant.plan import uniform_plan

    fx = require_fixture(FIXTURES / "trained_mixtral")
    _, m, _ = _describe(str(fx))
    ck = convert(fx, tmp_path / "int8", quant=uniform_plan(m, "int8")).out_dir
    out = {}
    for extra in ([], ["--plan", str(ck)]):
        r = CliRunner().invoke(main, ["inspect", str(fx), "--batch", "1,8", "--json", *extra])
        assert r.exit_code == 0, r.output
        out[bool(extra)] = json.loads(r.output)["moves"]
    H, I = m.hidden_size, m.expert_intermediate_size
    per_expert = {False: 3 * H * I * 2, True: 3 * H * I + (2 * I + H) * 2}  # bf16; int8 + bf16 row scales
    for plan in (False, True):
        assert out[plan]["batches"][0]["uniform"]["expert_bytes"] == m.num_moe_layers * m.top_k * per_expert[plan]
    assert out[True]["experts"].startswith("plan of")


def test_expected_busiest_rank_against_enumeration():
    """E[max over EP ranks of the expert bytes a step reads] with experts read independently, against
    enumerating every subset of read experts; one rank: exactly Σ q·b."""
    import itertools

    from trtmoe.report.moves import expected_busiest

    q = [0.9, 0.2, 0.5, 0.05, 0.7, 0.3]
    groups = [(q[0:2], [10, 10]), (q[2:4], [10, 10]), (q[4:6], [10, 10])]
    exact = 0.0
    for read in itertools.product((0, 1), repeat=6):
        pr = _prod(x if r else 1 - x for x, r in zip(q, read))
        exact += pr * max(10 * sum(read[i:i + 2]) for i in (0, 2, 4))
    assert expected_busiest(groups) == pytest.approx(exact, rel=1e-12)
    assert expected_busiest([(q, [3] * 6)]) == pytest.approx(3 * sum(q))
    assert expected_busiest(groups) > max(10 * sum(g[0]) for g in groups)  # above the busiest expectation
