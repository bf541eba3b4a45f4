"""How the embedded engine holds its weights and which kinds it runs: ``weights="checkpoint"`` keeps the
embedding and weight matrices in the checkpoint's dtype (a float32 engine converts a block of a
weight per product) and computes what the float32-held engine computes; router and attention kinds
come from their registries (``trtmoe.runtime.routers`` / ``trtmoe.runtime.attention``)."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from conftest import TRAINED_MIXTRAL, require_fixture
from trtmoe.checkpoint.writer import convert
from trtmoe.errors import InputError, UnsupportedError
from trtmoe.hf.reader import HFCheckpoint
from trtmoe.quant.plan import uniform_plan
from trtmoe.runtime import attention, routers
from trtmoe.runtime.attention.gqa import GroupedQueryAttention
from trtmoe.runtime.checkpoint_reader import RankFiles, load_config
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams
from trtmoe.runtime.load import load_engine

FIXTURE = require_fixture(TRAINED_MIXTRAL)
IDS = torch.randint(4, 2000, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("weights") / "ckpt"
    convert(FIXTURE, out)  # the fixture's own bfloat16
    return out


@pytest.fixture(scope="module")
def int8_ckpt(tmp_path_factory):
    with HFCheckpoint(FIXTURE) as src:
        plan = uniform_plan(src.model, "int8")
    return convert(FIXTURE, tmp_path_factory.mktemp("weights") / "int8", quant=plan).out_dir


def _held_bytes(eng: EmbeddedEngine) -> int:
    mats = [eng.embedding, eng.lm_head.w]
    for lay in eng.layers:
        mats += [lay.attn.wqkv.w, lay.attn.wo.w, lay.experts.fc, lay.experts.proj]
    return sum(t.numel() * t.element_size() for t in mats)


def test_checkpoint_weights_keep_the_dtype_and_compute_the_same(ckpt):
    full = EmbeddedEngine.from_checkpoint(ckpt, device="cpu", pack_experts=False)
    kept = EmbeddedEngine.from_checkpoint(ckpt, device="cpu", pack_experts=False, weights="checkpoint")
    assert kept.compute_dtype == full.compute_dtype == torch.float32 and kept.weight_dtype == torch.bfloat16
    lay = kept.layers[0]
    assert {kept.embedding.dtype, kept.lm_head.w.dtype, lay.attn.wqkv.w.dtype, lay.experts.fc.dtype} == {torch.bfloat16}
    assert kept.lm_head.packed is None and lay.input_norm.dtype == torch.float32
    assert 2 * _held_bytes(kept) == _held_bytes(full)
    # The same float32 values multiplied: logits agree to float32 rounding, greedy decoding exactly.
    a, b = full.logits(IDS), kept.logits(IDS)
    assert b.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-5, atol=1e-5), float((a - b).abs().max())
    p = SamplingParams(max_new_tokens=12)
    assert kept.generate(IDS[0].tolist(), p) == full.generate(IDS[0].tolist(), p)
    # Gradients with respect to activations pass through the converted blocks.
    ga, gb = (e.logits_with_grad(IDS[:1]).logsumexp(-1).sum() for e in (full, kept))
    assert torch.isclose(ga, gb, rtol=1e-5)


def test_checkpoint_weights_with_quantized_experts(int8_ckpt):
    full = EmbeddedEngine.from_checkpoint(int8_ckpt, device="cpu")
    kept = EmbeddedEngine.from_checkpoint(int8_ckpt, device="cpu", weights="checkpoint")
    assert kept.layers[0].attn.wqkv.w.dtype == torch.bfloat16
    a, b = full.logits(IDS), kept.logits(IDS)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), float((a - b).abs().max())


def test_run_keeps_the_checkpoint_dtype_unless_asked(ckpt):
    from trtmoe.cli import main

    assert load_engine(ckpt, "cpu").weight_dtype == torch.bfloat16
    assert load_engine(ckpt, "cpu", weights="compute").weight_dtype == torch.float32
    outs = []
    for mode in ("checkpoint", "compute"):
        r = CliRunner().invoke(main, ["run", str(ckpt), "--tokenizer", str(FIXTURE), "-p", "def main(", "-n", "6",
                                      "--device", "cpu", "--weights", mode, "--json"])
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.output)[0]["output_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 6
    with pytest.raises(InputError, match="weights must be one of compute, checkpoint"):
        EmbeddedEngine.from_checkpoint(ckpt, device="cpu", weights="float64")


def test_a_router_kind_plugs_in_by_its_entry(ckpt, monkeypatch):
    def first_experts(logits, k, cfg):  # every token to experts 0..k-1, equal weights
        idx = torch.arange(k, device=logits.device).expand(logits.shape[0], k)
        return torch.full(idx.shape, 1.0 / k, device=logits.device), idx, None

    monkeypatch.setitem(routers.KINDS, 99, first_experts)
    cfg = replace(load_config(ckpt), normalization_mode=99)
    eng = EmbeddedEngine(cfg, torch.device("cpu"), ckpt)
    files = RankFiles(ckpt, cfg)
    try:
        eng._load(files)
    finally:
        files.close()
    picks = []
    eng.route_hook = lambda li, idx: picks.append(idx)
    eng.logits(IDS)
    assert picks and all(bool((p == torch.arange(cfg.top_k)).all()) for p in picks)
    with pytest.raises(UnsupportedError, match="normalization mode 98"):
        EmbeddedEngine(replace(cfg, normalization_mode=98), torch.device("cpu"))


def test_attention_kinds_come_from_the_registry(ckpt, monkeypatch):
    calls = []

    class Probe(GroupedQueryAttention):
        def __call__(self, *args):
            calls.append(1)
            return super().__call__(*args)

    base = EmbeddedEngine.from_checkpoint(ckpt, device="cpu").logits(IDS)
    monkeypatch.setitem(attention.KINDS, "gqa", Probe)
    eng = EmbeddedEngine.from_checkpoint(ckpt, device="cpu")
    assert torch.equal(eng.logits(IDS), base) and len(calls) == eng.num_layers
    with pytest.raises(UnsupportedError, match="attention kind 'mla' is not supported.*runs gqa"):
        attention.attention_for(SimpleNamespace(attention_kind="mla"), {}, None, None)


@pytest.mark.parametrize("asked", [None, "compute"])
def test_the_served_engine_holds_what_the_repository_says(ckpt, tmp_path, asked):
    from trtmoe.cli import TrtmoeGroup
    from trtmoe.build import commands as build_commands
    from trtmoe.triton.repository import generate_repository, validate_repository
    from trtmoe.triton.served import load_served_engine

    group = TrtmoeGroup(commands={"build": build_commands.build})
    engine = tmp_path / "engine"
    r = CliRunner().invoke(group, ["build", str(ckpt), "-o", str(engine), "--max-input-len", "64",
                                   "--max-seq-len", "128"])
    assert r.exit_code == 0, r.output
    kw = {} if asked is None else {"weights": asked}
    repo = generate_repository(engine, tmp_path / "repo", tokenizer_dir=FIXTURE, torch_num_threads=1, **kw).path
    params = validate_repository(repo)["tensorrt_llm"].parameters
    config = {"parameters": {k: {"string_value": v.string_value} for k, v in params.items()}}
    served = load_served_engine(config, str(repo / "tensorrt_llm"))
    want = torch.float32 if asked == "compute" else torch.bfloat16
    assert served.engine.weight_dtype == want and served.engine.layers[0].attn.wqkv.w.dtype == want
