"""The committed fine-grained trained fixture (Qwen3-MoE shaped: 64 experts, top-8, 128-wide expert FFN,
its own 1024-token BPE tokenizer): it is what fixture.json says, predicts held-out Python, routes
unevenly, and the converted checkpoint runs in the embedded engine as transformers'
Qwen3MoeForCausalLM does. The deeper one (12 MoE layers, top-4 of 16, the same tokenizer) is checked
for the same."""

from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import require, require_fixture
import pytest
import torch

from trtmoe.checkpoint.writer import convert
from trtmoe.data import split_texts
from trtmoe.quant.calibrate import token_batches
from trtmoe.runtime.engine import EmbeddedEngine
from trtmoe.runtime.load import load_tokenizer

transformers = require("transformers", "the fixture is compared with transformers (test extra)")

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FIXTURE = require_fixture(Path(__file__).parent / "fixtures" / "trained_qwen3_moe")
DEEP = require_fixture(Path(__file__).parent / "fixtures" / "trained_qwen3_moe_deep")


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads((FIXTURE / "fixture.json").read_text())


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    """8 held-out windows of 128 tokens (the fixture's own tokenizer)."""
    return token_batches(split_texts("heldout", max_bytes=64 * 8 * 128), load_tokenizer(FIXTURE), 8, 128)


@pytest.fixture(scope="module")
def hf_model():
    return transformers.Qwen3MoeForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.float32).eval()


def test_fixture_is_fine_grained_and_small(record):
    cfg = json.loads((FIXTURE / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts_per_tok"] == 8
    assert record["model"]["num_experts"] == 64 and cfg["router_aux_loss_coef"] == 0.0
    # Widths a 128-group divides, as Qwen3-30B-A3B's 2048 / 768 are, so that every int4 kind applies.
    assert cfg["hidden_size"] % 128 == 0 and cfg["moe_intermediate_size"] % 128 == 0
    assert cfg["vocab_size"] == 1024
    size = sum(f.stat().st_size for f in FIXTURE.iterdir())
    assert size < 21e6, size
    assert "--arch qwen3_moe" in record["reproduce"]


def test_deep_fixture_is_what_its_record_says():
    cfg = json.loads((DEEP / "config.json").read_text())
    record = json.loads((DEEP / "fixture.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_hidden_layers"] == 12
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["mlp_only_layers"]) == (16, 4, [])
    assert cfg["hidden_size"] % 128 == 0 and cfg["moe_intermediate_size"] % 128 == 0
    assert len(record["routing_heldout"]) == 12 and "--arch qwen3_moe_deep" in record["reproduce"]
    # The same tokenizer as the three-layer fixture (same corpus, vocabulary and trainer).
    assert (DEEP / "tokenizer.json").read_bytes() == (FIXTURE / "tokenizer.json").read_bytes()
    assert record["metrics"]["heldout_loss"] < record["metrics"]["unigram_heldout_loss"] - 2.0
    assert sum(f.stat().st_size for f in DEEP.iterdir()) < 22e6


@pytest.mark.parametrize("fixture", [FIXTURE, DEEP], ids=["3_layers", "12_layers"])
def test_engine_matches_transformers_on_heldout_text(fixture, windows, tmp_path):
    ids = windows[:2]
    hf_model = transformers.Qwen3MoeForCausalLM.from_pretrained(str(fixture), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf_model(input_ids=ids).logits.float()
    eng = EmbeddedEngine.from_checkpoint(convert(fixture, tmp_path / "ck", dtype="float32").out_dir, device="cpu")
    got = eng.logits(ids)
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < 1e-4, err
    # The comparison can fail: another position's logits are far off.
    assert float((got.roll(1, dims=1) - ref).abs().max() / ref.abs().max()) > 1e-2
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.999


def test_heldout_loss_is_learned_and_routing_is_skewed(hf_model, windows, record):
    with torch.no_grad():
        logits = hf_model(input_ids=windows).logits.float()
    loss = float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 1024), windows[:, 1:].reshape(-1)))
    # Well below the unigram baseline (5.98) and log(vocab) (6.93), near the recorded full held-out loss.
    assert loss < record["metrics"]["unigram_heldout_loss"] - 2.0
    assert abs(loss - record["metrics"]["heldout_loss"]) < 0.5
    # No load-balancing loss: in every layer the busiest expert takes over twice the uniform share and
    # the rarest under a tenth of it; deeper layers concentrate further.
    for row in record["routing_heldout"]:
        assert row["max_share"] > 2 / 64 and row["min_share"] < 0.1 / 64, row
    assert min(row["entropy_bits"] for row in record["routing_heldout"]) < math.log2(64) - 1
