"""``trtmoe inspect`` before the download: a directory with config.json alone is planned as fully as
one with the weights (parameters, active parameters, bytes per rank in a format, the support cell)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from trtmoe.cli import main
from trtmoe.hf.reader import HFCheckpoint
from trtmoe.quant.plan import uniform_plan
from trtmoe.report.inspect import inspect_model
from trtmoe.targets import target_for


def convert(model, out, *, target: str = "embedded", **options):
    """The deployment target's checkpoint writer (the embedded engine's unless named)."""
    return target_for(target).write(model, out, **options)


def config_only(src: Path, dst: Path) -> Path:
    dst.mkdir()
    shutil.copyfile(src / "config.json", dst / "config.json")
    return dst


def run(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stdout if "--json" in args else " ".join(r.output.split())


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v1", "phimoe"])
def test_config_alone_gives_the_same_plan_as_the_weights(tiny_model, tmp_path, arch):
    src = tiny_model(arch)
    bare = config_only(src, tmp_path / "bare")
    full = inspect_model(str(src), tp=2, moe_ep=2, moe_tp=1)
    cfg = inspect_model(str(bare), tp=2, moe_ep=2, moe_tp=1)
    assert full["weights_present"] and not cfg["weights_present"] and cfg["source_bytes"] is None
    for key in ("parameters", "config", "moe_layers", "dense_layers", "ranks", "layout", "dtype"):
        assert cfg[key] == full[key], key
    code, out = run("inspect", bare, "--tp", 2, "--moe-ep", 2)
    assert code == 0 and "config.json only" in out


def test_format_bytes_are_what_convert_writes(tiny_model, tmp_path):
    # Wide enough for 128-groups; trtmoe packs group formats at conversion, so the rank file holds them.
    src = tiny_model("mixtral", hidden_size=128, intermediate_size=256)
    bare = config_only(src, tmp_path / "bare")
    with HFCheckpoint(src) as s:
        m = s.model
    for fmt in ("int4_g128", "int4_g64"):
        rep = inspect_model(str(bare), tp=2, moe_ep=2, moe_tp=1, dtype="float16", fmt=fmt)
        ck = convert(src, tmp_path / fmt, tp=2, moe_ep=2, moe_tp=1, dtype="float16", quant=uniform_plan(m, fmt),
                     target="tensorrt-llm").out_dir
        for r in rep["ranks"]:
            with safe_open(str(ck / f"rank{r['rank']}.safetensors"), "pt") as f:
                tensors = [f.get_tensor(n) for n in f.keys() if re.search(r"\.mlp\.(fc|proj)\.", n)]
            written = sum(t.numel() * t.element_size() for t in tensors)
            assert r["bytes_by_role"]["experts"] == written, (fmt, r["rank"])


def test_support_cell_from_config_alone(tiny_model, tmp_path):
    bare = config_only(tiny_model("qwen2_moe", hidden_size=128, moe_intermediate_size=256, mlp_only_layers=[]),
                       tmp_path / "bare")
    rep = inspect_model(str(bare), fmt="int4_g128", target="tensorrt-llm")
    assert rep["support"]["ok"] is False and "SharedMoE" in rep["support"]["refusals"][0]
    rep = inspect_model(str(bare), fmt="int4", target="tensorrt-llm")
    assert rep["support"]["ok"] is True and "no MIXED_PRECISION" in rep["support"]["what_works"]
    # The report is printed, and the exit status (3) says it does not build, so a script can gate on it.
    code, out = run("inspect", bare, "--format", "int4_g128", "--target", "tensorrt-llm", "--json")
    assert code == 3 and json.loads(out)["support"]["ok"] is False
    code, out = run("inspect", bare, "--format", "int4_g128", "--target", "tensorrt-llm")
    assert code == 3 and "does not build" in out
    code, _ = run("inspect", bare, "--format", "int4", "--target", "tensorrt-llm")
    assert code == 0


def test_format_that_does_not_fit_the_shapes_is_a_layout_problem(tiny_model, tmp_path):
    bare = config_only(tiny_model("mixtral"), tmp_path / "bare")  # H=64, expert FFN 48
    code, out = run("inspect", bare, "--format", "int4_g128")
    assert code == 2 and "int4_g128" in out and "group size 128" in out


def test_dense_layer_rules_are_the_support_tables(tiny_model, tmp_path):
    # The Qwen2-MoE fixture has a dense layer (mlp_only_layers = [2]), which TensorRT-LLM's QWen model
    # cannot load; Mixtral has none.
    notes = inspect_model(str(config_only(tiny_model("qwen2_moe"), tmp_path / "q")))["notes"]
    assert len(notes) == 1 and "dense layers [2]" in notes[0] and "embedded engine" in notes[0]
    assert inspect_model(str(config_only(tiny_model("mixtral"), tmp_path / "m")))["notes"] == []


# ---- real models' shapes, from their config.json alone ------------------------------------------------

MODEL_CONFIGS = Path(__file__).parent / "fixtures" / "model_configs"

# Figures the model cards and release notes publish, in billions, at the precision they give:
# (total, activated) where activated is all but the routed experts a token does not pick.
PUBLISHED = {
    "Mixtral-8x7B-v0.1": ("46.7", "12.9"),
    "Mixtral-8x22B-v0.1": ("141", "39"),
    "Qwen1.5-MoE-A2.7B": ("14.3", "2.7"),
    "Qwen2-57B-A14B": ("57", "14"),
    "Qwen3-30B-A3B": ("30.5", "3.3"),
    "Qwen3-235B-A22B": ("235", "22"),
    "deepseek-moe-16b-base": ("16.4", "2.8"),
    "Phi-3.5-MoE-instruct": ("41.9", "6.6"),
    # Outside the registry: counted from transformers' model built from the config (report/inspect_hf.py).
    "DeepSeek-V3": ("671", "37"),
    "OLMoE-1B-7B-0924": ("6.9", "1.3"),
}


def _matches(n: int, published: str) -> bool:
    """Within one unit of the published figure's last digit (cards round, Qwen3's truncate: 3.35 -> 3.3)."""
    digits = len(published.split(".")[1]) if "." in published else 0
    return abs(n / 1e9 - float(published)) < 10 ** -digits


def test_every_model_config_has_a_published_figure():
    assert sorted(p.stem for p in MODEL_CONFIGS.glob("*.json")) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_model_counts_match_the_published_figures(name, tmp_path):
    bare = tmp_path / name
    bare.mkdir()
    shutil.copyfile(MODEL_CONFIGS / f"{name}.json", bare / "config.json")
    rep = inspect_model(str(bare))
    assert not rep["weights_present"]
    p, c = rep["parameters"], rep["config"]
    total, activated = PUBLISHED[name]
    assert _matches(p["total"], total), (p["total"], total)
    assert _matches(p["activated"], activated), (p["activated"], activated)
    # What a token's forward multiplies with reads one embedding row, not the table.
    assert p["activated"] - p["active_per_token"] == (c["vocab_size"] - 1) * c["hidden_size"]
    if name.startswith("deepseek"):  # first_k_dense_replace = 1
        assert rep["dense_layers"] == [0] and len(rep["moe_layers"]) == 27


def _hf_counts(model_dir: Path) -> tuple[int, int]:
    """(total, activated) from transformers' own module: named_parameters(), and the routed experts'
    share a token skips taken from the parameters under ``.experts.``."""
    from transformers import AutoModelForCausalLM

    cfg = json.loads((model_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    params = dict(model.named_parameters())
    total = sum(t.numel() for t in params.values())
    routed = sum(t.numel() for n, t in params.items() if ".experts." in n)
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    return total, total - routed * (E - cfg["num_experts_per_tok"]) // E


@pytest.mark.parametrize("arch,kw", [
    ("phimoe", {}),  # LayerNorm biases, attention and lm_head biases
    ("phimoe", dict(attention_bias=False, lm_head_bias=False, tied=True)),
    ("qwen2_moe", dict(tied=True, qkv_bias=False)),
    ("qwen3_moe", dict(head_dim=32, mlp_only_layers=[1])),
    ("mixtral", dict(head_dim=8, num_key_value_heads=1)),
], ids=["phimoe", "phimoe-no-biases-tied", "qwen2-tied-no-bias", "qwen3-head_dim-dense", "mixtral-head_dim-gqa"])
def test_counts_equal_transformers_module(tiny_model, tmp_path, arch, kw):
    bare = config_only(tiny_model(arch, **kw), tmp_path / "bare")
    p = inspect_model(str(bare))["parameters"]
    assert (p["total"], p["activated"]) == _hf_counts(tiny_model(arch, **kw))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_transformers_count_agrees_with_the_registry(tiny_model, tmp_path, arch):
    """The count of a MoE outside the registry (transformers' meta model, experts found at the seam) gives
    the registry's figures on the architectures both can count."""
    from trtmoe.report.inspect_hf import describe_transformers_moe

    bare = config_only(tiny_model(arch), tmp_path / "bare")
    want, got = inspect_model(str(bare)), describe_transformers_moe(bare)
    for key in ("total", "active_per_token", "activated"):
        assert got["parameters"][key] == want["parameters"][key], key
    assert got["moe_layers"] == want["moe_layers"]
    for key in ("num_experts", "top_k", "hidden_size", "expert_intermediate_size", "vocab_size"):
        assert got["config"][key] == want["config"][key], key


@pytest.mark.parametrize("arch", ["deepseek_v2", "glm4_moe", "llama4_text", "gpt_oss"])
def test_inspect_outside_the_registry(tiny_model, tmp_path, arch):
    src = tiny_model(arch)
    code, out = run("inspect", src, "--json")
    assert code == 0, out
    rep = json.loads(out)
    p, c = rep["parameters"], rep["config"]
    assert sum(d["total"] for d in p["components"].values()) == p["total"]
    assert p["components"]["routed experts"]["active_per_token"] * c["num_experts"] == \
        p["components"]["routed experts"]["total"] * c["top_k"]
    assert rep["moe_layers"] and rep["weights_present"] and "registry" in rep["notes"][0]
    # A parallel layout needs the registry's rules: one line, exit 2, no traceback.
    code, out = run("inspect", src, "--moe-ep", "2")
    assert code == 2 and "unified-HF" in out and "Traceback" not in out


def test_inspect_outside_the_registry_says_what_convert_refuses(tiny_model, tmp_path):
    """A transformers MoE outside the registry whose experts are stored fused (Granite-MoE's input_linear /
    output_linear): inspect counts it and says when it is exported; convert refuses it in one line naming the
    architecture and the per-expert names it reads, for every unified-HF target."""
    src = tiny_model("granitemoe")
    code, out = run("inspect", src, "--json")
    assert code == 0, out
    rep = json.loads(out)
    assert rep["family"] == "granitemoe" and rep["moe_layers"] == [0, 1, 2]
    assert "calibrate --runner stream" in rep["notes"][0] and "one linear per expert" in rep["notes"][0]
    code, out = run("inspect", src, "--moe-ep", "2")
    assert code == 2 and "not for GraniteMoeForCausalLM" in out and "Traceback" not in out
    for target in ("vllm", "trtllm-pytorch", "sglang"):
        code, out = run("convert", src, "-o", tmp_path / target, "--target", target, "--layer-format", "*=fp8")
        assert code == 2 and "Traceback" not in out, out
        assert ("the unified-HF export does not read GraniteMoeForCausalLM (model_type 'granitemoe'): its routed "
                "experts are not stored one linear per expert") in out, out
        assert "calibrate --runner stream" in out
        assert not (tmp_path / target).exists()


def test_inspect_outside_the_registry_refuses_what_it_cannot_build(tiny_model, tmp_path):
    """The count builds transformers' model on the meta device: an absurd depth is refused at once, a bad
    value by the config check, both in one line."""
    src = json.loads((tiny_model("glm4_moe") / "config.json").read_text())
    for key, value, said in (("num_hidden_layers", 100_000, "at most 512"),
                             ("num_experts_per_tok", 0, "num_experts_per_tok must be at least 1")):
        bare = tmp_path / key
        bare.mkdir()
        (bare / "config.json").write_text(json.dumps({**src, key: value}))
        code, out = run("inspect", bare)
        assert code == 2 and said in out and "Traceback" not in out, out
