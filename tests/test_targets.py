"""Deployment targets (trtmoe.targets): one object per target in a registry, asked by convert, inspect,
calibrate, planning and build instead of comparing names; a target registered at run time is taken by
convert and inspect through the registry alone."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from trtmoe import cli
from trtmoe.checkpoint import support
from trtmoe.errors import InputError, UnsupportedError
from trtmoe.report.inspect import inspect_model
from trtmoe.targets import TARGETS, UnifiedHF, names, register, target_for, unregister


def test_the_registry_names_every_target_and_refuses_others():
    assert names() == ("embedded", "tensorrt-llm", "trtllm-pytorch", "vllm", "sglang")
    assert names(unified=True) == ("trtllm-pytorch", "vllm", "sglang")
    assert names(calibrates=True) == ("embedded", "tensorrt-llm")
    with pytest.raises(UnsupportedError) as e:
        target_for("tensorrt")
    assert e.value.render() == ("unknown target 'tensorrt' (choose from embedded, tensorrt-llm, trtllm-pytorch, "
                                "vllm, sglang)")
    with pytest.raises(ValueError, match="taken"):
        register(UnifiedHF("vllm"))
    with pytest.raises(ValueError, match="support table"):
        UnifiedHF("made-up")  # no releases of its own and none given


def test_each_target_answers_what_was_decided_by_its_name():
    emb, trt, vllm = TARGETS["embedded"], TARGETS["tensorrt-llm"], TARGETS["vllm"]
    # Plan granularity: the finest unit the engine runs.
    assert [emb.plan_granularity("auto", p, b) for p, b in (("graded", True), ("frequency", False),
                                                             ("uniform", False))] == ["matrix", "expert", "layer"]
    assert trt.plan_granularity("auto", "graded", True) == "layer"
    assert trt.plan_granularity("expert", "none", False) == "expert"  # placement only: nothing to run per expert
    for asked, policy in (("matrix", "graded"), ("expert", "graded"), ("layer", "frequency")):
        with pytest.raises(UnsupportedError, match="TensorRT-LLM"):
            trt.plan_granularity(asked, policy, policy == "graded")
    # Candidate formats: the support table's on the engine path, unrestricted on the embedded engine.
    assert trt.support_options("1.2", "mixtral") == support.options("1.2", "mixtral")
    assert emb.support_options("1.2", "mixtral") is None
    assert trt.stacked_scoring and not emb.stacked_scoring and not vllm.calibrates
    assert (trt.rounder, emb.rounder) == ("engine builder", "engine")
    # Build step and memory estimate.
    assert [t.build_backend for t in TARGETS.values()] == ["embedded", "tensorrt-llm", None, None, None]
    assert (trt.memory_scope, emb.memory_scope) == ("per GPU", "embedded engine process")
    assert trt.chunks_prompts({"use_paged_context_fmha": True, "remove_input_padding": True})
    assert not emb.chunks_prompts({"use_paged_context_fmha": True, "remove_input_padding": True})
    # Unified-HF releases and their support cells.
    assert TARGETS["trtllm-pytorch"].releases == ("trtllm-1.2.1", "trtllm-1.4")
    with pytest.raises(InputError, match="not a vllm release"):
        vllm.engine("sglang-0.5")


@pytest.fixture
def next_engine():
    """A target that is not trtmoe's: a unified-HF engine answering with vLLM 0.33's cells."""
    t = register(UnifiedHF("vllm-next", releases=("vllm-0.33",)))
    yield t
    unregister(t.name)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_with_ids):
    return tiny_qwen3_with_ids


def _invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


def test_a_registered_target_is_taken_by_inspect_and_convert(next_engine, qwen3, tmp_path):
    model, d = qwen3
    # The CLI's choices are the registry's.
    assert "vllm-next" in next(p for p in cli.convert.params if p.name == "target").type.choices
    # inspect: the target's support cell, the same as vLLM's; a refused format is exit 3 with its engine's words.
    r = _invoke("inspect", model, "--target", "vllm-next", "--format", "fp8", "--sm", "100", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["support"] == inspect_model(str(model), target="vllm", fmt="fp8", sm=100)["support"]
    r = _invoke("inspect", model, "--target", "vllm-next", "--format", "int4")
    assert r.exit_code == 3 and "vLLM 0.33 does not load this unified-HF export" in r.stderr
    # convert: the same checkpoint bytes as --target vllm; the manifest names the target it was written for.
    for name in ("vllm", "vllm-next"):
        r = _invoke("convert", model, "-o", tmp_path / name, "--target", name, "--layer-format", "*=fp8",
                    "--calib-ids", d / "ids.json", "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["target"] == name
    files = sorted(p.name for p in (tmp_path / "vllm").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "vllm-next").iterdir())
    for f in files:
        a, b = (tmp_path / "vllm" / f).read_bytes(), (tmp_path / "vllm-next" / f).read_bytes()
        if f != "manifest.json":
            assert a == b, f
    ma, mb = (json.loads((tmp_path / n / "manifest.json").read_text()) for n in ("vllm", "vllm-next"))
    assert (ma.pop("target"), mb.pop("target")) == ("vllm", "vllm-next")
    for m in (ma, mb):
        m.pop("created", None)
    assert ma == mb
    # An engine release outside the target's is refused by name.
    r = _invoke("convert", model, "-o", tmp_path / "x", "--target", "vllm-next", "--layer-format", "*=fp8",
                "--engine", "sglang-0.5", "--calib-ids", d / "ids.json")
    assert r.exit_code == 2
    assert "engine release 'sglang-0.5' is not a vllm-next release (one of vllm-0.33)" in r.stderr
    assert not (tmp_path / "x").exists()
