"""Per-rank TensorRT-LLM checkpoint layout, checked against the reference rules.

The expected names, shapes, dtypes and contents are computed here from the rules of the
TensorRT-LLM checkpoint format, written out independently of ``trtmoe.checkpoint.layout``. The rules
are read in NVIDIA/TensorRT-LLM: ``tensorrt_llm/models/modeling_utils.py`` (config.json,
``PretrainedConfig`` and ``QuantConfig``), ``tensorrt_llm/mapping.py`` (the mapping block),
``tensorrt_llm/layers/moe.py`` (the moe block and the expert weights), and
``tensorrt_llm/models/llama/convert.py`` / ``tensorrt_llm/models/model_weights_loader.py`` (per-rank
tensor names and how each is split). They are compared with the rank files ``convert`` writes for
every architecture fixture under four layouts: tp=1; tp=2 with moe_ep=2; tp=4 with moe_tp=2 × moe_ep=2;
pp=2. HF tensors are read with the ``safetensors`` library, rank files likewise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trtmoe.checkpoint.schema import check_strict_blocks, schema_for
from trtmoe.checkpoint.writer import convert

torch.set_num_threads(1)

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v1")
LAYOUTS = {
    "tp1": dict(tp=1, pp=1, moe_tp=1, moe_ep=1),
    "tp2_ep2": dict(tp=2, pp=1, moe_tp=1, moe_ep=2),
    "tp4_mtp2_ep2": dict(tp=4, pp=1, moe_tp=2, moe_ep=2),
    "pp2": dict(tp=1, pp=2, moe_tp=1, moe_ep=1),
}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Field names TensorRT-LLM 1.x accepts in the strict blocks (``Mapping``, ``MoeConfig`` and ``QuantConfig``
# are built from them as keyword arguments, so an unknown key fails to load), written out
# here so the test does not trust trtmoe's own schema table alone.
REF_MAPPING_KEYS = {"world_size", "rank", "gpus_per_node", "cp_size", "tp_size", "pp_size", "moe_tp_size",
                    "moe_ep_size", "moe_cluster_size", "attn_tp_size", "attn_cp_size", "cp_config",
                    "enable_attention_dp", "enable_lm_head_tp_in_adp", "pp_partition"}
REF_MOE_KEYS = {"num_experts", "top_k", "normalization_mode", "sparse_mixer_epsilon", "tp_mode",
                "shared_expert_intermediate_size", "device_limited_n_group", "device_limited_topk_group",
                "device_limited_routed_scaling_factor"}
REF_QUANT_KEYS = {"quant_algo", "kv_cache_quant_algo", "group_size", "smoothquant_val", "clamp_val",
                  "use_meta_recipe", "has_zero_point", "pre_quant_scale", "exclude_modules"}
REF_ARCHITECTURE = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v1": "DeepseekForCausalLM"}


# ---- the HF side, read straight from config.json and the safetensors files -----------------------

@dataclass
class HF:
    arch: str
    cfg: dict
    tensors: dict[str, torch.Tensor]

    @property
    def H(self): return self.cfg["hidden_size"]
    @property
    def V(self): return self.cfg["vocab_size"]
    @property
    def L(self): return self.cfg["num_hidden_layers"]
    @property
    def nh(self): return self.cfg["num_attention_heads"]
    @property
    def nkv(self): return self.cfg["num_key_value_heads"]
    @property
    def hd(self): return self.cfg.get("head_dim") or self.H // self.nh
    @property
    def E(self):
        # transformers 5 saves Qwen3-MoE's count as num_local_experts, Qwen2-MoE's as num_experts.
        keys = ("n_routed_experts",) if self.arch == "deepseek_v1" else ("num_local_experts", "num_experts")
        return next(self.cfg[k] for k in keys if k in self.cfg)
    @property
    def I(self):
        return self.cfg["intermediate_size"] if self.arch == "mixtral" else self.cfg["moe_intermediate_size"]
    @property
    def D(self): return self.cfg["intermediate_size"]  # dense layers (not Mixtral)
    @property
    def S(self):
        if self.arch == "qwen2_moe":
            return self.cfg["shared_expert_intermediate_size"]
        if self.arch == "deepseek_v1":
            return self.cfg["n_shared_experts"] * self.cfg["moe_intermediate_size"]
        return 0
    @property
    def tied(self): return bool(self.cfg.get("tie_word_embeddings"))

    def is_moe(self, l: int) -> bool:
        c = self.cfg
        if self.arch == "mixtral":
            return True
        if self.arch == "deepseek_v1":
            return l >= c["first_k_dense_replace"] and l % c["moe_layer_freq"] == 0
        return l not in (c.get("mlp_only_layers") or []) and (l + 1) % c.get("decoder_sparse_step", 1) == 0

    # HF names
    def router(self, l):
        return f"model.layers.{l}." + ("block_sparse_moe.gate.weight" if self.arch == "mixtral" else "mlp.gate.weight")

    def expert(self, l, e, which):  # which: gate | up | down
        if self.arch == "mixtral":
            w = {"gate": "w1", "down": "w2", "up": "w3"}[which]
            return f"model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight"
        return f"model.layers.{l}.mlp.experts.{e}.{which}_proj.weight"

    def shared(self, l, which):
        base = "shared_expert" if self.arch == "qwen2_moe" else "shared_experts"
        return f"model.layers.{l}.mlp.{base}.{which}_proj.weight"

    def t(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def load_hf(model_dir: Path, arch: str) -> HF:
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k)
    return HF(arch, json.loads((model_dir / "config.json").read_text()), tensors)


# ---- the reference rules ---------------------------------------------------------------------------

def rank_coords(lay: dict, rank: int) -> dict:
    """TensorRT-LLM's Mapping arithmetic (cp = 1): tp fastest; EP fastest inside a TP group."""
    tp_rank, pp_rank = rank % lay["tp"], rank // lay["tp"]
    return dict(tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=tp_rank % lay["moe_ep"],
                mtp_rank=tp_rank // lay["moe_ep"])


def pp_layers(L: int, pp: int, pp_rank: int) -> list[int]:
    """torch.tensor_split rule: the first L % pp ranks get one extra layer."""
    counts = [L // pp + (1 if i < L % pp else 0) for i in range(pp)]
    start = sum(counts[:pp_rank])
    return list(range(start, start + counts[pp_rank]))


def expected_specs(hf: HF, lay: dict, rank: int, dt: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) on one rank, from the reference shape table."""
    tp, pp, mtp, ep = lay["tp"], lay["pp"], lay["moe_tp"], lay["moe_ep"]
    c = rank_coords(lay, rank)
    H, hd = hf.H, hf.hd
    out: dict = {}
    if c["pp_rank"] == 0:
        out["transformer.vocab_embedding.weight"] = ((hf.V, H), dt)
    for j, l in enumerate(pp_layers(hf.L, pp, c["pp_rank"])):
        p = f"transformer.layers.{j}."
        out[p + "input_layernorm.weight"] = ((H,), dt)
        out[p + "post_layernorm.weight"] = ((H,), dt)
        qkv_rows = (hf.nh // tp + 2 * max(1, hf.nkv // tp)) * hd
        out[p + "attention.qkv.weight"] = ((qkv_rows, H), dt)
        if hf.arch == "qwen2_moe":
            out[p + "attention.qkv.bias"] = ((qkv_rows,), dt)
        if hf.arch == "qwen3_moe":
            out[p + "attention.q_layernorm.weight"] = ((hd,), dt)
            out[p + "attention.k_layernorm.weight"] = ((hd,), dt)
        out[p + "attention.dense.weight"] = ((H, hf.nh * hd // tp), dt)
        if hf.is_moe(l):
            out[p + "mlp.router.weight"] = ((hf.E, H), torch.float32)
            out[p + "mlp.fc.weight"] = ((hf.E // ep, 2 * hf.I // mtp, H), dt)
            out[p + "mlp.proj.weight"] = ((hf.E // ep, H, hf.I // mtp), dt)
            if hf.S:
                out[p + "mlp.shared_expert.fc.weight"] = ((2 * hf.S // tp, H), dt)
                out[p + "mlp.shared_expert.proj.weight"] = ((H, hf.S // tp), dt)
            if hf.arch == "qwen2_moe":
                out[p + "mlp.shared_expert_gate.weight"] = ((1, H), dt)
        else:
            out[p + "mlp.fc.weight"] = ((hf.D // tp, H), dt)
            out[p + "mlp.gate.weight"] = ((hf.D // tp, H), dt)
            out[p + "mlp.proj.weight"] = ((H, hf.D // tp), dt)
    if c["pp_rank"] == pp - 1:
        out["transformer.ln_f.weight"] = ((H,), dt)
        padded = -(-hf.V // tp) * tp
        out["lm_head.weight"] = ((padded // tp, H), dt)
    return out


def expected_tensors(hf: HF, lay: dict, rank: int, dt: torch.dtype) -> dict[str, torch.Tensor]:
    """name -> exact contents on one rank, built from the HF tensors by the reference rules."""
    tp, pp, mtp, ep = lay["tp"], lay["pp"], lay["moe_tp"], lay["moe_ep"]
    c = rank_coords(lay, rank)
    r, H, hd = c["tp_rank"], hf.H, hf.hd
    cast = lambda x: x.to(dt)  # noqa: E731

    def kv_slice(w: torch.Tensor) -> torch.Tensor:
        # dup_kv_weight: repeat each KV head tp/nkv times (adjacent copies) when nkv < tp, then split.
        if hf.nkv < tp:
            w = w.reshape(hf.nkv, hd, -1).repeat_interleave(tp // hf.nkv, dim=0).reshape(-1, w.shape[-1])
        return w.chunk(tp, dim=0)[r]

    out: dict[str, torch.Tensor] = {}
    embed = hf.t("model.embed_tokens.weight")
    if c["pp_rank"] == 0:
        out["transformer.vocab_embedding.weight"] = cast(embed)
    for j, l in enumerate(pp_layers(hf.L, pp, c["pp_rank"])):
        p, a = f"transformer.layers.{j}.", f"model.layers.{l}."
        out[p + "input_layernorm.weight"] = cast(hf.t(a + "input_layernorm.weight"))
        out[p + "post_layernorm.weight"] = cast(hf.t(a + "post_attention_layernorm.weight"))
        q, k, v = (hf.t(a + f"self_attn.{x}_proj.weight") for x in "qkv")
        out[p + "attention.qkv.weight"] = cast(torch.cat([q.chunk(tp, 0)[r], kv_slice(k), kv_slice(v)]))
        if hf.arch == "qwen2_moe":
            qb, kb, vb = (hf.t(a + f"self_attn.{x}_proj.bias") for x in "qkv")
            out[p + "attention.qkv.bias"] = cast(torch.cat([qb.chunk(tp)[r], kv_slice(kb[:, None])[:, 0],
                                                            kv_slice(vb[:, None])[:, 0]]))
        if hf.arch == "qwen3_moe":
            out[p + "attention.q_layernorm.weight"] = cast(hf.t(a + "self_attn.q_norm.weight"))
            out[p + "attention.k_layernorm.weight"] = cast(hf.t(a + "self_attn.k_norm.weight"))
        out[p + "attention.dense.weight"] = cast(hf.t(a + "self_attn.o_proj.weight").chunk(tp, 1)[r])
        if hf.is_moe(l):
            out[p + "mlp.router.weight"] = hf.t(hf.router(l)).float()
            per = hf.E // ep
            experts = range(c["ep_rank"] * per, (c["ep_rank"] + 1) * per)  # contiguous block
            m = c["mtp_rank"]
            # fc per expert = [w3 (up) slice; w1 (gate) slice]: the linear branch first.
            out[p + "mlp.fc.weight"] = cast(torch.stack([
                torch.cat([hf.t(hf.expert(l, e, "up")).chunk(mtp, 0)[m], hf.t(hf.expert(l, e, "gate")).chunk(mtp, 0)[m]])
                for e in experts]))
            out[p + "mlp.proj.weight"] = cast(torch.stack([hf.t(hf.expert(l, e, "down")).chunk(mtp, 1)[m]
                                                           for e in experts]))
            if hf.S:
                up, gate, down = (hf.t(hf.shared(l, x)) for x in ("up", "gate", "down"))
                out[p + "mlp.shared_expert.fc.weight"] = cast(torch.cat([up.chunk(tp)[r], gate.chunk(tp)[r]]))
                out[p + "mlp.shared_expert.proj.weight"] = cast(down.chunk(tp, 1)[r])
            if hf.arch == "qwen2_moe":
                out[p + "mlp.shared_expert_gate.weight"] = cast(hf.t(a + "mlp.shared_expert_gate.weight"))
        else:
            # GatedMLP naming: fc = gate_proj (activated), gate = up_proj, proj = down_proj.
            out[p + "mlp.fc.weight"] = cast(hf.t(a + "mlp.gate_proj.weight").chunk(tp)[r])
            out[p + "mlp.gate.weight"] = cast(hf.t(a + "mlp.up_proj.weight").chunk(tp)[r])
            out[p + "mlp.proj.weight"] = cast(hf.t(a + "mlp.down_proj.weight").chunk(tp, 1)[r])
    if c["pp_rank"] == pp - 1:
        out["transformer.ln_f.weight"] = cast(hf.t("model.norm.weight"))
        head = embed if hf.tied else hf.t("lm_head.weight")
        padded = -(-hf.V // tp) * tp
        head = torch.cat([head, torch.zeros(padded - hf.V, H, dtype=head.dtype)])
        out["lm_head.weight"] = cast(head.chunk(tp)[r])
    return out


# ---- conversions (each done once per module) ---------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tiny_model, tmp_path_factory):
    """``converted(arch, layout_name, out_dtype="auto", **fixture_kwargs)`` -> (out_dir, HF)."""
    cache: dict = {}

    def get(arch: str, layout: str, out_dtype: str = "auto", **fx):
        key = (arch, layout, out_dtype, tuple(sorted(fx.items())))
        if key not in cache:
            src = tiny_model(arch, **fx)
            out = tmp_path_factory.mktemp(f"{arch}-{layout}") / "ckpt"
            convert(src, out, dtype=out_dtype, **LAYOUTS[layout])
            cache[key] = (out, load_hf(src, arch))
        return cache[key]

    return get


def check_rank_files(out: Path, hf: HF, lay: dict, dt: torch.dtype) -> None:
    world = lay["tp"] * lay["pp"]
    assert sorted(p.name for p in out.glob("rank*.safetensors")) == sorted(f"rank{r}.safetensors"
                                                                          for r in range(world))
    for rank in range(world):
        got = load_file(out / f"rank{rank}.safetensors")
        specs = expected_specs(hf, lay, rank, dt)
        want = expected_tensors(hf, lay, rank, dt)
        assert set(specs) == set(want)  # the two reference builders agree on names
        assert set(got) == set(specs), (rank, sorted(set(got) ^ set(specs)))
        for name, (shape, dtype) in specs.items():
            assert tuple(got[name].shape) == shape, (rank, name, tuple(got[name].shape), shape)
            assert got[name].dtype == dtype, (rank, name, got[name].dtype, dtype)
            assert tuple(want[name].shape) == shape, (rank, name)
            assert torch.equal(got[name], want[name]), (rank, name)


def check_config(out: Path, hf: HF, lay: dict, dtype_name: str) -> dict:
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == REF_ARCHITECTURE[hf.arch]
    assert cfg["dtype"] == dtype_name
    assert cfg["hidden_act"] == "swiglu"
    assert cfg["vocab_size"] == hf.V and cfg["hidden_size"] == hf.H
    assert cfg["num_hidden_layers"] == hf.L  # global count, also under PP
    assert cfg["num_attention_heads"] == hf.nh and cfg["num_key_value_heads"] == hf.nkv
    assert cfg["head_size"] == hf.hd
    assert cfg["tie_word_embeddings"] == hf.tied
    if hf.arch == "mixtral":
        assert cfg["intermediate_size"] == hf.I  # Mixtral: the per-expert FFN size
    else:
        assert cfg["moe_intermediate_size"] == hf.I
    if hf.arch in ("qwen2_moe", "qwen3_moe"):
        assert cfg["qwen_type"] == hf.arch
    # Routing normalisation: Mixtral renormalises; Qwen3-MoE with norm_topk_prob too (unlike
    # TensorRT-LLM's own converter); Qwen2-MoE (norm_topk_prob=false) and DeepSeek-V1 do not.
    want_norm = {"mixtral": 1, "qwen2_moe": 0, "deepseek_v1": 0,
                 "qwen3_moe": 1 if hf.cfg.get("norm_topk_prob") else 0}[hf.arch]
    assert cfg["moe"]["normalization_mode"] == want_norm
    assert cfg["moe"]["num_experts"] == hf.E
    assert cfg["moe"]["top_k"] == hf.cfg["num_experts_per_tok"]
    assert cfg["moe"].get("shared_expert_intermediate_size", 0) == hf.S
    mp = cfg["mapping"]
    assert mp["world_size"] == lay["tp"] * lay["pp"]
    assert (mp["tp_size"], mp["pp_size"], mp["moe_tp_size"], mp["moe_ep_size"]) == \
        (lay["tp"], lay["pp"], lay["moe_tp"], lay["moe_ep"])
    assert mp.get("cp_size", 1) == 1
    assert "rank" not in mp  # PretrainedConfig.to_dict drops it; rank comes from the file name
    # Strict blocks carry only keys TensorRT-LLM 1.x accepts (reference lists, then our schema table).
    assert set(mp) <= REF_MAPPING_KEYS
    assert set(cfg["moe"]) <= REF_MOE_KEYS
    assert set(cfg["quantization"]) <= REF_QUANT_KEYS
    s = schema_for("1.2")
    assert set(mp) <= s["mapping"] and set(cfg["moe"]) <= s["moe"] and set(cfg["quantization"]) <= s["quantization"]
    assert check_strict_blocks(cfg, "1.2") == []
    assert cfg["quantization"]["quant_algo"] is None
    return cfg


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_rank_layout_matches_reference(converted, arch, layout):
    out, hf = converted(arch, layout)
    lay = LAYOUTS[layout]
    check_rank_files(out, hf, lay, torch.float32)
    check_config(out, hf, lay, "float32")


def test_fixtures_exercise_the_interesting_cases(converted):
    """The layout matrix only proves something if the fixtures hit the edge cases."""
    hf = converted("mixtral", "tp1")[1]
    assert hf.nkv < LAYOUTS["tp4_mtp2_ep2"]["tp"]  # KV-head duplication happens at tp=4
    assert hf.V % 4 != 0  # lm_head padding happens at tp=4
    assert hf.L % 2 == 1  # pp=2 splits unevenly
    qwen2 = converted("qwen2_moe", "tp1")[1]
    assert not all(qwen2.is_moe(l) for l in range(qwen2.L)) and qwen2.S > 0
    ds = converted("deepseek_v1", "tp1")[1]
    assert not ds.is_moe(0) and ds.S > 0


def test_expert_placement_worked_example(converted):
    """tp=4, moe_tp=2, moe_ep=2: rank 1 holds the second expert block with the *first* FFN half,
    rank 2 the first block with the second half (EP varies fastest), spelled out by index."""
    out, hf = converted("mixtral", "tp4_mtp2_ep2")
    I2 = hf.I // 2
    r1 = load_file(out / "rank1.safetensors")["transformer.layers.0.mlp.fc.weight"]
    r2 = load_file(out / "rank2.safetensors")["transformer.layers.0.mlp.fc.weight"]
    w3 = hf.t("model.layers.0.block_sparse_moe.experts.2.w3.weight")
    w1 = hf.t("model.layers.0.block_sparse_moe.experts.2.w1.weight")
    assert torch.equal(r1[0, :I2], w3[:I2]) and torch.equal(r1[0, I2:], w1[:I2])
    w3 = hf.t("model.layers.0.block_sparse_moe.experts.0.w3.weight")
    w1 = hf.t("model.layers.0.block_sparse_moe.experts.0.w1.weight")
    assert torch.equal(r2[0, :I2], w3[I2:]) and torch.equal(r2[0, I2:], w1[I2:])


def test_lm_head_padding_rows_are_zero(converted):
    out, hf = converted("qwen2_moe", "tp4_mtp2_ep2")
    last = load_file(out / "rank3.safetensors")["lm_head.weight"]
    rows = -(-hf.V // 4)
    n_pad = rows * 4 - hf.V
    assert n_pad > 0
    assert torch.count_nonzero(last[-n_pad:]) == 0
    assert torch.equal(last[:-n_pad], hf.t("lm_head.weight")[3 * rows:])


def test_kv_heads_duplicated_when_fewer_than_tp(converted):
    out, hf = converted("qwen3_moe", "tp4_mtp2_ep2")
    hd, nh_loc = hf.hd, hf.nh // 4
    k = hf.t("model.layers.1.self_attn.k_proj.weight")
    for rank in range(4):
        qkv = load_file(out / f"rank{rank}.safetensors")["transformer.layers.1.attention.qkv.weight"]
        head = rank // (4 // hf.nkv)  # ranks 0,1 share KV head 0; ranks 2,3 share head 1
        assert torch.equal(qkv[nh_loc * hd:(nh_loc + 1) * hd], k[head * hd:(head + 1) * hd])


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_tied_embeddings_build_lm_head_from_embedding(converted, arch):
    out, hf = converted(arch, "tp4_mtp2_ep2", tied=True)
    assert hf.tied and "lm_head.weight" not in hf.tensors
    check_rank_files(out, hf, LAYOUTS["tp4_mtp2_ep2"], torch.float32)
    cfg = check_config(out, hf, LAYOUTS["tp4_mtp2_ep2"], "float32")
    assert cfg["tie_word_embeddings"] is True


def test_bf16_source_stays_bf16_with_float32_router(converted):
    out, hf = converted("mixtral", "tp2_ep2", dtype="bfloat16")
    assert {t.dtype for t in hf.tensors.values()} == {torch.bfloat16}
    check_rank_files(out, hf, LAYOUTS["tp2_ep2"], torch.bfloat16)
    check_config(out, hf, LAYOUTS["tp2_ep2"], "bfloat16")


def test_dtype_option_converts_bf16_to_float16(converted):
    out, hf = converted("qwen3_moe", "tp4_mtp2_ep2", out_dtype="float16", dtype="bfloat16")
    dtypes = set()
    for r in range(4):
        for name, t in load_file(out / f"rank{r}.safetensors").items():
            assert t.dtype == (torch.float32 if name.endswith("mlp.router.weight") else torch.float16), name
            dtypes.add(t.dtype)
    assert dtypes == {torch.float16, torch.float32}
    check_rank_files(out, hf, LAYOUTS["tp4_mtp2_ep2"], torch.float16)
    check_config(out, hf, LAYOUTS["tp4_mtp2_ep2"], "float16")


def test_sharded_source_gives_the_same_rank_files(converted, tiny_model, tmp_path):
    out_single, _ = converted("qwen2_moe", "tp2_ep2")
    out_sharded, hf = converted("qwen2_moe", "tp2_ep2", sharded=True)
    assert len(list(tiny_model("qwen2_moe", sharded=True).glob("*.safetensors"))) > 1
    check_rank_files(out_sharded, hf, LAYOUTS["tp2_ep2"], torch.float32)
    for name in ("config.json", "rank0.safetensors", "rank1.safetensors"):
        assert (out_single / name).read_bytes() == (out_sharded / name).read_bytes(), name
