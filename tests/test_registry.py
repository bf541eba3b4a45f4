"""The architecture registry: each entry's rule table is what the checkpoint layout interprets and
the engine's loader reverses, and a table that cannot be interpreted is refused when the entry is
made."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open

from trtmoe.checkpoint.writer import convert
from trtmoe.errors import UnsupportedError
from trtmoe.hf.adapters import ADAPTERS, REPLICATED, TP, Rule, describe
from trtmoe.model.params import count_params, role_shapes
from trtmoe.runtime.engine import EmbeddedEngine


def _with_rule(family: str, name: str, **change) -> tuple[Rule, ...]:
    rules = ADAPTERS[family].rules
    assert sum(r.name == name for r in rules) == 1
    return tuple(dataclasses.replace(r, **change) if r.name == name else r for r in rules)


def test_each_entry_has_its_own_table_of_the_roles_it_names():
    for fam, a in ADAPTERS.items():
        read = {role for r in a.rules for role in r.roles}
        assert read == set(a.names), fam
    # Mixtral names no shared expert, so its table has no shared-expert rule; Qwen2-MoE's has them.
    assert not any("shared_expert" in r.name for r in ADAPTERS["mixtral"].rules)
    assert any(r.name == "mlp.shared_expert_gate.weight" for r in ADAPTERS["qwen2_moe"].rules)


def test_an_empty_table_is_refused_naming_the_unread_roles():
    with pytest.raises(UnsupportedError, match=r"no rule reads role\(s\) .*expert_down.*not be written"):
        dataclasses.replace(ADAPTERS["mixtral"], rules=())


def test_a_rule_reading_a_role_the_entry_does_not_name_is_refused():
    mla = Rule("attention.kv_a_proj.weight", ("kv_a_proj",), REPLICATED, "layer")
    with pytest.raises(UnsupportedError, match=r"reads role\(s\) kv_a_proj that mixtral does not name"):
        dataclasses.replace(ADAPTERS["mixtral"], rules=(*ADAPTERS["mixtral"].rules, mla))


@pytest.mark.parametrize("change, what", [
    (dict(shard="rows"), "shard kind 'rows'"),
    (dict(where="attention"), "place 'attention'"),
    (dict(dtype="float8"), "dtype 'float8'"),
    (dict(when="has_mla"), "condition 'has_mla'"),
])
def test_a_rule_of_an_unknown_kind_is_refused(change, what):
    rules = _with_rule("mixtral", "attention.dense.weight", **change)
    with pytest.raises(UnsupportedError, match=f"'attention.dense.weight' has an unknown {what}"):
        dataclasses.replace(ADAPTERS["mixtral"], rules=rules)


def test_routed_experts_need_one_fc_and_one_proj():
    rules = tuple(r for r in ADAPTERS["mixtral"].rules if r.name != "mlp.proj.weight" or r.where != "moe")
    rules += (Rule("mlp.proj.weight", ("expert_down",), TP, "moe", axis=1),)  # read, but not as an expert
    with pytest.raises(UnsupportedError, match=r"routed-expert rules build \['fc'\]"):
        dataclasses.replace(ADAPTERS["mixtral"], rules=rules)


def test_the_writer_interprets_and_the_loader_reverses_the_entrys_table(tiny_model, tmp_path, monkeypatch):
    """Mixtral's o_proj stored replicated and in float32 instead of split over tp in the model dtype:
    the rank files follow the entry's table, and the engine reads the whole tensor back from it (the
    default table's tp reversal would concatenate two whole copies), so the logits are unchanged."""
    src = tiny_model("mixtral", dtype="bfloat16")  # bf16 weights: float32 copies of them are exact
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(0))
    convert(src, tmp_path / "ref", tp=2, dtype="bfloat16")
    ref = EmbeddedEngine.from_checkpoint(tmp_path / "ref", device="cpu").logits(ids)

    rules = _with_rule("mixtral", "attention.dense.weight", shard=REPLICATED, axis=0, dtype="float32")
    monkeypatch.setitem(ADAPTERS, "mixtral", dataclasses.replace(ADAPTERS["mixtral"], rules=rules))
    convert(src, tmp_path / "ours", tp=2, dtype="bfloat16")
    H = 64
    for rank in (0, 1):
        with safe_open(str(tmp_path / "ours" / f"rank{rank}.safetensors"), "pt") as f:
            dense = f.get_tensor("transformer.layers.0.attention.dense.weight")
            assert dense.dtype == torch.float32 and dense.shape == (H, H)
        with safe_open(str(tmp_path / "ref" / f"rank{rank}.safetensors"), "pt") as f:
            part = f.get_tensor("transformer.layers.0.attention.dense.weight")
            assert part.dtype == torch.bfloat16 and part.shape == (H, H // 2)
            assert torch.equal(dense[:, rank * H // 2:(rank + 1) * H // 2].to(torch.bfloat16), part)
    ours = EmbeddedEngine.from_checkpoint(tmp_path / "ours", device="cpu").logits(ids)
    assert torch.equal(ours, ref)


def test_parameter_counts_are_products_of_the_role_shapes(tiny_model):
    import json

    for arch in ("qwen2_moe", "deepseek_v1", "phimoe"):
        _, m = describe(json.loads((tiny_model(arch) / "config.json").read_text()))
        every = sum(torch.Size(s).numel() for s in role_shapes(m, None).values()) - (
            m.vocab_size * m.hidden_size if m.tie_word_embeddings else 0)
        for layer in range(m.num_layers):
            for role, s in role_shapes(m, layer).items():
                every += torch.Size(s).numel() * (m.num_experts if role.startswith("expert_") else 1)
        assert count_params(m).total == every, arch


def test_tensors_an_architecture_always_has_are_marked_in_its_own_table():
    always = {fam: sorted(r.name for r in a.rules if r.always) for fam, a in ADAPTERS.items()}
    assert always["phimoe"] == ["attention.dense.bias", "attention.qkv.bias", "lm_head.bias"]
    assert not any(always[fam] for fam in ADAPTERS if fam != "phimoe")
    with pytest.raises(UnsupportedError, match=r"always_written names attention.dense.weight, which is no optional"):
        dataclasses.replace(ADAPTERS["mixtral"], rules=None, always_written=("attention.dense.weight",))
