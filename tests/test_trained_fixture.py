"""The committed trained Mixtral fixture and the corpus helpers it was trained from.

The model is loaded, never retrained: these tests check that what is on disk still is a model
that predicts held-out Python well, routes unevenly, and ships a working tokenizer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import require, require_fixture
import pytest
import torch

from trtmoe.data import SPLITS, corpus_split, load_texts, split_texts, stdlib_files, stdlib_root, write_split_text
from trtmoe.errors import InputError

transformers = require("transformers", "the fixture is loaded with transformers (test extra)")

FIXTURE = require_fixture(Path(__file__).parent / "fixtures" / "trained_mixtral")
SEQ_LEN = 256
SAMPLE_WINDOWS = 16


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads((FIXTURE / "fixture.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(FIXTURE))


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = transformers.MixtralForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def heldout_windows(tokenizer) -> torch.Tensor:
    """SAMPLE_WINDOWS x SEQ_LEN tokens spread evenly over every 4th held-out file."""
    ids: list[int] = []
    for text in split_texts("heldout")[::4]:
        ids.extend(tokenizer(text, verbose=False).input_ids)  # whole files exceed 512; we window below
        ids.append(tokenizer.eos_token_id)
    stream = torch.tensor(ids)
    n = len(stream) // SEQ_LEN
    assert n >= SAMPLE_WINDOWS, "held-out sample too small"
    pick = torch.linspace(0, n - 1, SAMPLE_WINDOWS).round().long()
    return stream[: n * SEQ_LEN].view(n, SEQ_LEN)[pick]


@pytest.fixture(scope="module")
def heldout_eval(model, heldout_windows):
    """(mean next-token loss in nats, [layers, experts] top-k assignment counts) on the sample."""
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_local_experts, dtype=torch.long)
    handles = []
    for li, layer in enumerate(model.model.layers):

        def hook(_mod, _inp, out, li=li):
            counts[li] += torch.bincount(out[2].reshape(-1), minlength=cfg.num_local_experts)

        handles.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(input_ids=heldout_windows).logits
    finally:
        for h in handles:
            h.remove()
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), heldout_windows[:, 1:].reshape(-1)
    )
    return float(loss), counts


# ------------------------------------------------------------------ the artifact


def test_fixture_shape_and_size(record):
    cfg = json.loads((FIXTURE / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]
    expect = {
        "vocab_size": 2048,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.0,
    }
    assert {k: cfg[k] for k in expect} == expect
    # INT4 group-wise quantization uses groups of 128 along both expert input dims.
    assert cfg["hidden_size"] % 128 == 0 and cfg["intermediate_size"] % 128 == 0

    from safetensors import safe_open

    with safe_open(str(FIXTURE / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert dtypes == {"BF16"}
    # Classic Mixtral names, as Hub checkpoints store them.
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in keys
    assert "model.layers.3.block_sparse_moe.gate.weight" in keys
    total = sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file())
    assert total < 12e6, f"fixture is {total / 1e6:.1f} MB"
    for key in ("seed", "training", "metrics", "routing_heldout", "versions", "tokenizer", "model"):
        assert key in record


def test_heldout_loss_is_learned(heldout_eval, record):
    loss, _ = heldout_eval
    metrics = record["metrics"]
    log_vocab = math.log(2048)
    # Far better than uniform and than the unigram model, on text never trained on.
    assert loss < 0.5 * log_vocab, loss
    assert loss < metrics["unigram_heldout_loss"] - 1.5, (loss, metrics["unigram_heldout_loss"])
    # A 4k-token sample tracks the full held-out measurement; the margin covers sample variance
    # and stdlib differences between Python versions.
    assert abs(loss - metrics["heldout_loss"]) < 0.4, (loss, metrics["heldout_loss"])


def test_routing_is_skewed(heldout_eval, record):
    _, counts = heldout_eval
    shares = counts.double() / counts.sum(dim=1, keepdim=True)
    uniform = 1.0 / shares.shape[1]
    # Every layer routes all tokens somewhere; top-2 means two assignments per token.
    assert torch.all(counts.sum(dim=1) == 2 * SAMPLE_WINDOWS * SEQ_LEN)
    # Trained without a load-balancing loss, most layers starve some experts and favour others
    # (measured: three of four layers have an expert under 1% of assignments).
    starved_layers = int((shares.min(dim=1).values < 0.25 * uniform).sum())
    assert starved_layers >= 2, shares
    assert float(shares.max()) > 2.5 * uniform, shares
    # The recorded full-held-out statistics agree.
    recorded_min = sorted(layer["min_share"] for layer in record["routing_heldout"])
    assert recorded_min[1] < 0.25 * uniform, recorded_min


def test_tokenizer_round_trips_python(tokenizer):
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id is not None and tokenizer.unk_token_id is not None
    assert len(tokenizer) == 2048
    source = split_texts("calib")[0][:3000] + "\n\tdef f(x,  y):  # tabs, double  spaces\n\treturn 'é' + \"\\n\"\n"
    ids = tokenizer(source).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == source
    # Byte-level BPE on code compresses well beyond one byte per token.
    assert len(source) / len(ids) > 2.0


def test_greedy_generation_looks_like_python(model, tokenizer):
    ids = tokenizer("def ", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    assert text.startswith("def ")
    # A learned model continues a def with a name and an argument list.
    assert "(" in text and ")" in text, text


# ------------------------------------------------------------------ corpus splits


def test_splits_are_disjoint_and_cover_the_stdlib():
    files = stdlib_files()
    parts = {name: corpus_split(name) for name in SPLITS}
    sets = {name: set(p) for name, p in parts.items()}
    assert not sets["train"] & sets["calib"]
    assert not sets["train"] & sets["heldout"]
    assert not sets["calib"] & sets["heldout"]
    assert set().union(*sets.values()) == set(files)
    n = len(files)
    assert 0.7 * n < len(parts["train"]) < 0.9 * n
    assert len(parts["calib"]) > 0.04 * n and len(parts["heldout"]) > 0.04 * n
    assert parts["heldout"] == corpus_split("heldout")  # stable order and membership
    root = stdlib_root()
    for p in files:
        rel = p.relative_to(root)
        assert p.suffix == ".py" and not rel.name.startswith("test_")
        assert not {"site-packages", "test", "tests"} & set(rel.parts[:-1])


def test_unknown_split_is_an_input_error():
    with pytest.raises(InputError, match="unknown corpus split"):
        corpus_split("validation")


def test_write_split_text_respects_max_bytes(tmp_path):
    out = tmp_path / "sub" / "calib.txt"
    written = write_split_text("calib", out, max_bytes=20_000)
    data = out.read_bytes()
    assert written == len(data)
    assert 10_000 < written <= 20_000
    assert load_texts(out)[0] == data.decode("utf-8")


# ------------------------------------------------------------------ load_texts


def test_load_texts_plain_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello world\n")
    assert load_texts(f) == ["hello world\n"]
    assert load_texts(str(f)) == ["hello world\n"]


def test_load_texts_directory_mixes_formats(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b" / "c.md").write_text("# title\n")
    (tmp_path / "b" / "d.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    (tmp_path / "blank.txt").write_text("   \n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / ".hidden.txt").write_text("secret\n")
    assert load_texts(tmp_path) == ["x = 1\n", "# title\n", "one", "two"]


def test_load_texts_jsonl_field_override(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text('{"content": "alpha", "text": "ignored"}\n{"content": "beta"}\n')
    assert load_texts(f, field="content") == ["alpha", "beta"]


def test_load_texts_errors(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_texts(tmp_path / "missing.txt")

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(InputError, match="no calibration text"):
        load_texts(empty)

    empty_dir = tmp_path / "nothing"
    empty_dir.mkdir()
    with pytest.raises(InputError, match="no calibration text"):
        load_texts(empty_dir)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:2: invalid JSON"):
        load_texts(bad)

    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(InputError, match=r"nofield\.jsonl:2: record has no 'text' field"):
        load_texts(no_field)

    wrong_type = tmp_path / "wrong.jsonl"
    wrong_type.write_text('{"text": 5}\n')
    with pytest.raises(InputError, match=r"wrong\.jsonl:1: field 'text' is int"):
        load_texts(wrong_type)

    not_object = tmp_path / "list.jsonl"
    not_object.write_text('["text"]\n')
    with pytest.raises(InputError, match=r"list\.jsonl:1: expected a JSON object"):
        load_texts(not_object)

    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x00" * 64)
    with pytest.raises(InputError, match="binary"):
        load_texts(binary)
