"""Config variants real checkpoints set, per architecture: either the embedded engine reproduces the
source model after ``convert`` (fp32 logits, the tolerance of tests/test_parity.py, in the default
layout and under tp=2 x moe_ep=2), or convert refuses the config with one line naming the key.

References: transformers' own model classes (Mixtral, Qwen2-MoE, Qwen3-MoE, Phi-3.5-MoE) and, for
DeepSeek-MoE v1, tests/reference/deepseek_v1.py. A 16-bit variant stores its weights in that dtype;
both sides then compute in float32 on the same stored values, so the fp32 tolerance still holds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.conftest import hf_logits, make_tiny_models
from trtmoe.checkpoint.writer import convert
from trtmoe.errors import TrtmoeError
from trtmoe.runtime.engine import EmbeddedEngine

LAYOUTS = {"tp1": {}, "tp2-ep2": {"tp": 2, "moe_ep": 2}}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def hub_style(cfg: dict) -> dict:
    """The config as hub checkpoints write it (what transformers 4 saved): ``rope_theta`` at the top
    level, RoPE scaling under ``rope_scaling`` with ``type``, no ``rope_parameters`` or ``layer_types``,
    no ``head_dim`` where it is hidden / heads."""
    rp = dict(cfg.pop("rope_parameters", None) or {})
    cfg.pop("layer_types", None)
    cfg["rope_theta"] = rp.pop("rope_theta", 10000.0)
    kind = rp.pop("rope_type", "default")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rp}
    if cfg.get("head_dim") == cfg["hidden_size"] // cfg["num_attention_heads"]:
        del cfg["head_dim"]
    return cfg


def without_rope_theta(cfg: dict) -> dict:
    """A hub config that leaves the RoPE base to the model class's default."""
    cfg = hub_style(cfg)
    del cfg["rope_theta"]
    return cfg


def edit_config(src: Path, edit) -> None:
    path = src / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text())), indent=1))


def build(tmp: Path, arch: str, edit=None, **kw) -> Path:
    src = make_tiny_models.make_tiny_model(arch, tmp / "src", **kw)
    if edit is not None:
        edit_config(src, edit)
    return src


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def check_parity(src: Path, tmp: Path, ids: torch.Tensor | None = None, ref: torch.Tensor | None = None) -> None:
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    if ids is None:
        ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(0))
    if ref is None:
        ref = hf_logits(src, ids)
    for name, layout in LAYOUTS.items():
        ck = convert(src, tmp / f"ck-{name}", **layout).out_dir
        got = EmbeddedEngine.from_checkpoint(ck, device="cpu").logits(ids)
        assert got.shape == ref.shape
        assert rel_err(got, ref) < 1e-4, f"{name}: max relative error {rel_err(got, ref):.2e}"
        assert rel_err(torch.roll(got, 1, dims=-1), ref) > 1e-2  # the comparison can fail


# (id, architecture, make_tiny_model keywords, config.json edit after saving)
PARITY = [
    ("mixtral-head_dim-8", "mixtral", dict(head_dim=8), None),  # q/k/v width 32 != hidden 64
    ("mixtral-gqa-4to1", "mixtral", dict(num_key_value_heads=1), None),  # tp=2 duplicates the KV head
    ("mixtral-mha", "mixtral", dict(num_key_value_heads=4), None),
    ("mixtral-sliding-window-at-context", "mixtral", dict(sliding_window=256), None),
    ("mixtral-hub-rope-theta-1e6", "mixtral", {}, lambda c: {**hub_style(c), "rope_theta": 1e6}),
    ("mixtral-no-rope-theta", "mixtral", {}, without_rope_theta),  # MixtralConfig's default base is 1e6
    ("mixtral-tied-fp16-vocab-251", "mixtral", dict(tied=True, dtype="float16", vocab_size=251), None),  # padded under tp=2
    ("mixtral-vocab-251-top1", "mixtral", dict(vocab_size=251, num_experts_per_tok=1), None),
    ("qwen2-norm-topk", "qwen2_moe", dict(norm_topk_prob=True), None),
    ("qwen2-sparse-step-2", "qwen2_moe", dict(decoder_sparse_step=2, mlp_only_layers=[]), None),
    ("qwen2-mlp-only-0-3", "qwen2_moe", dict(mlp_only_layers=[0, 3]), None),
    ("qwen2-no-qkv-bias-shared-32", "qwen2_moe", dict(qkv_bias=False, shared_expert_intermediate_size=32), None),
    # A window at least the context attends to everything: full attention.
    ("qwen2-sliding-window-on-at-context", "qwen2_moe",
     dict(use_sliding_window=True, sliding_window=256, max_window_layers=2), None),
    ("qwen2-hub-tied-bf16", "qwen2_moe", dict(tied=True, dtype="bfloat16"), hub_style),
    ("qwen3-head_dim-32", "qwen3_moe", dict(head_dim=32), None),  # q width 128 > hidden 64
    ("qwen3-head_dim-8-no-norm-topk", "qwen3_moe", dict(head_dim=8, norm_topk_prob=False), None),
    ("qwen3-mlp-only-and-step", "qwen3_moe", dict(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2),
     None),
    ("qwen3-hub-tied", "qwen3_moe", dict(tied=True), hub_style),
    ("deepseek-no-dense-layer", "deepseek_v1", dict(first_k_dense_replace=0), None),
    ("deepseek-moe-every-2nd", "deepseek_v1", dict(first_k_dense_replace=0, num_hidden_layers=4, moe_layer_freq=2),
     None),
    ("deepseek-no-shared", "deepseek_v1", dict(n_shared_experts=None), None),
    ("deepseek-1-shared-norm-topk", "deepseek_v1", dict(n_shared_experts=1, norm_topk_prob=True), None),
    ("deepseek-tied-bf16", "deepseek_v1", dict(tied=True, dtype="bfloat16"), None),
    # DeepSeek-MoE renormalises only several picks: top-1 keeps its softmax probability.
    ("deepseek-top1-norm-topk", "deepseek_v1", dict(num_experts_per_tok=1, norm_topk_prob=True), None),
    ("phimoe-unscaled-rope", "phimoe", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), None),
    ("phimoe-jitter-0.1", "phimoe", dict(router_jitter_noise=0.1), None),  # the sparse mixer's margin
    ("phimoe-no-biases", "phimoe", dict(attention_bias=False, lm_head_bias=False), None),
    ("phimoe-tied-bf16", "phimoe", dict(tied=True, dtype="bfloat16"), None),
    # Phi-3.5-MoE's hub config: rope_scaling {"type": "longrope", ...} and no rope_theta (PhimoeConfig: 1e6).
    ("phimoe-hub-longrope-no-theta", "phimoe", dict(sliding_window=256), without_rope_theta),
]


@pytest.mark.parametrize("arch,kw,edit", [p[1:] for p in PARITY], ids=[p[0] for p in PARITY])
def test_variant_matches_transformers(arch, kw, edit, tmp_path):
    check_parity(build(tmp_path, arch, edit, **kw), tmp_path)


def _set(**kv):
    return lambda c: {**c, **kv}


def _rope(**kv):
    return lambda c: {**c, "rope_parameters": {**c["rope_parameters"], **kv}}


# (id, architecture, make_tiny_model keywords, config.json edit, words the one error line must hold)
REFUSED = [
    ("mixtral-sliding-window", "mixtral", dict(sliding_window=16), None, ("sliding_window",)),
    # Mixtral's attention uses its window whatever a (Qwen-only) use_sliding_window key says.
    ("mixtral-sliding-window-use-false", "mixtral", dict(sliding_window=16), _set(use_sliding_window=False),
     ("sliding_window",)),
    ("mixtral-linear-rope", "mixtral", {}, lambda c: {**hub_style(c), "rope_scaling": {"type": "linear", "factor": 2.0}},
     ("rope_scaling", "linear")),
    ("qwen2-sliding-window-on", "qwen2_moe", dict(use_sliding_window=True, sliding_window=8, max_window_layers=4), None,
     ("sliding_window",)),
    ("qwen3-sliding-window-on", "qwen3_moe", dict(use_sliding_window=True, sliding_window=8), None,
     ("sliding_window",)),
    ("qwen3-yarn", "qwen3_moe", {}, _set(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                          "original_max_position_embeddings": 64}),
     ("rope_parameters", "yarn")),
    ("qwen3-attention-bias", "qwen3_moe", dict(attention_bias=True), None, ("attention_bias",)),
    ("deepseek-sigmoid-scoring", "deepseek_v1", {}, _set(scoring_func="sigmoid"), ("scoring_func", "sigmoid")),
    ("phimoe-top3", "phimoe", {}, _set(num_experts_per_tok=3), ("num_experts_per_tok",)),
    ("phimoe-sliding-window", "phimoe", dict(sliding_window=64), None, ("sliding_window",)),
    ("phimoe-partial-rotary", "phimoe", {}, _rope(partial_rotary_factor=0.5), ("partial_rotary_factor",)),
]


@pytest.mark.parametrize("arch,kw,edit,words", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_variant_refused_by_name(arch, kw, edit, words, tmp_path):
    src = build(tmp_path, arch, edit, **kw)
    with pytest.raises(TrtmoeError) as err:
        convert(src, tmp_path / "ck")
    line = str(err.value)
    assert "\n" not in line and all(w in line for w in words), line
    assert not (tmp_path / "ck").exists()


def test_tied_config_with_a_different_stored_lm_head_is_refused(tmp_path):
    """tie_word_embeddings true, yet the file holds an lm_head that is not the embedding: transformers 5
    keeps it untied, older releases overwrite it, so the model is ambiguous. A stored copy of the
    embedding is fine."""
    for name, differs in (("copy", False), ("other", True)):
        src = make_tiny_models.make_tiny_model("mixtral", tmp_path / name / "src", tied=True)
        weights = load_file(src / "model.safetensors")
        emb = weights["model.embed_tokens.weight"]
        weights["lm_head.weight"] = emb.flip(0).contiguous() if differs else emb.clone()
        save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
        if not differs:
            check_parity(src, tmp_path / name)
            continue
        with pytest.raises(TrtmoeError) as err:
            convert(src, tmp_path / f"ck-{name}")
        assert "tie_word_embeddings" in str(err.value) and "lm_head.weight" in str(err.value)


def test_phimoe_without_biases_carries_zero_biases_for_tensorrt_llm(tmp_path):
    """TensorRT-LLM's PhiMoE always has qkv, attention-dense and lm_head biases; a source without
    them is written with zeros there (the same arithmetic), in every rank, padded like the lm_head."""
    src = make_tiny_models.make_tiny_model("phimoe", tmp_path / "src", attention_bias=False, lm_head_bias=False)
    ck = convert(src, tmp_path / "ck", tp=2, moe_ep=2).out_dir
    for rank in (0, 1):
        with safe_open(str(ck / f"rank{rank}.safetensors"), "pt") as f:
            names = set(f.keys())
            biases = [n for n in names if n.endswith(("attention.qkv.bias", "attention.dense.bias", "lm_head.bias"))]
            assert len(biases) == 2 * 3 + 1, sorted(biases)
            for n in biases:
                assert not f.get_tensor(n).any(), n
            assert f.get_slice("lm_head.bias").get_shape() == [125]  # vocab 250 over tp=2
            assert f.get_slice("transformer.layers.0.attention.qkv.bias").get_shape() == [4 // 2 * 16 + 2 * 16]


def test_phimoe_long_context_uses_the_long_factors(tmp_path):
    """Past original_max_position_embeddings (128 here) LongRoPE switches to the long factors and
    long_mscale for the whole forward (the Phi-3.5-MoE definition, and TensorRT-LLM's long_rope).
    transformers 5.24's PhimoeRotaryEmbedding recomputes its frequencies without the sequence length,
    so it keeps the short factors (with long_mscale) there; the reference for the long regime is
    therefore transformers on a config whose short factors and mscale are the long ones."""
    src = make_tiny_models.make_tiny_model("phimoe", tmp_path / "src")
    ids = torch.randint(0, 250, (1, 140), generator=torch.Generator().manual_seed(0))
    alt = Path(shutil.copytree(src, tmp_path / "long-as-short"))
    rp = json.loads((alt / "config.json").read_text())["rope_parameters"]
    edit_config(alt, lambda c: {**c, "rope_parameters": {**rp, "short_factor": rp["long_factor"],
                                                         "short_mscale": rp["long_mscale"]}})
    check_parity(src, tmp_path / "long", ids=ids, ref=hf_logits(alt, ids))
    # Within the original context the short factors hold, as transformers computes them.
    check_parity(src, tmp_path / "short", ids=ids[:, :128])


@pytest.mark.parametrize("arch,kw", [("qwen3_moe", dict(head_dim=32)), ("mixtral", dict(num_key_value_heads=1)),
                                     ("qwen2_moe", dict(decoder_sparse_step=2, mlp_only_layers=[]))],
                         ids=["qwen3-head_dim-32", "mixtral-gqa-4to1", "qwen2-sparse-step-2"])
def test_variant_greedy_generation_with_cache(arch, kw, tmp_path):
    """The cached decode path (KV pool sized by head_dim and KV heads) generates what transformers does."""
    from transformers import AutoModelForCausalLM

    from trtmoe.runtime.engine import SamplingParams

    src = build(tmp_path, arch, **kw)
    eng = EmbeddedEngine.from_checkpoint(convert(src, tmp_path / "ck", tp=2, moe_ep=2).out_dir, device="cpu")
    prompt = [5, 17, 99, 3, 42, 7]
    got = eng.generate(prompt, SamplingParams(max_new_tokens=10))
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert got == out[0, len(prompt):].tolist()


def test_phimoe_long_and_short_sequences_batched_decode_as_alone(tmp_path):
    """LongRoPE's short/long choice belongs to each sequence: a short sequence prefilled and decoded
    in one batch with one past original_max_position_embeddings (128) gets the tokens it gets alone
    (it used to take the batch's longest length, hence the long factors)."""
    from trtmoe.runtime.engine import SamplingParams

    src = make_tiny_models.make_tiny_model("phimoe", tmp_path / "src")
    eng = EmbeddedEngine.from_checkpoint(convert(src, tmp_path / "ck").out_dir, device="cpu")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (10, 130, 60)]
    alone = [eng.generate(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    seqs = eng.start_many(prompts, [SamplingParams(max_new_tokens=8)] * 3)
    while not all(s.finished for s in seqs):
        eng.step(seqs)
    assert [s.tokens for s in seqs] == alone


def test_phimoe_decode_across_original_context_equals_full_forwards(tmp_path):
    """A sequence that grows past original_max_position_embeddings (128) while decoding recomputes its
    cached history with the long factors there (as the model's own generation drops its cache), so
    every token equals greedy decoding by full forwards; the recomputation is not counted as routing."""
    from trtmoe.runtime.engine import SamplingParams

    src = make_tiny_models.make_tiny_model("phimoe", tmp_path / "src")
    eng = EmbeddedEngine.from_checkpoint(convert(src, tmp_path / "ck").out_dir, device="cpu")
    prompt = torch.randint(0, 250, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    eng.reset_routing_stats()
    got = eng.generate(prompt, SamplingParams(max_new_tokens=20))
    assert eng.routing_stats()["tokens"] == 120 + 19  # the prefill, then one token per step
    seq = list(prompt)
    for _ in range(20):
        seq.append(int(eng.logits(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):]
