"""The fused-MoE formats (FP8, FP8 block scales, NVFP4, MXFP4, W4A8 AWQ): hand-computed vectors that
always run, and ModelOpt 0.47's own quantizers as the oracle (run in its environment as a subprocess;
skipped with the reason when that environment is absent)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtmoe.errors import InputError, UnsupportedError
from trtmoe.quant.formats import (FORMATS, e2m1_codes, e2m1_values, e4m3_round, e8m0_exponents, fp8_groups_fake,
                                  pack_nibbles, unpack_nibbles)

NEW = ("fp8", "fp8_block", "fp8_block_wo", "nvfp4", "nvfp4_w4a16", "mxfp4", "w4a8_awq")
ORACLE = Path(__file__).parent / "reference" / "modelopt_formats_oracle.py"


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# ---- hand-computed vectors ------------------------------------------------------------------------


def test_e2m1_grid_and_ties_to_even():
    x = torch.tensor([0.0, 0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 6.0, 7.0, 100.0, -0.75, -0.1])
    want = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0, -1.0, -0.0]
    assert e2m1_values(e2m1_codes(x)).tolist() == want
    # codes: sign << 3 | index; a negative value rounding to zero keeps its sign bit
    assert e2m1_codes(torch.tensor([6.0, -6.0, -0.1, 0.0])).tolist() == [7, 15, 8, 0]


def test_e2m1_ties_down_as_modelopt_mxfp4_packs():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, -0.0, 0.3])
    assert e2m1_values(e2m1_codes(x, ties="down")).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -0.0, -0.0, 0.5]
    assert e2m1_codes(torch.tensor([0.0]), ties="down").tolist() == [8]  # exact zero with the sign bit


def test_nibble_order_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_nibbles(packed), codes)
    w = torch.tensor([[0.5, 1.0, -6.0, 0.0] * 4], dtype=torch.float32)
    p = FORMATS["nvfp4_w4a16"].quantize(w, dtype=torch.float32)
    assert p["weight"][0, :2].tolist() == [0x21, 0x0F]  # 0.5 -> 1 low, 1.0 -> 2 high; -6 -> 15 low, 0 high


def test_e4m3_saturates_and_rounds_to_even():
    x = torch.tensor([448.0, 464.0, 1e9, -1e9, 1.0625, 1.1875, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10])
    assert e4m3_round(x).tolist() == [448.0, 448.0, 448.0, -448.0, 1.0, 1.25, 2.0 ** -9, 0.0, 2.0 ** -8]


def test_e8m0_exponent_is_the_ceiling():
    amax = torch.tensor([6.0, 6.01, 12.0, 3.0, 0.0, 1e-45, 1.5])
    assert e8m0_exponents(amax).tolist() == [0.0, 1.0, 1.0, -1.0, -127.0, -127.0, -2.0]
    w = torch.zeros(1, 32)
    w[0, 0] = 12.0  # scale 2**1: 12 -> 6
    p = FORMATS["mxfp4"].quantize(w, dtype=torch.float32)
    assert p["weight_scale"].tolist() == [[128]]
    assert FORMATS["mxfp4"].dequantize(p, dtype=torch.float32)[0, 0] == 12.0


def test_fp8_per_tensor_numbers():
    w = torch.tensor([[448.0, -224.0, 1.0, 0.0]] * 2)
    p = FORMATS["fp8"].quantize(w, dtype=torch.float32, input_amax=torch.tensor(896.0))
    assert float(p["weight_scale"]) == 1.0 and float(p["input_scale"]) == 2.0
    assert p["weight"].dtype == torch.float8_e4m3fn and p["weight"].shape == (2, 4)
    x = torch.tensor([[900.0, 3.0, 1.0, 0.0]])  # 900 / 2 saturates at 448; 3 / 2 = 1.5 is exact
    assert FORMATS["fp8"].quantize_input(x, p).tolist() == [[896.0, 3.0, 1.0, 0.0]]
    with pytest.raises(InputError, match="input amax"):
        FORMATS["fp8"].quantize(w, dtype=torch.float32)


def test_nvfp4_scales_and_activation_blocks():
    w = torch.zeros(2, 32)
    w[0, 0], w[0, 1], w[0, 20] = 6.0, 3.0, 1.5
    p = FORMATS["nvfp4"].quantize(w, dtype=torch.float32, input_amax=6.0 * 448.0)
    assert p["weight"].shape == (2, 16) and p["weight"].dtype == torch.uint8
    assert p["weight_scale"].shape == (2, 2) and p["weight_scale"].dtype == torch.float8_e4m3fn
    assert float(p["weight_scale_2"]) == pytest.approx(6.0 / 2688.0)
    # block 0: amax 6 -> scale 448 (fp8) under the global 6/2688; block 1 amax 1.5 -> 112; zero blocks -> 1
    assert p["weight_scale"].float().tolist() == [[448.0, 112.0], [1.0, 1.0]]
    assert torch.equal(FORMATS["nvfp4"].dequantize(p, dtype=torch.float32), w)
    assert float(p["input_scale"]) == 1.0
    x = torch.tensor([[5.0, 1.2] + [0.0] * 30])  # scale 5/6 -> e4m3 0.8125; 5/0.8125 = 6.15 -> 6, 1.2/.8125 -> 1.5
    xq = FORMATS["nvfp4"].quantize_input(x, p)
    assert xq[0, :2].tolist() == [6 * 0.8125, 1.5 * 0.8125]


def test_fp8_groups_per_token():
    x = torch.zeros(2, 130)
    x[0, 0], x[0, 1], x[0, 129] = 448.0, 1.0625, 3.0
    y = fp8_groups_fake(x, 128)
    assert y[0, 0] == 448.0 and y[0, 1] == 1.0 and y[0, 129] == 3.0 and bool((y[1] == 0).all())


def test_fp8_block_partial_blocks_and_shapes():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 300, generator=g)
    p = FORMATS["fp8_block_wo"].quantize(w, dtype=torch.bfloat16)
    assert p["weight_scale"].shape == (2, 3) and p["weight_scale"].dtype == torch.float32
    assert p["weight_scale"][1, 2] == w.bfloat16().float()[128:, 256:].abs().max() / 448
    deq = FORMATS["fp8_block_wo"].dequantize(p, dtype=torch.float32)
    assert (deq - w.bfloat16().float()).abs().max() <= w.abs().max() / 16  # one E4M3 step at most


def test_w4a8_pre_quant_scale_and_fp8_weight_rounding():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(4, 256, generator=g)
    pq = torch.rand(256, generator=g) + 0.5
    fmt = FORMATS["w4a8_awq"]
    p = fmt.quantize(w, dtype=torch.float32, input_amax=torch.full((256,), 2.0), pre_quant_scale=pq)
    assert p["weight"].shape == (2, 256) and p["weight"].dtype == torch.uint8
    assert p["weight_scale"].shape == (4, 2) and p["pre_quant_scale"].shape == (256,)
    assert float(p["input_scale"]) == pytest.approx(float((2.0 * pq).max()) / 448, rel=1e-6)
    x = torch.randn(3, 256, generator=g)
    y = fmt.linear(x, p)
    # The same product from the definition: x * pq to FP8 under input_scale, times the effective weight.
    xq = e4m3_round(x * pq / p["input_scale"]) * p["input_scale"]
    assert torch.allclose(y, xq @ fmt._dequant_f32(p).t(), atol=1e-5)
    assert torch.allclose(fmt.dequantize(p, dtype=torch.float32), fmt._dequant_f32(p) * pq)


@pytest.mark.parametrize("name", NEW)
def test_stacked_experts_match_expert_by_expert(name):
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 256, 256, generator=g) * torch.tensor([0.01, 1.0, 30.0])[:, None, None]
    kw = {"input_amax": 4.0}
    stacked = fmt.quantize(w, dtype=torch.bfloat16, **kw)
    x = torch.randn(3, 5, 256, generator=g).to(torch.bfloat16)
    y = fmt.linear(x, stacked)
    for e in range(3):
        one = fmt.quantize(w[e], dtype=torch.bfloat16, **kw)
        part = fmt.expert(stacked, e)
        for k in one:
            assert torch.equal(_u8(one[k]), _u8(part[k])), (name, k)
        assert torch.equal(fmt.linear(x[e], one), y[e])


@pytest.mark.parametrize("name", NEW)
def test_bytes_and_errors(name):
    fmt = FORMATS[name]
    p = fmt.quantize(torch.randn(256, 512), dtype=torch.float16, input_amax=1.0)
    stored = sum(v.numel() * v.element_size() for v in p.values())
    assert fmt.weight_bytes(256, 512) == stored
    assert fmt.packed_at_conversion and not fmt.engine_path
    assert fmt.label and fmt.short and fmt.color.startswith("#") and fmt.trtllm_quant_algo
    cfg = fmt.modelopt_layer_config()
    assert cfg is None or cfg["quant_algo"] == fmt.modelopt_quant_algo
    bad = torch.randn(256, 512)
    bad[0, 0] = float("nan")
    with pytest.raises(InputError, match="nan"):
        fmt.quantize(bad, dtype=torch.float16, input_amax=1.0)
    if name not in ("fp8", "fp8_block", "fp8_block_wo"):
        with pytest.raises(UnsupportedError, match="multiple"):
            fmt.quantize(torch.randn(4, 24), dtype=torch.float16, input_amax=1.0)


def test_int8_reports_its_modelopt_form():
    fmt = FORMATS["int8"]
    w = torch.randn(8, 32)
    p = fmt.quantize(w, dtype=torch.float16)
    mo = fmt.modelopt_tensors(p, dtype=torch.float16)
    assert fmt.modelopt_quant_algo == "W8A16" and mo["weight"].shape == (8, 32) and mo["weight"].dtype == torch.int8
    assert mo["weight_scale"].dtype == torch.float32 and mo["weight_scale"].shape == (8,)
    assert torch.equal((mo["weight"].float() * mo["weight_scale"][:, None]).half(), fmt.dequantize(p, dtype=torch.float16))
    assert FORMATS["int4"].modelopt_quant_algo is None


# ---- ModelOpt as the oracle ---------------------------------------------------------------------


ORACLE_DTYPES = (torch.bfloat16, torch.float16)


def oracle_inputs(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The weights (float32), and what the oracle reads: them in ``dtype`` with input amaxes and inputs."""
    g = torch.Generator().manual_seed(7)
    mats = {"a": torch.randn(256, 384, generator=g) * 0.05, "b": torch.randn(96, 256, generator=g) * 3,
            "c": torch.randn(130, 200, generator=g)[:, :192] * 0.01}
    mats["a"][5, :32] = 0  # an all-zero block
    t = {}
    for n, w in mats.items():
        t[n] = w.to(dtype).contiguous()
        t[f"{n}.input_amax"] = torch.tensor(float(w.abs().max()) * 40).to(dtype).float()  # as the model dtype holds it
        t[f"{n}.x"] = (torch.randn(7, w.shape[1], generator=g) * float(w.abs().max()) * 10).to(dtype)
    return mats, t


@pytest.fixture(scope="module")
def modelopt_oracle(modelopt_py, tmp_path_factory) -> dict[torch.dtype, dict[str, torch.Tensor]]:
    """ModelOpt's tensors for every dtype in ORACLE_DTYPES, made by one ModelOpt process."""
    d = tmp_path_factory.mktemp("oracle")
    argv = [modelopt_py, str(ORACLE)]
    for i, dtype in enumerate(ORACLE_DTYPES):
        save_file(oracle_inputs(dtype)[1], d / f"in{i}.safetensors")
        argv += [str(d / f"in{i}.safetensors"), str(d / f"out{i}.safetensors")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {dtype: load_file(d / f"out{i}.safetensors") for i, dtype in enumerate(ORACLE_DTYPES)}


@pytest.mark.parametrize("dtype", ORACLE_DTYPES)
def test_packed_tensors_equal_modelopt(modelopt_oracle, dtype):
    mats, t = oracle_inputs(dtype)
    ref = modelopt_oracle[dtype]
    checked = 0
    for n, w in mats.items():
        for fname in ("fp8", "fp8_block_wo", "nvfp4", "mxfp4", "w4a8_awq"):
            fmt = FORMATS[fname]
            if fmt.shape_problem(*w.shape):
                continue
            p = fmt.quantize(t[n], dtype=dtype, input_amax=t[f"{n}.input_amax"])
            for k, v in p.items():
                r = ref.get(f"{n}.{fname}.{k}")
                if r is None:
                    continue
                assert v.dtype == r.dtype and v.shape == r.shape, (n, fname, k, v.shape, r.shape)
                assert torch.equal(_u8(v), _u8(r)), (n, fname, k)
                checked += 1
            deq = ref.get(f"{n}.{fname}.dequantized")
            if deq is not None:
                assert torch.equal(fmt.dequantize(p, dtype=torch.float32), deq), (n, fname)
            xq = ref.get(f"{n}.{fname}.fake_input")
            if xq is not None:
                # ModelOpt's CPU FP8 fake quantizer multiplies by 448 / amax and back by its inverse;
                # trtmoe divides by the stored input_scale and multiplies by it, as a kernel given the
                # checkpoint's scale does: the same E4M3 codes, values within a float32 rounding.
                mine = fmt.quantize_input(t[f"{n}.x"].float(), p)
                if fname == "nvfp4":
                    assert torch.equal(mine, xq), (n, fname)
                else:
                    assert torch.allclose(mine, xq, rtol=1e-6, atol=0), (n, fname)
                    s = p["input_scale"]
                    assert torch.equal(e4m3_round(mine / s), e4m3_round(xq / s)), (n, fname)
                checked += 1
    assert checked >= 30


# ---- a checkpoint in these formats, run by the embedded engine -------------------------------------


@pytest.mark.parametrize("name,gran", [("fp8", "expert"), ("nvfp4", "layer"), ("mxfp4", "expert"),
                                       ("w4a8_awq", "layer"), ("fp8_block", "expert")])
def test_checkpoint_in_format_runs_in_the_engine(tiny_model, tmp_path, name, gran):
    from dataclasses import replace

    from trtmoe.checkpoint.writer import convert
    from trtmoe.hf.reader import HFCheckpoint
    from trtmoe.quant.plan import uniform_plan
    from trtmoe.quant.sensitivity import layer_input_amax
    from trtmoe.runtime.engine import EmbeddedEngine

    model = tiny_model("mixtral", dtype="bfloat16", hidden_size=128, intermediate_size=128)
    convert(model, tmp_path / "fp")
    ref = EmbeddedEngine.from_checkpoint(tmp_path / "fp", device="cpu", pack_experts=False)
    with HFCheckpoint(model) as src:
        m = src.model
    layers = [l for l in range(m.num_layers) if m.moe_layers[l]]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, m.hidden_size, generator=g)
    routed = torch.randint(0, m.num_experts, (64, 2), generator=g)
    amax = {l: layer_input_amax(ref.layers[l].experts, x, routed) for l in layers}
    plan = uniform_plan(m, name, gran)
    if FORMATS[name].needs_input_amax:
        with pytest.raises(InputError, match="amax"):
            convert(model, tmp_path / "no_amax", quant=plan)
    meta = {str(l): {k: float(v.max()) for k, v in a.items()} for l, a in amax.items()}
    convert(model, tmp_path / "q", quant=replace(plan, meta={**plan.meta, "input_amax": meta}))
    eng = EmbeddedEngine.from_checkpoint(tmp_path / "q", device="cpu", pack_experts=False)
    fmt = FORMATS[name]
    for l in layers:
        base, bank = ref.layers[l].experts, eng.layers[l].experts
        for e in (0, m.num_experts - 1):
            w = base.row_major(e)
            fc = fmt.quantize(w["fc"], dtype=ref.dtype, input_amax=amax[l]["fc"].max())
            proj = fmt.quantize(w["proj"], dtype=ref.dtype, input_amax=amax[l]["proj"].max())
            xe = x[:5]
            up, gate = fmt.linear(xe, fc).chunk(2, dim=-1)
            want = fmt.linear(torch.nn.functional.silu(gate) * up, proj)
            assert torch.equal(bank.forward(e, xe), want), (l, e)
    ids = torch.randint(0, m.vocab_size, (2, 16), generator=g)
    a, b = ref.logits(ids).float(), eng.logits(ids).float()
    assert torch.isfinite(b).all() and not torch.equal(a, b)  # the quantized experts are what runs


def test_calibration_measures_input_amax_and_plans_use_it(tiny_model, tmp_path):
    """calibrate records each MoE layer's input amax per matrix kind and measures the fused-MoE formats
    as they run (activation quantization included); convert makes their input scales from it."""
    import json

    from test_quant_pipeline import cli, make_tokenizer
    from trtmoe.data import write_split_text
    from trtmoe.runtime.engine import EmbeddedEngine

    model = tiny_model("mixtral", num_local_experts=4, num_hidden_layers=2, hidden_size=128, intermediate_size=128,
                       seed=5)
    tok = make_tokenizer(tmp_path / "tok")
    text = tmp_path / "calib.txt"
    write_split_text("calib", text, max_bytes=8_000)
    cli("calibrate", model, "--data", text, "--tokenizer", tok, "--samples", 2, "--seq-len", 16,
        "--formats", "fp8,nvfp4,mxfp4,w4a8_awq", "-o", tmp_path / "c")
    cal = json.loads((tmp_path / "c" / "calib.json").read_text())
    assert cal["formats"] == ["fp8", "nvfp4", "mxfp4", "w4a8_awq"]
    for l in cal["moe_layers"]:
        a = cal["input_amax"][str(l)]
        assert len(a["fc"]) == 128 and len(a["proj"]) == 128 and max(a["fc"]) > 0 and max(a["proj"]) > 0
    d = cal["sensitivity"]["delta_kl"]
    assert all(v >= 0 for f in d for row in d[f] for v in row)
    cli("convert", model, "-o", tmp_path / "u", "--policy", "uniform", "--format", "nvfp4", "--calib", tmp_path / "c")
    eng = EmbeddedEngine.from_checkpoint(tmp_path / "u", device="cpu", pack_experts=False)
    bank = eng.layers[cal["moe_layers"][0]].experts
    sh = bank.shards[0][0]
    assert sh.fc_fmt.name == "nvfp4"
    amax = max(cal["input_amax"][str(cal["moe_layers"][0])]["fc"])
    want = float(torch.tensor(amax).to(eng.dtype).float()) / (6 * 448)  # the model-dtype inputs' amax
    assert float(sh.fc["input_scale"]) == pytest.approx(want, rel=1e-6)
    cli("convert", model, "-o", tmp_path / "g", "--calib", tmp_path / "c", "--budget", "6")
    g = EmbeddedEngine.from_checkpoint(tmp_path / "g", device="cpu")
    assert torch.isfinite(g.logits(torch.tensor([[1, 5, 9, 12]]))).all()
