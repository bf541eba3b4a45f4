"""Tiny checkpoint fixtures are valid HF checkpoints; the DeepSeek-MoE v1 reference is right.

The reference is cross-checked against transformers twice, through exact re-parametrisations:
* DeepSeek-v1 with norm_topk_prob=true, no shared experts and no dense layer *is* a Mixtral;
* DeepSeek-v1 as fixtured (dense layer 0, 2 shared experts, no renormalisation) is a Qwen2-MoE
  whose dense layer is layer 0, whose shared-expert gate is 0 (sigmoid -> 1/2) with the shared
  down_proj doubled, and whose q/k/v biases are 0.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.conftest import make_tiny_models
from tests.reference.deepseek_v1 import DeepseekV1Reference, deepseek_v1_logits, load_hf_tensors

torch.set_num_threads(1)

# Phi-3.5-MoE's fixture is proven by its parity tests (tests/test_parity.py); the per-name shape
# table below does not spell out its LayerNorm and bias tensors yet.
ARCHS = tuple(a for a in make_tiny_models.ARCHITECTURES if a != "phimoe")
HF_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
VARIANTS = {
    "default": {},
    "tied": {"tied": True},
    "bf16": {"dtype": "bfloat16"},
    "sharded": {"sharded": True},
}
INPUT_IDS = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1234))


def stored_tensors(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype string) across every safetensors file in ``model_dir``."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                assert name not in out, f"{name} stored twice"
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def config_of(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def moe_layers(arch: str, cfg: dict) -> list[int]:
    """Which layers carry routed experts, by each architecture's documented rule."""
    n = cfg["num_hidden_layers"]
    if arch == "mixtral":
        return list(range(n))
    if arch in ("qwen2_moe", "qwen3_moe"):
        return [l for l in range(n) if l not in cfg["mlp_only_layers"]
                and (l + 1) % cfg["decoder_sparse_step"] == 0]
    return [l for l in range(n)
            if l >= cfg["first_k_dense_replace"] and l % cfg["moe_layer_freq"] == 0]


def expected_shapes(arch: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """Hub tensor names -> shapes, spelled out per architecture from the HF modeling code."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    n_exp = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts",
             "qwen3_moe": "num_local_experts", "deepseek_v1": "n_routed_experts"}[arch]
    E = cfg[n_exp]
    I = cfg["intermediate_size"] if arch == "mixtral" else cfg["moe_intermediate_size"]
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)

    def swiglu(prefix, inter, names=("gate_proj", "up_proj", "down_proj")):
        shapes[f"{prefix}.{names[0]}.weight"] = (inter, H)
        shapes[f"{prefix}.{names[1]}.weight"] = (inter, H)
        shapes[f"{prefix}.{names[2]}.weight"] = (H, inter)

    sparse = moe_layers(arch, cfg)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}"
        shapes[f"{p}.input_layernorm.weight"] = (H,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (H,)
        for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}.self_attn.{proj}.weight"] = (out, H)
            if arch == "qwen2_moe":
                shapes[f"{p}.self_attn.{proj}.bias"] = (out,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (H, q)
        if arch == "qwen3_moe":
            shapes[f"{p}.self_attn.q_norm.weight"] = (hd,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (hd,)
        if l not in sparse:
            swiglu(f"{p}.mlp", cfg["intermediate_size"])
            continue
        if arch == "mixtral":
            shapes[f"{p}.block_sparse_moe.gate.weight"] = (E, H)
            for e in range(E):  # w1 = gate, w3 = up, w2 = down
                swiglu(f"{p}.block_sparse_moe.experts.{e}", I, ("w1", "w3", "w2"))
            continue
        shapes[f"{p}.mlp.gate.weight"] = (E, H)
        for e in range(E):
            swiglu(f"{p}.mlp.experts.{e}", I)
        if arch == "qwen2_moe":
            swiglu(f"{p}.mlp.shared_expert", cfg["shared_expert_intermediate_size"])
            shapes[f"{p}.mlp.shared_expert_gate.weight"] = (1, H)
        if arch == "deepseek_v1":
            swiglu(f"{p}.mlp.shared_experts", I * cfg["n_shared_experts"])
    return shapes


def routed_experts(arch: str, model_dir: Path, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """layer -> [tokens, top_k] expert ids the model picks for ``input_ids``."""
    if arch == "deepseek_v1":
        ref = DeepseekV1Reference(model_dir)
        ref.logits(input_ids)
        return ref.routed_experts
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    picks: dict[int, torch.Tensor] = {}
    for l, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(layer.mlp, "experts"):
            # transformers' routers return (router_logits, top_k_weights, top_k_index)
            gate.register_forward_hook(lambda _m, _i, out, l=l: picks.__setitem__(l, out[2]))
    with torch.no_grad():
        model(input_ids=input_ids)
    return picks


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_loads_with_expected_tensors_and_informative_logits(tiny_model, hf_logits, arch,
                                                                   variant):
    model_dir = tiny_model(arch, **VARIANTS[variant])
    cfg = config_of(model_dir)
    stored = stored_tensors(model_dir)
    assert {n: s for n, (s, _) in stored.items()} == expected_shapes(arch, cfg)

    logits = hf_logits(model_dir, INPUT_IDS)
    assert logits.shape == (*INPUT_IDS.shape, cfg["vocab_size"])
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.5, "logits are nearly flat"
    for row in logits.argmax(dim=-1):
        assert len(set(row.tolist())) >= INPUT_IDS.shape[1] // 2, "argmax barely moves"


@pytest.mark.parametrize("arch", ARCHS)
def test_routing_varies_between_tokens(tiny_model, arch):
    model_dir = tiny_model(arch)
    cfg = config_of(model_dir)
    picks = routed_experts(arch, model_dir, INPUT_IDS)
    assert sorted(picks) == moe_layers(arch, cfg)
    n_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"]
    for layer, idx in picks.items():
        assert idx.shape == (INPUT_IDS.numel(), cfg["num_experts_per_tok"])
        assert len(idx.unique()) >= n_experts * 3 // 4, f"layer {layer} uses few experts"
        assert len({tuple(sorted(r)) for r in idx.tolist()}) >= 4, f"layer {layer} routes alike"


def test_shapes_fit_the_parallel_layouts(tiny_model):
    """tp=4 needs heads % 4 and KV duplication; moe_tp=2 and moe_ep=2 need even splits;
    a vocab that is not a multiple of 4 exercises lm_head padding; odd layer counts split pp=2
    unevenly."""
    layer_counts = []
    for arch in ARCHS:
        cfg = config_of(tiny_model(arch))
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        assert (cfg["hidden_size"], hd) == (64, 16)
        assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
        assert cfg["vocab_size"] % 4 != 0
        assert cfg["num_experts_per_tok"] == 2
        n_exp = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"]
        assert n_exp % 2 == 0
        expert_ffn = cfg["intermediate_size"] if arch == "mixtral" else cfg["moe_intermediate_size"]
        assert expert_ffn % 2 == 0
        assert cfg["intermediate_size"] % 4 == 0
        assert cfg.get("shared_expert_intermediate_size", 0) % 4 == 0
        assert cfg["num_hidden_layers"] >= 3
        layer_counts.append(cfg["num_hidden_layers"])
    assert any(n % 2 for n in layer_counts)


def test_variant_specific_config_fields(tiny_model):
    q2 = config_of(tiny_model("qwen2_moe"))
    assert q2["qkv_bias"] is True and q2["norm_topk_prob"] is False
    assert q2["mlp_only_layers"] == [2] and q2["shared_expert_intermediate_size"] == 96
    q3 = config_of(tiny_model("qwen3_moe"))
    assert q3["norm_topk_prob"] is True
    ds = config_of(tiny_model("deepseek_v1"))
    assert ds["architectures"] == ["DeepseekForCausalLM"] and ds["model_type"] == "deepseek"
    assert (ds["first_k_dense_replace"], ds["moe_layer_freq"], ds["n_shared_experts"]) == (1, 1, 2)
    assert ds["norm_topk_prob"] is False and ds["scoring_func"] == "softmax"
    assert ds["hidden_act"] == "silu" and ds["attention_bias"] is False


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_transformers_writes_per_expert_names(tiny_model, arch):
    """In memory transformers 5.x fuses experts; on disk they must be one tensor per expert."""
    names = stored_tensors(tiny_model(arch))
    assert not [n for n in names if "gate_up_proj" in n or re.search(r"experts\.(down|up)_proj", n)]
    per_expert = {"mixtral": "model.layers.0.block_sparse_moe.experts.3.w1.weight",
                  "qwen2_moe": "model.layers.0.mlp.experts.7.gate_proj.weight",
                  "qwen3_moe": "model.layers.0.mlp.experts.7.gate_proj.weight"}[arch]
    assert per_expert in names


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_index_is_consistent(tiny_model, hf_logits, arch):
    model_dir = tiny_model(arch, sharded=True)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and not (model_dir / "model.safetensors").exists()
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    byte_total = 0
    for shard in shards:
        with safe_open(str(model_dir / shard), framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard
                byte_total += f.get_tensor(name).nbytes
    assert set(index["weight_map"]) == set(stored_tensors(model_dir))
    assert index["metadata"]["total_size"] == byte_total
    # sharding changes the files, never the values
    assert torch.equal(hf_logits(model_dir, INPUT_IDS), hf_logits(tiny_model(arch), INPUT_IDS))


@pytest.mark.parametrize("arch", ARCHS)
def test_tied_fixture_has_no_lm_head(tiny_model, arch):
    model_dir = tiny_model(arch, tied=True)
    assert config_of(model_dir)["tie_word_embeddings"] is True
    assert "lm_head.weight" not in stored_tensors(model_dir)
    if arch == "deepseek_v1":
        return  # no transformers class; the reference reads the embedding as the head itself
    from transformers import AutoModelForCausalLM

    embed = load_hf_tensors(model_dir)["model.embed_tokens.weight"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    assert torch.equal(model.lm_head.weight, embed)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_fixture_stores_rounded_fp32_values(tiny_model, hf_logits, arch):
    bf16_dir, fp32_dir = tiny_model(arch, dtype="bfloat16"), tiny_model(arch)
    cfg = config_of(bf16_dir)
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert {d for _, d in stored_tensors(bf16_dir).values()} == {"BF16"}
    assert {d for _, d in stored_tensors(fp32_dir).values()} == {"F32"}
    bf16, fp32 = load_hf_tensors(bf16_dir), load_hf_tensors(fp32_dir)
    assert bf16.keys() == fp32.keys()
    for name in fp32:
        assert torch.equal(bf16[name], fp32[name].to(torch.bfloat16)), name
    # same seeded model, so fp32 compute on the rounded weights tracks the fp32 fixture closely
    a, b = hf_logits(bf16_dir, INPUT_IDS).flatten(), hf_logits(fp32_dir, INPUT_IDS).flatten()
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.99
    if arch != "deepseek_v1":
        low = hf_logits(bf16_dir, INPUT_IDS, dtype=torch.bfloat16)
        assert low.dtype == torch.float32 and torch.isfinite(low).all()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v1"])
def test_seed_decides_the_weights(tmp_path, arch):
    make = make_tiny_models.make_tiny_model
    a = load_hf_tensors(make(arch, tmp_path / "a", seed=5))
    b = load_hf_tensors(make(arch, tmp_path / "b", seed=5))
    c = load_hf_tensors(make(arch, tmp_path / "c", seed=6))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not any(torch.equal(a[n], c[n]) for n in a)


def test_cli_writes_a_checkpoint(tmp_path):
    out = tmp_path / "cli"
    assert make_tiny_models.main(["deepseek_v1", str(out), "--dtype", "float16", "--tied",
                                  "--sharded", "--seed", "2"]) == 0
    assert config_of(out)["torch_dtype"] == "float16"
    assert {d for _, d in stored_tensors(out).values()} == {"F16"}
    with pytest.raises(SystemExit) as exit_info:  # refuses to write into a non-empty directory
        make_tiny_models.main(["deepseek_v1", str(out)])
    assert exit_info.value.code == 2


def test_cli_overrides_the_config_and_copies_a_tokenizer(tmp_path, capsys):
    out = tmp_path / "wide"
    fixture = Path(__file__).parent / "fixtures" / "trained_mixtral"
    assert make_tiny_models.main(["mixtral", str(out), "--set", "num_hidden_layers=3", "--set", "num_local_experts=6",
                                  "--set", "vocab_size=2048", "--tokenizer-from", str(fixture)]) == 0
    cfg = config_of(out)
    assert cfg["num_hidden_layers"] == 3 and cfg["num_local_experts"] == 6 and cfg["vocab_size"] == 2048
    assert (out / "tokenizer.json").read_bytes() == (fixture / "tokenizer.json").read_bytes()
    capsys.readouterr()  # the successful run's own output
    half = tmp_path / "half"  # a directory with only some of the tokenizer files
    half.mkdir()
    shutil.copyfile(fixture / "tokenizer.json", half / "tokenizer.json")
    for i, (bad, says) in enumerate(((["--set", "num_hidden_layers"], "KEY=VALUE"),
                                     (["--tokenizer-from", str(tmp_path / "none")], "no tokenizer.json"),
                                     (["--tokenizer-from", str(half)], "no tokenizer_config.json"),
                                     # the tokenizer's 2,048 ids do not fit the default 250-token vocabulary
                                     (["--tokenizer-from", str(fixture)], "--set vocab_size=2048"))):
        target = tmp_path / f"bad{i}"
        with pytest.raises(SystemExit) as exit_info:  # one line, exit 2, and nothing written
            make_tiny_models.main(["mixtral", str(target), *bad])
        assert exit_info.value.code == 2
        assert not target.exists()
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err


# ------------------------------------------------------------------------------------------------
# DeepSeek-MoE v1 reference vs transformers


def _load_in_transformers(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _assert_reference_matches(ds_dir, renamed: dict, tmp_path) -> None:
    """The DeepSeek-v1 reference on ``ds_dir`` equals transformers on the renamed weights saved
    beside the config already written to ``tmp_path``."""
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        expected = _load_in_transformers(tmp_path)(input_ids=INPUT_IDS).logits
    got = deepseek_v1_logits(ds_dir, INPUT_IDS)
    err = (got - expected).abs().max().item()
    assert err <= 1e-5, f"max |reference - transformers| = {err:.3g}"


def test_deepseek_reference_matches_transformers_mixtral(tiny_model, tmp_path):
    from transformers import MixtralConfig

    ds_dir = tiny_model("deepseek_v1", n_shared_experts=None, first_k_dense_replace=0,
                        norm_topk_prob=True)
    cfg = config_of(ds_dir)
    w_names = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    renamed = {}
    for name, t in load_hf_tensors(ds_dir).items():
        name = name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
        m = re.fullmatch(r"(.*)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if m:
            name = f"{m[1]}.block_sparse_moe.experts.{m[2]}.{w_names[m[3]]}.weight"
        renamed[name] = t
    assert not [n for n in renamed if ".mlp." in n]
    MixtralConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["moe_intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], num_local_experts=cfg["n_routed_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"], rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"], max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path)
    _assert_reference_matches(ds_dir, renamed, tmp_path)


def test_deepseek_reference_matches_transformers_qwen2_moe(tiny_model, tmp_path):
    from transformers import Qwen2MoeConfig

    ds_dir = tiny_model("deepseek_v1")
    cfg = config_of(ds_dir)
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_shared_experts"] == 2
    assert cfg["norm_topk_prob"] is False
    H = cfg["hidden_size"]
    hd = H // cfg["num_attention_heads"]
    renamed = {}
    for name, t in load_hf_tensors(ds_dir).items():
        if ".mlp.shared_experts." in name:
            name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
            if name.endswith("down_proj.weight"):
                t = 2 * t  # cancels sigmoid(0) = 1/2 of the zero shared-expert gate
        renamed[name] = t
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}"
        renamed[f"{p}.self_attn.q_proj.bias"] = torch.zeros(cfg["num_attention_heads"] * hd)
        renamed[f"{p}.self_attn.k_proj.bias"] = torch.zeros(cfg["num_key_value_heads"] * hd)
        renamed[f"{p}.self_attn.v_proj.bias"] = torch.zeros(cfg["num_key_value_heads"] * hd)
        if l >= cfg["first_k_dense_replace"]:
            renamed[f"{p}.mlp.shared_expert_gate.weight"] = torch.zeros(1, H)
    Qwen2MoeConfig(
        vocab_size=cfg["vocab_size"], hidden_size=H, head_dim=hd,
        intermediate_size=cfg["intermediate_size"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        shared_expert_intermediate_size=cfg["moe_intermediate_size"] * cfg["n_shared_experts"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], num_experts=cfg["n_routed_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"], norm_topk_prob=False,
        mlp_only_layers=list(range(cfg["first_k_dense_replace"])), decoder_sparse_step=1,
        qkv_bias=True, rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"],
        max_position_embeddings=cfg["max_position_embeddings"], tie_word_embeddings=False,
    ).save_pretrained(tmp_path)
    _assert_reference_matches(ds_dir, renamed, tmp_path)
