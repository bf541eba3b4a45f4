"""The TensorRT-LLM support table against TensorRT-LLM's own declaration rules.

The rules below are restated here from TensorRT-LLM 1.2's source, independently of trtmoe's
writer (``trtmoe/checkpoint/layout.py``) and of the table itself:

* ``MOEWeightWrapper`` (layers/moe.py) declares, per stacked MoE matrix with ``in_features`` ×
  ``out_features`` and ``E`` local experts: unquantized, ``weight [E, out, in]`` in the model dtype;
  group-wise W4A16_AWQ, ``weight [E, in, out // 4]`` (int4 packed four per 16-bit element, model
  dtype), ``weights_scaling_factor [E, in // group, out]``, ``prequant_scaling_factor [1, in]`` and,
  only with a zero point, ``zero``.
* ``preprocess_weights`` / ``preprocess_perlayer_weights`` (models/modeling_utils.py) turn the
  checkpoint's tensors into those: for W4A16_AWQ an int8 ``weight`` is transposed on its last two
  axes and re-laid-out for the mixed GEMM (same bytes, viewed in the model dtype), so the checkpoint
  holds ``int8 [E, out // 2, in]``; ``weights_scaling_factor`` is transposed, so the checkpoint holds
  ``[E, out, in // group]``; a 2-D ``prequant_scaling_factor`` keeps its first row and any becomes
  ``[1, in]``. For per-channel weight-only (W8A16 / W4A16) it quantizes float weights itself
  (``weight_only_quantize_dict``), so the checkpoint holds the float ``weight [E, out, in]``.
* ``fc`` is the fused ``[up; gate]`` matrix (in = hidden, out = 2 × FFN per rank); ``proj`` has in =
  FFN per rank, out = hidden.
* A MIXED_PRECISION checkpoint is resolved per module through ``quant_cfg.json``'s
  ``quantized_layers``; ``to_layer_quant_config`` synthesises the MoE module's entry
  (``…mlp``) from its ``…mlp.fc`` / ``…mlp.proj`` entries only for ``MixtralForCausalLM`` (and they
  must agree). A module without an entry keeps the mode the model was created with: the union of
  every layer's mode, which declares quantized parameters.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from trtmoe.checkpoint import support
from trtmoe.errors import UnsupportedError
from trtmoe.hf.reader import HFCheckpoint
from trtmoe.quant.plan import QuantPlan
from trtmoe.targets import target_for


def convert(model, out, *, target: str = "embedded", **options):
    """The deployment target's checkpoint writer (the embedded engine's unless named)."""
    return target_for(target).write(model, out, **options)


ROOT = Path(__file__).resolve().parents[1]
# Expert FFN size key per architecture (Mixtral and Phi-3.5-MoE name it intermediate_size).
FFN_KEY = {"mixtral": "intermediate_size", "phimoe": "intermediate_size", "qwen2_moe": "moe_intermediate_size",
           "qwen3_moe": "moe_intermediate_size", "deepseek_v1": "moe_intermediate_size"}
GROUP = {"int4_g128": 128, "int4_g64": 64}
DT = "F16"


def wide_model(tiny_model, fam: str) -> Path:
    """A tiny model wide enough for every group size (hidden 128, expert FFN 256), all layers MoE
    where the architecture's TensorRT-LLM class needs that."""
    over = {"hidden_size": 128, FFN_KEY[fam]: 256}
    if fam == "qwen2_moe":
        over["mlp_only_layers"] = []
    return tiny_model(fam, **over)


def declared(algo: str | None, group: int | None, E: int, in_f: int, out_f: int) -> dict[str, tuple]:
    """What the checkpoint must hold for one stacked MoE matrix so that TensorRT-LLM's preprocessing
    yields the parameters its MoE weight wrapper declares (prequant: any first dimension)."""
    if algo in (None, "W8A16", "W4A16"):
        return {"weight": ((E, out_f, in_f), DT)}
    assert algo == "W4A16_AWQ", algo
    return {"weight": ((E, out_f // 2, in_f), "I8"), "weights_scaling_factor": ((E, out_f, in_f // group), DT),
            "prequant_scaling_factor": ((None, in_f), DT)}


def after_preprocess(shape: tuple[int, ...], name: str) -> tuple:
    return (None, shape[-1]) if name == "prequant_scaling_factor" and len(shape) in (1, 2) else shape


def layer_modes(cfg: dict, quant_cfg: dict | None, layers: list[int]) -> dict[int, tuple[str | None, int | None]]:
    """(quant algo, group size) of each MoE layer as TensorRT-LLM resolves it; fails where it would
    leave a layer in the union mode."""
    q = cfg.get("quantization") or {}
    if q.get("quant_algo") != "MIXED_PRECISION":
        out = {}
        for l in layers:
            name = f"transformer.layers.{l}.mlp"
            excluded = any(fnmatch.fnmatch(name + ".fc", p) or fnmatch.fnmatch(name, p)
                           for p in q.get("exclude_modules") or [])
            out[l] = (None, None) if excluded or not q.get("quant_algo") else (q["quant_algo"], q.get("group_size"))
        return out
    assert cfg["architecture"] == "MixtralForCausalLM", "MoE entries are synthesised for Mixtral only"
    ql = quant_cfg["quantized_layers"]
    out = {}
    for l in layers:
        fc, proj = ql.get(f"transformer.layers.{l}.mlp.fc"), ql.get(f"transformer.layers.{l}.mlp.proj")
        assert fc is not None and fc == proj, f"layer {l}: no entry, or fc and proj differ"
        assert fc.get("quant_algo"), f"layer {l}: a null entry leaves the union mode"
        out[l] = (fc["quant_algo"], fc.get("group_size"))
    return out


def check_against_rules(ck: Path, m, *, moe_tp: int = 1, moe_ep: int = 1) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    qc = json.loads((ck / "quant_cfg.json").read_text()) if (ck / "quant_cfg.json").exists() else None
    layers = [l for l in range(m.num_layers) if m.moe_layers[l]]
    modes = layer_modes(cfg, qc, layers)
    E, H, I = m.num_experts // moe_ep, m.hidden_size, m.expert_intermediate_size // moe_tp
    pat = re.compile(r"transformer\.layers\.(\d+)\.mlp\.(fc|proj)\.(\w+)$")
    with safe_open(str(ck / "rank0.safetensors"), "pt") as f:
        got: dict[tuple[int, str], dict] = {}
        for name in f.keys():
            mm = pat.match(name)
            if mm:
                sl = f.get_slice(name)
                got.setdefault((int(mm.group(1)), mm.group(2)), {})[mm.group(3)] = (
                    after_preprocess(tuple(sl.get_shape()), mm.group(3)), sl.get_dtype())
    for l in layers:
        algo, group = modes[l]
        for mod, (i, o) in (("fc", (H, 2 * I)), ("proj", (I, H))):
            assert got[(l, mod)] == declared(algo, group, E, i, o), (l, mod, algo)


def _plan(m, fmts_by_layer: dict[int, str]) -> QuantPlan:
    # The formats with a static input scale take it from the calibration's input amax (any value here).
    amax = {str(l): {"fc": 4.0, "proj": 4.0} for l in fmts_by_layer}
    return QuantPlan({l: [f] * m.num_experts for l, f in fmts_by_layer.items()}, granularity="layer",
                     meta={"policy": "test", "input_amax": amax})


CELLS = [(fam, fmt, layout) for fam in support.FAMILIES for fmt in support.FORMATS for layout in support.LAYOUTS]


@pytest.mark.parametrize("fam,fmt,layout", CELLS, ids=["-".join(c) for c in CELLS])
def test_every_cell_convert_accepts_matches_tensorrt_llm_declarations(tiny_model, tmp_path, fam, fmt, layout):
    src = wide_model(tiny_model, fam)
    with HFCheckpoint(src) as s:
        m = s.model
    layers = [l for l in range(m.num_layers) if m.moe_layers[l]]
    if layout == "uniform":
        fm = {l: fmt for l in layers}
    else:  # this format in the first MoE layer, another accepted one elsewhere
        other = "int8" if fmt != "int8" else "int4"
        fm = {l: (fmt if k == 0 else other) for k, l in enumerate(layers)}
    plan = None if set(fm.values()) == {"float"} else _plan(m, fm)
    cell = support.quant_cell("1.2", fam, fmt, layout)
    other_cell = support.quant_cell("1.2", fam, "int8" if fmt != "int8" else "int4", layout) \
        if layout == "mixed" else cell
    args = dict(dtype="float16", quant=plan, target="tensorrt-llm")
    if not (cell.ok and other_cell.ok):
        with pytest.raises(UnsupportedError) as ei:
            convert(src, tmp_path / "ck", **args)
        msg = str(ei.value)
        assert support.ARCH_LABEL[fam] in msg and "TensorRT-LLM 1.2" in msg and "what builds" in msg
        assert not (tmp_path / "ck").exists()
        # The embedded engine runs every cell.
        convert(src, tmp_path / "emb", **{**args, "target": "embedded"})
        return
    res = convert(src, tmp_path / "ck", **args)
    check_against_rules(res.out_dir, m)
    unlisted = cell.status == support.UNLISTED or other_cell.status == support.UNLISTED
    assert bool(res.cautions) == unlisted, res.cautions


@pytest.mark.parametrize("fam", support.FAMILIES)
def test_expert_parallel_slices_match_declarations(tiny_model, tmp_path, fam):
    src = wide_model(tiny_model, fam)
    with HFCheckpoint(src) as s:
        m = s.model
    fmt = "int4_g128" if support.quant_cell("1.2", fam, "int4_g128", "uniform").ok else "int8"
    plan = _plan(m, {l: fmt for l in range(m.num_layers) if m.moe_layers[l]})
    res = convert(src, tmp_path / "ck", tp=2, moe_ep=2, moe_tp=1, dtype="float16", quant=plan, target="tensorrt-llm")
    check_against_rules(res.out_dir, m, moe_ep=2)
    ep = support.mapping_cell("1.2", fam, "moe_ep")
    assert any("moe_ep=2" in c for c in res.cautions) == (ep.status == support.UNLISTED)


def test_per_expert_plans_are_refused_for_tensorrt_llm(tiny_model, tmp_path):
    src = wide_model(tiny_model, "mixtral")
    with HFCheckpoint(src) as s:
        m = s.model
    fs = ["int8", "int4"] * (m.num_experts // 2)
    plan = QuantPlan({l: list(fs) for l in range(m.num_layers)}, granularity="expert")
    with pytest.raises(UnsupportedError, match="quantized per expert"):
        convert(src, tmp_path / "ck", dtype="float16", quant=plan, target="tensorrt-llm")
    assert not (tmp_path / "ck").exists()


# Top-level keys each model class reads as a plain attribute with no default (restated from TensorRT-LLM
# 1.2: Phi3DecoderLayer's ``config.rotary_pct``; QWenConfig's required qwen_type / seq_length /
# moe_intermediate_size / moe_shared_expert_intermediate_size; DeepseekDecoderLayer's
# moe_intermediate_size and DeepSeekV1Config's moe block). PretrainedConfig sets none of them.
READ_WITHOUT_DEFAULT = {
    "phimoe": {"rotary_pct"},
    "qwen2_moe": {"qwen_type", "seq_length", "moe_intermediate_size", "moe_shared_expert_intermediate_size"},
    "qwen3_moe": {"qwen_type", "seq_length", "moe_intermediate_size", "moe_shared_expert_intermediate_size"},
    "deepseek_v1": {"moe", "moe_intermediate_size"},
    "mixtral": set(),
}


@pytest.mark.parametrize("fam", support.FAMILIES)
def test_config_carries_every_key_the_model_class_reads_without_default(tiny_model, tmp_path, fam):
    res = convert(tiny_model(fam), tmp_path / "ck")
    cfg = json.loads((res.out_dir / "config.json").read_text())
    missing = {k for k in READ_WITHOUT_DEFAULT[fam] if cfg.get(k) is None}
    assert not missing, missing
    if fam == "phimoe":
        assert cfg["rotary_pct"] == 1.0  # whole heads rotate (partial rotary is refused at convert)


def test_verify_names_a_key_the_model_class_needs(tiny_model, tmp_path):
    from trtmoe.checkpoint.schema import check_strict_blocks

    cfg = json.loads((convert(tiny_model("phimoe"), tmp_path / "ck").out_dir / "config.json").read_text())
    assert check_strict_blocks(cfg, "1.2") == []
    del cfg["rotary_pct"]
    problems = check_strict_blocks(cfg, "1.2")
    assert len(problems) == 1 and "rotary_pct" in problems[0] and "PhiMoEForCausalLM" in problems[0]


def test_deepseek_without_shared_experts_is_refused_for_tensorrt_llm(tiny_model, tmp_path):
    # DeepseekDecoderLayer builds a MoE layer without shared experts from a name its module never imports.
    src = tiny_model("deepseek_v1", n_shared_experts=None)
    with pytest.raises(UnsupportedError, match="without shared experts") as err:
        convert(src, tmp_path / "ck", target="tensorrt-llm")
    assert "\n" not in str(err.value) and "--target embedded" in str(err.value)
    assert not (tmp_path / "ck").exists()
    convert(src, tmp_path / "ck-embedded", target="embedded")  # the embedded engine runs it
    convert(tiny_model("deepseek_v1"), tmp_path / "ck-shared", target="tensorrt-llm")
    assert support.check("1.2", "deepseek_v1", layer_formats=None, shared_expert_size=0).refusals
    assert not support.check("1.2", "deepseek_v1", layer_formats=None, shared_expert_size=64).refusals


def test_options_follow_the_cells():
    for fam in support.FAMILIES:
        o = support.options("1.2", fam)
        assert o.uniform == tuple(f for f in support.FORMATS if support.quant_cell("1.2", fam, f, "uniform").ok)
        assert o.has_mixed == (fam == "mixtral")
        assert "float" not in o.mixed  # a float MoE layer in MIXED_PRECISION gets no entry
    assert "no MIXED_PRECISION" in support.what_works("1.2", "qwen2_moe")
    assert "W4A16_AWQ" not in support.what_works("1.2", "qwen2_moe")
    with pytest.raises(UnsupportedError):
        support.options("0.9", "mixtral")


def _between(path, begin, end):
    text = (ROOT / path).read_text()
    assert begin in text and end in text, f"{path} lacks the generated support table markers"
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def test_readme_table_is_the_generated_one():
    body = _between("README.md", "<!-- support-table:begin -->", "<!-- support-table:end -->")
    assert body == support.markdown_table("1.2").strip(), \
        "README support table is stale: regenerate with `python -m trtmoe.checkpoint.support --table`"


def test_docs_support_section_is_the_generated_one():
    body = _between("docs/checkpoint-formats.md", "<!-- support-section:begin -->", "<!-- support-section:end -->")
    assert body == support.readme_section("1.2").strip(), \
        "docs/checkpoint-formats.md support section is stale: regenerate with `python -m trtmoe.checkpoint.support`"


# ---- the TensorRT-LLM plan: candidates from the table, budget spent or its remainder explained ----
def _calib(rng, layers=4, experts=4, I=256, H=128):
    """A calib.json-shaped dict with random per-matrix ΔKL for every int format."""
    import numpy as np

    from trtmoe.quant.calibrate import CALIB_VERSION

    scale = {"int8": 2e-5, "int4": 1.5e-3, "int4_g128": 1e-3, "int4_g64": 8e-4}
    mats = {}
    for m in ("fc", "proj"):
        s = rng.lognormal(0, 1.0, size=(layers, experts))
        mats[m] = {"delta_kl": {f: (s * k * rng.lognormal(0, 0.2, size=s.shape)).tolist() for f, k in scale.items()}}
    expert = {f: (np.array(mats["fc"]["delta_kl"][f]) + np.array(mats["proj"]["delta_kl"][f])).tolist() for f in scale}
    share = rng.dirichlet(np.ones(experts), size=layers)
    return {"version": CALIB_VERSION, "num_layers": layers, "num_experts": experts, "top_k": 2,
            "moe_layers": list(range(layers)), "expert_intermediate_size": I, "hidden_size": H,
            "formats": list(scale), "bits_per_weight": {"int8": 8.125, "int4": 4.125, "int4_g128": 4.25,
                                                        "int4_g64": 4.375},
            "routing": {"share": share.tolist(), "tokens": 1000, "counts": np.round(share * 2000).astype(int).tolist()},
            "sensitivity": {"delta_kl": expert, "matrices": mats}}


def _best_target_plan(units, uniform, mixed, budget_bits):
    """Brute force over every plan the target builds: one format everywhere, or a mix from ``mixed``."""
    import itertools

    best = None
    combos = [tuple([f] * len(units)) for f in uniform]
    combos += list(itertools.product(*[[f for f in sorted(u.costs_bits) if f in mixed] for u in units]))
    for combo in combos:
        if not all(f in u.costs_bits for u, f in zip(units, combo)):
            continue
        cost = sum(u.costs_bits[f] for u, f in zip(units, combo))
        if cost <= budget_bits:
            val = sum(u.delta_kl[f] for u, f in zip(units, combo))
            best = val if best is None or val < best else best
    return best


@pytest.mark.parametrize("fam", ["mixtral", "qwen2_moe"])
def test_target_plan_is_the_best_plan_the_cell_builds(fam):
    import numpy as np
    import torch

    from trtmoe.quant.policies import build_units, make_target_plan

    o = support.options("1.2", fam)
    rng = np.random.default_rng(7)
    for _ in range(3):
        cal = _calib(rng)
        all_units = build_units(cal, "layer", torch.bfloat16)
        n = sum(u.n_weights for u in all_units)
        for budget in (4.3, 4.5, 5.0, 6.5, 9.0, 17.0):
            plan = make_target_plan(cal, "graded", budget_bpw=budget, uniform=o.uniform, mixed=o.mixed,
                                    dtype=torch.bfloat16, target=f"{fam} on TensorRT-LLM 1.2")
            used = plan.used_formats()
            assert len(used) == 1 or (o.has_mixed and used <= set(o.mixed)), used
            bits = sum(u.costs_bits[plan.formats[u.key[0]][0]] for u in all_units)
            assert bits <= budget * n and plan.meta["avg_bpw"] == pytest.approx(bits / n)
            ref = _best_target_plan(all_units, o.uniform, o.mixed, budget * n)
            assert plan.meta["predicted_delta_kl"] == pytest.approx(ref, rel=1e-12, abs=1e-15)
            left = budget - bits / n
            assert (left > 0.02) == any("unspent" in x for x in plan.meta["notes"])
            if not o.has_mixed:
                assert any("no MIXED_PRECISION" in x for x in plan.meta["notes"])


def test_target_plan_below_the_cheapest_buildable_plan_is_one_line():
    import numpy as np
    import torch

    from trtmoe.errors import InputError
    from trtmoe.quant.policies import make_target_plan

    o = support.options("1.2", "qwen2_moe")
    with pytest.raises(InputError, match="below the cheapest plan"):
        make_target_plan(_calib(np.random.default_rng(1)), "graded", budget_bpw=3.0, uniform=o.uniform,
                         mixed=o.mixed, dtype=torch.bfloat16)


@pytest.mark.parametrize("budget", [4.5, 5.0])
def test_target_plan_spends_the_budget_at_real_depth(budget):
    """With one format per MoE layer a 4-layer model cannot land near 4.5 bpw (one int8 layer adds
    about 1 bpw); at Mixtral-8x7B's 32 layers each int8 layer adds an eighth as much, and the exact
    plan spends the budget to within 0.05 bpw, mixing int8 and int4 layers."""
    import numpy as np
    import torch

    from trtmoe.quant.policies import make_target_plan

    o = support.options("1.2", "mixtral")
    for layers, spends in ((4, False), (32, True)):
        plan = make_target_plan(_calib(np.random.default_rng(7), layers=layers, experts=8), "graded",
                                budget_bpw=budget, uniform=o.uniform, mixed=o.mixed, dtype=torch.bfloat16,
                                target="mixtral on TensorRT-LLM 1.2")
        left = budget - plan.meta["avg_bpw"]
        assert 0 <= left and (left <= 0.05) == spends, (layers, plan.meta["avg_bpw"])
        assert ("int8" in plan.used_formats()) == spends
