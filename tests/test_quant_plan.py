"""A quantization plan is a value: checked when made, bound to a model and layout by making a new
plan, never changed in place — so what it says does not depend on the order it was asked in."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trtmoe.errors import InputError
from trtmoe.model.description import ModelSpec
from trtmoe.parallel.mapping import Mapping
from trtmoe.quant.plan import QuantPlan

SPEC = ModelSpec(family="mixtral", hf_architecture="MixtralForCausalLM", vocab_size=64, hidden_size=128,
                 num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=4, top_k=2,
                 expert_intermediate_size=128, normalization_mode=1, moe_layers=(True, False, True),
                 dense_intermediate_size=64)


def _plan(**kw) -> QuantPlan:
    return QuantPlan({0: ["int8", "int4", "float", "int8"], 2: ["int4_g128"] * 4}, granularity="expert", **kw)


def test_a_plan_cannot_be_changed_in_place():
    p = _plan()
    for name, value in (("formats", {}), ("permutations", {0: [1, 0, 2, 3]}), ("granularity", "layer"),
                        ("meta", {})):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(p, name, value)


def test_bind_makes_a_new_plan_and_answers_the_same_whenever_asked():
    p = _plan(meta={"policy": "graded"})
    with pytest.raises(TypeError, match="not bound"):
        p.manifest_entry()
    b = p.bind(SPEC, Mapping.create(2, 1, 1, 2), torch.bfloat16)
    assert b is not p and p.model is None and b.model is SPEC and b.dtype == torch.bfloat16
    assert dataclasses.replace(b, dtype=p.dtype) == p  # binding adds what it is written for, not what it is
    first = (b.manifest_entry(), b.quantization_config(), b.config_extra(), b.exclude_modules())
    again = (b.manifest_entry(), b.quantization_config(), b.config_extra(), b.exclude_modules())
    assert first == again
    # The dense layer is excluded by name; the float expert makes it mixed precision.
    assert "transformer.layers.1.mlp*" in b.exclude_modules()
    assert b.quantization_config()["quant_algo"] == "MIXED_PRECISION"
    # A second binding to another layout does not disturb the first.
    other = p.bind(SPEC, Mapping.create(1))
    assert b.mapping.moe_ep_size == 2 and other.mapping.moe_ep_size == 1


def test_placement_makes_a_new_plan_and_is_checked():
    p = _plan()
    q = p.placed({0: [3, 2, 1, 0]}, {0: {"max_load": 0.5}})
    assert p.permutations == {} and q.permutations == {0: [3, 2, 1, 0]}
    assert q.meta["placement"] == {"0": {"max_load": 0.5}} and "placement" not in p.meta
    assert q.slot_matrix_format(0, 0, "fc", 4) == "int8" and q.slot_matrix_format(0, 1, "fc", 4) == "float"
    with pytest.raises(InputError, match="not a permutation"):
        p.placed({0: [0, 0, 1, 2]})


def test_binding_checks_the_plan_against_the_model():
    with pytest.raises(InputError, match="not a MoE layer"):
        QuantPlan({1: ["int8"] * 4}).bind(SPEC, Mapping.create(1))
    with pytest.raises(InputError, match="3 formats for 4 experts"):
        QuantPlan({0: ["int8"] * 3}).bind(SPEC, Mapping.create(1))
