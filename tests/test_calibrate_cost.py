"""What a calibration cost, measured: seconds per phase and the ratio to one forward pass over the same
tokens, recorded in calib.cost.json beside calib.json (which keeps no timings) and printed by the
command; the settings ``calibrate`` takes as one frozen ``CalibrationSettings``; ``convert --device``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time

import pytest
import torch

from trtmoe import config as cfgmod
from trtmoe.checkpoint.manifest import read_manifest
from trtmoe.checkpoint.verify import verify_artifact
from trtmoe.checkpoint.writer import search_device
from trtmoe.errors import InputError
from trtmoe.quant.calibrate import (COST_FILE, CalibrationSettings, calibrate, cost_summary, load_cost)
from trtmoe.quant.sensitivity import RTN, PhaseClock

from test_quant_pipeline import cli
from test_sensitivity import small  # noqa: F401 - the tiny calibration set-up, a module fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SMALL = dict(samples=4, seq_len=16, batch_size=2, formats=("int8", "int4"))


@pytest.fixture(scope="module")
def written(small, tmp_path_factory):
    """A calibration written by ``calibrate`` (rtn, int8), to read its cost record from."""
    model, tok, text = small
    out = tmp_path_factory.mktemp("written") / "calib"
    calibrate(model, text, out, tokenizer=tok, rounding="rtn", **{**SMALL, "formats": ("int8",)})
    return out


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


# ---- the clock --------------------------------------------------------------------------------------

def test_nested_phases_are_counted_once():
    clock = PhaseClock()
    w0 = time.perf_counter()
    with clock("outer"):
        time.sleep(0.05)
        with clock("inner"):
            time.sleep(0.1)
            _spin(0.05)
        with clock("outer"):  # re-entering a phase adds to it
            time.sleep(0.02)
    whole = time.perf_counter() - w0
    assert list(clock.phases()) == ["outer", "inner"]
    assert clock.wall["inner"] >= 0.1 and clock.cpu["inner"] >= 0.05 and clock.wall["outer"] >= 0.07
    # Counted once: the phases fit in the time the whole took (counting the inner phase in the outer
    # one too would exceed it by the inner phase's 0.1 s at least).
    assert clock.wall["outer"] + clock.wall["inner"] <= whole


def test_a_timed_rounding_counts_its_quantization_as_searches_and_is_otherwise_the_same():
    clock = PhaseClock()
    rounding = clock.timed(RTN())
    assert rounding.name == "rtn" and rounding.input_amax == {}
    from trtmoe.quant.formats import FORMATS

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    with clock("scoring"):
        got = rounding.quantize(FORMATS["int8"], w, 0, 0, "fc", torch.float32)
    want = RTN().quantize(FORMATS["int8"], w, 0, 0, "fc", torch.float32)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in got)
    assert set(clock.phases()) == {"scoring", "searches"} and clock.wall["searches"] > 0


# ---- the record ---------------------------------------------------------------------------------------

def test_the_engine_runner_records_its_phases_and_one_forward_apart(small, tmp_path):
    model, tok, text = small
    out = tmp_path / "calib"
    res = calibrate(model, text, out, tokenizer=tok, rounding="awq", **SMALL)
    cost = res.pop("cost")
    assert cost == json.loads((out / COST_FILE).read_text()) == load_cost(out) == load_cost(out / "calib.json")
    assert cost["kind"] == "calibration-cost" and cost["runner"] == "engine" and cost["method"] == "fisher"
    assert cost["rounding"] == "awq" and cost["device"] == "cpu" and cost["tokens"] == 4 * 16
    # Every phase, the awq searches among them; they add up to the total.
    assert {"data", "io", "forward", "backward", "statistics", "searches", "scoring"} <= set(cost["phases"])
    for unit in ("wall_seconds", "cpu_seconds"):
        assert all(p[unit] >= 0 for p in cost["phases"].values())
        assert cost["total"][unit] == pytest.approx(sum(p[unit] for p in cost["phases"].values()))
    # One forward of the engine over the same tokens, timed apart; the ratio is in CPU seconds on a CPU.
    fwd = cost["forward"]
    assert cost["unit"] == "cpu_seconds" and not fwd["in_total"] and fwd["cpu_seconds"] > 0
    assert cost["ratio_to_forward"] == pytest.approx(cost["total"]["cpu_seconds"] / fwd["cpu_seconds"])
    assert cost["ratio_to_forward"] > 1 and not cost["resumed"]
    # calib.json holds no timing (its bytes are deterministic); the record names the calib.json it belongs to.
    raw = (out / "calib.json").read_bytes()
    assert b"seconds" not in raw and json.loads(raw) == json.loads(json.dumps(res))
    assert cost["calib_sha256"] == hashlib.sha256(raw).hexdigest()
    assert COST_FILE in read_manifest(out)["files"] and verify_artifact(out)["kind"] == "calibration"
    (out / COST_FILE).write_text(json.dumps({**cost, "ratio_to_forward": 1.0}))
    with pytest.raises(Exception, match="sha256"):
        verify_artifact(out)


def test_the_exact_method_records_its_reference_pass_and_reruns(small):
    model, tok, text = small
    res = calibrate(model, text, None, tokenizer=tok, sensitivity="exact", rounding="rtn",
                    **{**SMALL, "formats": ("int8",)})
    cost = res["cost"]
    assert cost["method"] == "exact" and {"forward", "scoring"} <= set(cost["phases"])
    assert "calib_sha256" not in cost  # nothing was written
    assert cost["ratio_to_forward"] == pytest.approx(cost["total"]["cpu_seconds"] / cost["forward"]["cpu_seconds"])


def test_a_cost_record_that_is_not_one_is_refused(tmp_path):
    assert load_cost(tmp_path) is None  # a calibration written before costs were recorded
    (tmp_path / COST_FILE).write_text('{"kind": "something else"}')
    with pytest.raises(InputError, match="not a calibration cost record"):
        load_cost(tmp_path)
    (tmp_path / COST_FILE).write_text("{")
    with pytest.raises(InputError, match="not readable JSON"):
        load_cost(tmp_path)


def test_the_command_prints_the_measured_figure_and_the_phase_table(small, tmp_path):
    model, tok, text = small
    r = cli("calibrate", model, "--data", text, "--tokenizer", tok, "--samples", 4, "--seq-len", 16,
            "--formats", "int8,int4", "--rounding", "awq", "-o", tmp_path / "c")
    out = " ".join(r.output.split())
    m = re.search(r"calibration took ([\d.]+) CPU-s \(([\d.]+) s wall\) = ([\d.]+)× one forward over the same 64 "
                  r"tokens \(([\d.]+) CPU-s, timed apart\)", out)
    assert m, out
    cost = load_cost(tmp_path / "c")
    assert float(m[1]) == pytest.approx(cost["total"]["cpu_seconds"], abs=0.051)
    assert float(m[3]) == pytest.approx(cost["ratio_to_forward"], abs=0.051)
    assert "Calibration phases (engine runner, fisher, awq rounding, cpu" in out
    for phase in cost["phases"]:
        assert re.search(rf"│ {phase} +│", r.output), phase
    assert "forward-pass equivalents" not in out
    j = cli("calibrate", model, "--data", text, "--tokenizer", tok, "--samples", 4, "--seq-len", 16,
            "--formats", "int8", "--rounding", "rtn", "-o", tmp_path / "d", "--json")
    assert json.loads(j.output)["cost"] == load_cost(tmp_path / "d")


def test_the_summary_says_when_no_forward_was_measured():
    clock = PhaseClock()
    with clock("backward"):
        pass
    clock.resumed = True
    from trtmoe.quant.calibrate import cost_record

    line = cost_summary(cost_record(clock, None, runner="stream", method="fisher", rounding="rtn", tokens=64))
    assert "no forward over the calibration tokens ran in this process" in line and "resumed" in line


# ---- the settings -------------------------------------------------------------------------------------

def test_settings_from_the_command_line_defaults_are_calibrates_defaults():
    section = cfgmod.resolve(None, {})["calibrate"]
    assert CalibrationSettings.from_config(section) == CalibrationSettings()
    s = CalibrationSettings.from_config({**section, "formats": ["int8"], "field": "body", "tokenizer": "tok"})
    assert s.formats == ("int8",) and s.text_field == "body" and str(s.tokenizer) == "tok"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.samples = 3  # type: ignore[misc]
    with pytest.raises(InputError, match="unknown calibration setting"):
        CalibrationSettings.from_config({"sample": 3})


def test_settings_and_single_options_calibrate_alike(small, tmp_path):
    model, tok, text = small
    s = CalibrationSettings(tokenizer=tok, rounding="rtn", **{**SMALL, "formats": ("int8",)})
    calibrate(model, text, tmp_path / "a", s)
    calibrate(model, text, tmp_path / "b", tokenizer=tok, rounding="rtn", **{**SMALL, "formats": ("int8",)})
    # A single option given beside the settings overrides that field only.
    res = calibrate(model, text, None, s, min_tokens=0)
    assert (tmp_path / "a" / "calib.json").read_bytes() == (tmp_path / "b" / "calib.json").read_bytes()
    assert res["routing"]["min_tokens_threshold"] == 0 and res["formats"] == ["int8"]
    with pytest.raises(TypeError):
        calibrate(model, text, None, s, sample=3)


# ---- convert --device -----------------------------------------------------------------------------------

def test_the_search_device_is_resolved_and_a_missing_one_refused():
    assert search_device("cpu") == torch.device("cpu")
    assert search_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(InputError, match="unknown device"):
        search_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="no CUDA device"):
            search_device("cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_convert_device_cuda_without_a_gpu_is_one_line_and_writes_nothing(small, tmp_path):
    model, _, _ = small
    r = cli("convert", model, "-o", tmp_path / "ck", "--device", "cuda", expect=2)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "Traceback" not in r.output
    assert not (tmp_path / "ck").exists()


def test_convert_device_is_a_convert_setting(small, tmp_path):
    model, _, _ = small
    cfg = tmp_path / "c.yaml"
    cfg.write_text("convert:\n  device: cpu\n")
    cli("convert", model, "-o", tmp_path / "ck", "-c", cfg)
    assert read_manifest(tmp_path / "ck")["resolved_config"]["convert"]["device"] == "cpu"
    cfg.write_text("convert:\n  device: gpu\n")
    r = cli("convert", model, "-o", tmp_path / "ck2", "-c", cfg, expect=2)
    assert "convert.device" in r.output


# ---- the report -------------------------------------------------------------------------------------

def test_the_report_shows_the_measured_cost_when_the_calibration_recorded_it(small, tmp_path):
    from trtmoe.checkpoint.writer import convert
    from trtmoe.report.assemble import write_report

    model, tok, text = small
    calibrate(model, text, tmp_path / "calib", tokenizer=tok, rounding="rtn", **{**SMALL, "formats": ("int8",)})
    ck = convert(model, tmp_path / "ck").out_dir
    bench = tmp_path / "bench.json"  # no checkpoint to evaluate: the calibration section alone
    bench.write_text(json.dumps({"rows": [], "targets": []}))
    res = write_report(ck, tmp_path / "rep", calib=tmp_path / "calib", bench_paths=[bench])
    cost = load_cost(tmp_path / "calib")
    page = res.paths["html"].read_text()
    summary = cost_summary(cost)
    assert res.report["calibration"]["cost"]["summary"] == summary
    assert f"</code>. {summary[0].upper()}{summary[1:]} (by phase, CPU-s: data " in page
    assert "forward-pass equivalents" not in page
    # A calibration without the record (written before costs were measured): the estimate, called one.
    (tmp_path / "calib" / COST_FILE).unlink()
    res = write_report(ck, tmp_path / "rep2", calib=tmp_path / "calib", bench_paths=[bench])
    page = res.paths["html"].read_text()
    assert res.report["calibration"]["cost"] is None
    assert "multiply-accumulates (the quantization searches not counted" in page


@pytest.mark.parametrize("mutate", [
    lambda c: c.pop("phases"),
    lambda c: c["phases"].__setitem__("forward", {"wall_seconds": "soon", "cpu_seconds": 1.0}),
    lambda c: c["total"].__setitem__("cpu_seconds", -1.0),
    lambda c: c.__setitem__("unit", "hours"),
    lambda c: c.__setitem__("forward", {"wall_seconds": 1.0}),
    lambda c: c.__setitem__("ratio_to_forward", "fast"),
    lambda c: c.__setitem__("tokens", True),
])
def test_a_malformed_cost_record_is_refused(written, tmp_path, mutate):
    cost = load_cost(written)
    mutate(cost)
    (tmp_path / COST_FILE).write_text(json.dumps(cost))
    with pytest.raises(InputError, match="not a calibration cost record"):
        load_cost(tmp_path)
