"""Quantized experts in PyTorch's CPU weight-only kernels (trtmoe.runtime.qkernels): each format's
kernel matrix computes what the format's reference ``linear`` computes, up to the 16-bit roundings
of its inputs and output; shapes the kernels cannot hold keep the reference path; a serving engine
holds its quantized experts only in the kernels' layouts and its logits stay those of the reference
path (pack_experts=False) within a small KL; graded banks, moe_tp shards and activation-aware scales
run there too."""

from __future__ import annotations

import pytest
import torch

from trtmoe.checkpoint.writer import convert
from trtmoe.errors import InputError
from trtmoe.quant.formats import FORMATS
from trtmoe.quant.plan import QuantPlan
from trtmoe import matmul
from trtmoe.runtime import qkernels
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams
from trtmoe.runtime.experts import KernelShard, PackedExperts, PackedShard

E, L = 8, 2
QUANT = ["int8", "int4", "int4_g128", "int4_g64"]

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="this PyTorch build lacks the CPU weight-only "
                                "integer kernels (torch._weight_int8pack_mm / _weight_int4pack_mm_for_cpu)")


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("mixtral", num_local_experts=E, num_hidden_layers=L, seed=5, hidden_size=128,
                      intermediate_size=256, head_dim=32, dtype="bfloat16")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", QUANT)
def test_kernel_matrix_matches_the_reference_linear(name, dtype):
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(1)
    for out_f, in_f in ((512, 128), (128, 256), (96, 384)):
        w = torch.randn(out_f, in_f, generator=g) * 0.05
        packed = fmt.quantize(w, dtype=dtype)
        k = qkernels.kernel_for(fmt, packed, dtype)
        assert isinstance(k, qkernels.IntKernel), (name, out_f, in_f)
        for rows in (1, 7, 40):
            x = torch.randn(rows, in_f, generator=g)
            want = fmt.linear(x, packed)
            got = k(x)
            assert got.dtype == x.dtype and got.shape == want.shape
            # Inputs and output rounded to the model dtype: a few of its units in the last place.
            tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
            assert _rel(got, want) < tol, (name, out_f, in_f, rows, _rel(got, want))
            # Not a coincidence of scale: another matrix's kernel is far off.
            assert _rel(qkernels.kernel_for(fmt, fmt.quantize(w.flip(0), dtype=dtype), dtype)(x), want) > 0.1


@pytest.mark.skipif(not matmul.onednn_bf16_available(), reason="no native bfloat16 oneDNN linear on this CPU")
@pytest.mark.parametrize("name", QUANT)
def test_bfloat16_activations_at_every_row_count(name):
    """A bfloat16 engine's activations: INT8 blocks of INT8_DEQUANT_ROWS rows and more run as the
    dequantized weight through oneDNN, fewer in the integer kernel; both match the reference."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(4)
    packed = fmt.quantize(torch.randn(512, 256, generator=g) * 0.05, dtype=torch.bfloat16)
    k = qkernels.kernel_for(fmt, packed, torch.bfloat16, torch.bfloat16)
    for rows in (1, qkernels.INT8_DEQUANT_ROWS - 1, qkernels.INT8_DEQUANT_ROWS, 300):
        x = torch.randn(rows, 256, generator=g).bfloat16()
        got = k(x)
        assert got.dtype == torch.bfloat16
        assert _rel(got.float(), fmt.linear(x.float(), packed)) < 1e-2, (name, rows)


def test_kernel_int4_holds_half_a_byte_per_weight():
    fmt = FORMATS["int4_g128"]
    packed = fmt.quantize(torch.randn(512, 256), dtype=torch.bfloat16)
    k = qkernels.kernel_for(fmt, packed, torch.bfloat16)
    assert k.weight.numel() * k.weight.element_size() == 512 * 256 // 2
    # One scale and one zero per group of 128 inputs and output channel.
    assert k.scales.shape == (256 // 128, 512, 2)


@pytest.mark.parametrize("name, shape, dtype, why", [
    ("int8", (64, 40), torch.bfloat16, "an input width that is not a multiple of 16"),
    ("int4", (24, 64), torch.bfloat16, "an output width that is not a multiple of 16"),
    ("int4", (32, 48), torch.bfloat16, "no group of 32-256 divides the input width"),
    ("int8", (64, 64), torch.float32, "a float32 model"),
    ("int4_g64", (64, 128), torch.float32, "a float32 model"),
])
def test_shapes_and_dtypes_without_a_kernel_keep_the_reference_path(name, shape, dtype, why):
    fmt = FORMATS[name]
    packed = fmt.quantize(torch.randn(*shape), dtype=dtype)
    assert qkernels.kernel_for(fmt, packed, dtype) is None, why


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    a, b = ref.log_softmax(-1), got.log_softmax(-1)
    return float((a.exp() * (a - b)).sum(-1).mean())


def _engines(ck):
    return (EmbeddedEngine.from_checkpoint(ck, device="cpu", pack_experts=False),
            EmbeddedEngine.from_checkpoint(ck, device="cpu"))


def _ids():
    return torch.randint(4, 250, (3, 20), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("name", QUANT)
def test_serving_engine_runs_quantized_experts_in_the_kernels(model, tmp_path, name):
    plan = QuantPlan({l: [name] * E for l in range(L)}, granularity="layer", dtype=torch.bfloat16)
    ref, served = _engines(convert(model, tmp_path / "ck", quant=plan).out_dir)
    for l in range(L):
        rb, sb = ref.layers[l].experts, served.layers[l].experts
        assert isinstance(rb, PackedExperts) and not rb.kernels
        assert sb.kernels and all(isinstance(sh, KernelShard) for per in sb.shards for sh in per)
        assert sb.format_of(3) == rb.format_of(3) == name
    ids = _ids()
    assert not torch.equal(ref.logits(ids), served.logits(ids))  # the kernels really ran


@pytest.mark.parametrize("name", ["int8", "int4_g128"])
def test_trained_model_loses_almost_nothing_to_the_kernels(tmp_path, name):
    """On the trained fixture the kernels' 16-bit roundings move the next-token distribution little
    (KL to the reference path under 1e-3 nats, the top token kept almost everywhere; a wrong scale or
    code layout moves it by whole nats), and greedy decoding through the KV cache picks what the full
    forward picks."""
    from trtmoe.hf.reader import HFCheckpoint
    from trtmoe.quant.plan import uniform_plan

    from conftest import TRAINED_MIXTRAL, require_fixture

    fixture = require_fixture(TRAINED_MIXTRAL)
    with HFCheckpoint(fixture) as src:
        plan = uniform_plan(src.model, name)
    ref, served = _engines(convert(fixture, tmp_path / "ck", quant=plan).out_dir)
    flt = EmbeddedEngine.from_checkpoint(convert(fixture, tmp_path / "float").out_dir, device="cpu")
    ids = torch.randint(4, 2000, (4, 48), generator=torch.Generator().manual_seed(3))
    a, b, f = ref.logits(ids), served.logits(ids), flt.logits(ids)
    assert _kl(a, b) < 1e-3, (_kl(a, b), _kl(f, a))
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95
    assert _kl(f, a) > 1e-5  # the reference path did quantize
    prompt = ids[0, :16].tolist()
    gen = served.generate(prompt, SamplingParams(max_new_tokens=12))
    full = served.logits(torch.tensor([prompt + gen[:-1]]))[0, len(prompt) - 1:]
    assert full.argmax(-1).tolist() == gen


def test_graded_bank_with_unquantized_experts_and_moe_tp_shards(model, tmp_path):
    """A graded checkpoint (16-bit, INT8 and INT4 experts in one layer) split over two moe_tp ranks:
    every shard runs in a kernel, the 16-bit ones as float32 products that equal the reference's."""
    names = ["bf16", "int8", "int4_g64", "int4", "bf16", "int4_g128", "int8", "int8"]
    plan = QuantPlan({l: names for l in range(L)}, granularity="expert", dtype=torch.bfloat16)
    ref, served = _engines(convert(model, tmp_path / "ck", tp=2, quant=plan).out_dir)
    bank, rbank = served.layers[0].experts, ref.layers[0].experts
    assert all(len(per) == 2 and all(isinstance(sh, KernelShard) for sh in per) for per in bank.shards)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(7))
    for e, name in enumerate(names):
        got, want = bank.forward(e, x), rbank.forward(e, x)
        if name == "bf16":
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert isinstance(bank.shards[e][0].fc, qkernels.FloatKernel)
        else:
            assert _rel(got, want) < 2e-2, (e, name)
    counts = [1, 0, 2, 1, 0, 0, 1, 0]
    xs = torch.randn(sum(counts), 128, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(bank.forward_grouped(xs, counts), rbank.forward_grouped(xs, counts), rtol=2e-2,
                               atol=2e-2 * float(rbank.forward_grouped(xs, counts).abs().max()))
    assert _kl(ref.logits(_ids()), served.logits(_ids())) < 1e-3


def test_kernel_experts_refuse_to_record_a_gradient(model, tmp_path):
    plan = QuantPlan({l: ["int8"] * E for l in range(L)}, granularity="layer", dtype=torch.bfloat16)
    served = EmbeddedEngine.from_checkpoint(convert(model, tmp_path / "ck", quant=plan).out_dir, device="cpu")
    x = torch.randn(2, 128, requires_grad=True)
    with pytest.raises(InputError, match="gradient") as err:
        served.layers[0].experts.forward(1, x)
    assert "pack_experts=False" in str(err.value.hint)


def test_blas_mode_and_float32_models_keep_the_reference_path(model, tmp_path):
    plan = QuantPlan({l: ["int8"] * E for l in range(L)}, granularity="layer", dtype=torch.bfloat16)
    ck = convert(model, tmp_path / "ck", quant=plan).out_dir
    blas = EmbeddedEngine.from_checkpoint(ck, device="cpu", cpu_matmul="blas")
    assert not blas.layers[0].experts.kernels
    plan32 = QuantPlan({l: ["int8"] * E for l in range(L)}, granularity="layer", dtype=torch.float32)
    f32 = EmbeddedEngine.from_checkpoint(convert(model, tmp_path / "ck32", dtype="float32", quant=plan32).out_dir,
                                         device="cpu")
    bank = f32.layers[0].experts
    assert not bank.kernels and all(isinstance(sh, PackedShard) for per in bank.shards for sh in per)
