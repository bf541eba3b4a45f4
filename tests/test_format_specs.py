"""What a format class answers without quantizing (``packed_specs``, ``quantized_by_builder``,
``builder_format``) against what it does when it quantizes: the checkpoint layout plans file entries
from these answers and the build estimate counts bytes with them, so they must agree with the bytes."""

from __future__ import annotations

import pytest
import torch

from trtmoe.errors import UnsupportedError
from trtmoe.quant.formats import FORMATS, PackedSpec, builder_format

SHAPES = [(256, 256), (128, 384), (96, 128), (130, 256), (512, 64), (6, 32), (200, 136)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_specs_are_what_quantize_returns(name, dtype):
    fmt = FORMATS[name]
    checked = 0
    for out_f, in_f in SHAPES:
        if fmt.shape_problem(out_f, in_f):
            with pytest.raises(UnsupportedError):
                fmt.packed_specs(out_f, in_f, dtype)
            continue
        w = torch.randn(3, out_f, in_f, generator=torch.Generator().manual_seed(out_f * in_f))
        one = fmt.quantize(w[0], dtype=dtype, input_amax=torch.rand(in_f) + 0.5)
        specs = fmt.packed_specs(out_f, in_f, dtype)
        # same keys in the same order (the order tensors are written in), shapes and dtypes
        assert list(specs) == list(one)
        assert all(specs[k][:2] == (tuple(v.shape), v.dtype) for k, v in one.items()), (specs, one)
        # shared: a stack of experts keeps one such tensor, every other tensor gains the expert dim
        stack = fmt.quantize(w, dtype=dtype, input_amax=1.0)
        for k, s in specs.items():
            assert isinstance(s, PackedSpec)
            if s.shared:
                assert stack[k].shape == s.shape and fmt.expert(stack, 1)[k] is stack[k]
            else:
                assert stack[k].shape == (3, *s.shape)
        checked += 1
    assert checked >= 3


def test_only_the_per_channel_formats_are_quantized_by_the_builder():
    assert {n for n, f in FORMATS.items() if f.quantized_by_builder} == {"int8", "int4"}
    assert builder_format("W8A16") is FORMATS["int8"] and builder_format("W4A16") is FORMATS["int4"]
    # packed at conversion (trtmoe writes their bytes), so the builder never applies them to float weights
    assert builder_format("W4A16_AWQ") is None and builder_format("FP8") is None and builder_format(None) is None
    for n, f in FORMATS.items():
        assert not (f.quantized_by_builder and f.packed_at_conversion), n
