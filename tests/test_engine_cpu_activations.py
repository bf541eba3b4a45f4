"""``cpu_activations="model"``: an embedded engine on CPU computes in the checkpoint's dtype, as on
CUDA. With a bfloat16 checkpoint on a CPU with native bfloat16 products every weight is held in
bfloat16 packed for oneDNN; the next-token distribution stays the float32 engine's within a small KL,
decoding through the bfloat16 KV cache agrees with the full forward, quantized experts run in the CPU
integer kernels on the same activations, and the setting travels from ``trtmoe build`` through the
engine directory to ``load_engine`` and the served model."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from conftest import TRAINED_MIXTRAL, require_fixture
from trtmoe import matmul
from trtmoe.checkpoint.writer import convert
from trtmoe.errors import InputError
from trtmoe.hf.reader import HFCheckpoint
from trtmoe.quant.plan import uniform_plan
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams
from trtmoe.runtime.load import load_engine

FIXTURE = require_fixture(TRAINED_MIXTRAL)
needs_bf16 = pytest.mark.skipif(not matmul.onednn_bf16_available(),
                                reason="this CPU or PyTorch build has no native bfloat16 oneDNN linear")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("act") / "ckpt"
    convert(FIXTURE, out)  # the fixture's own bfloat16
    return out


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    a, b = ref.log_softmax(-1), got.log_softmax(-1)
    return float((a.exp() * (a - b)).sum(-1).mean())


IDS = torch.randint(4, 2000, (3, 40), generator=torch.Generator().manual_seed(1))


@needs_bf16
def test_model_activations_hold_bfloat16_weights_packed(ckpt):
    f32 = EmbeddedEngine.from_checkpoint(ckpt, device="cpu")
    b16 = EmbeddedEngine.from_checkpoint(ckpt, device="cpu", cpu_activations="model")
    assert f32.compute_dtype == torch.float32 and b16.compute_dtype == torch.bfloat16
    assert b16._kv.dtype == torch.bfloat16  # the KV cache, allocated as sequences arrive
    lay = b16.layers[0]
    assert lay.attn.wqkv.w.dtype == torch.bfloat16 and lay.attn.wqkv.packed is not None and b16.lm_head.packed is not None
    assert lay.experts.packed  # every bfloat16 expert matrix, whatever its size
    a, b = f32.logits(IDS), b16.logits(IDS)
    assert b.dtype == torch.float32 and not torch.equal(a, b)
    assert _kl(a, b) < 1e-3, _kl(a, b)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95


@needs_bf16
def test_bfloat16_decode_through_the_cache_agrees_with_the_full_forward(ckpt):
    eng = EmbeddedEngine.from_checkpoint(ckpt, device="cpu", cpu_activations="model")
    prompt = IDS[0, :16].tolist()
    gen = eng.generate(prompt, SamplingParams(max_new_tokens=12))
    full = eng.logits(torch.tensor([prompt + gen[:-1]]))[0, len(prompt) - 1:]
    # bfloat16 rounds differently for one row and for many; the picks agree where no two tokens tie.
    top2 = full.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert clear.sum() >= 6
    assert [t for t, c in zip(full.argmax(-1).tolist(), clear) if c] == [t for t, c in zip(gen, clear) if c]


@needs_bf16
def test_quantized_experts_take_the_bfloat16_activations(ckpt, tmp_path):
    with HFCheckpoint(FIXTURE) as src:
        plan = uniform_plan(src.model, "int8")
    q = convert(FIXTURE, tmp_path / "q", quant=plan).out_dir
    ref = EmbeddedEngine.from_checkpoint(q, device="cpu")
    b16 = EmbeddedEngine.from_checkpoint(q, device="cpu", cpu_activations="model")
    assert b16.layers[0].experts.kernels
    assert _kl(ref.logits(IDS), b16.logits(IDS)) < 1e-3


@needs_bf16
def test_graded_bank_holds_its_16_bit_experts_in_bfloat16(tmp_path):
    from trtmoe.quant.plan import QuantPlan
    from trtmoe.runtime import qkernels

    names = ["bf16", "int8", "int4_g64", "bf16", "int8", "int8", "int4", "bf16"]
    plan = QuantPlan({l: names for l in range(4)}, granularity="expert", dtype=torch.bfloat16)
    q = convert(FIXTURE, tmp_path / "q", quant=plan).out_dir
    ref = EmbeddedEngine.from_checkpoint(q, device="cpu", pack_experts=False)
    b16 = EmbeddedEngine.from_checkpoint(q, device="cpu", cpu_activations="model")
    f32 = EmbeddedEngine.from_checkpoint(q, device="cpu")
    for eng, dt in ((b16, torch.bfloat16), (f32, torch.float32)):
        k = eng.layers[0].experts.shards[0][0].fc
        assert isinstance(k, qkernels.FloatKernel) and k.dtype == dt
    assert _kl(ref.logits(IDS), b16.logits(IDS)) < 1e-3


def test_float32_checkpoints_and_bad_values(tmp_path):
    ck = convert(FIXTURE, tmp_path / "f32", dtype="float32").out_dir
    assert EmbeddedEngine.from_checkpoint(ck, device="cpu", cpu_activations="model").compute_dtype == torch.float32
    with pytest.raises(InputError, match="cpu_activations must be one of float32, model"):
        EmbeddedEngine.from_checkpoint(ck, device="cpu", cpu_activations="bf16")


def test_build_records_it_and_the_engine_dir_loads_it(ckpt, tmp_path):
    from trtmoe.cli import TrtmoeGroup
    from trtmoe.build import commands as build_commands
    from trtmoe.triton.engine_dir import read_engine_dir

    group = TrtmoeGroup(commands={"build": build_commands.build})
    out = tmp_path / "engine"
    r = CliRunner().invoke(group, ["build", str(ckpt), "-o", str(out), "--max-input-len", "64", "--max-seq-len", "128",
                                   "--cpu-activations", "model"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["build_config"]["cpu_activations"] == "model"
    assert read_engine_dir(out).cpu_activations == "model"
    assert load_engine(out, "cpu").compute_dtype == torch.bfloat16
    # A hand-edited value is refused by name.
    cfg["build_config"]["cpu_activations"] = "half"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="cpu_activations is 'half'"):
        read_engine_dir(out)
    # The dry run says what the default costs on CPU.
    r = CliRunner().invoke(group, ["build", str(ckpt), "-o", str(tmp_path / "e2"), "--max-input-len", "64",
                                   "--max-seq-len", "128", "--dry-run"])
    assert r.exit_code == 0 and "held in float32, up to twice these figures" in r.output, r.output


def test_run_and_load_engine_override_it_for_a_checkpoint(ckpt):
    from trtmoe.cli import main

    assert load_engine(ckpt, "cpu").compute_dtype == torch.float32
    assert load_engine(ckpt, "cpu", cpu_activations="model").compute_dtype == torch.bfloat16
    r = CliRunner().invoke(main, ["run", str(ckpt), "--tokenizer", str(FIXTURE), "-p", "def main(", "-n", "6",
                                  "--cpu-activations", "model", "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.output)[0]["output_ids"]) == 6
