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
STREAMS = 64  # held-out windows, each decoded once per batch size (4 batches of 8, 2 of 32)
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
        groups = [streams[i * B:(i + 1) * B] for i in range(min(4, STREAMS // B))]
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
