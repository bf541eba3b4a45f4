"""The convert I/O paths: every copy method gives the same bytes, ranged tensors are hashed and
NaN/Inf-checked like the rest, and a standalone rank write returns the file's sha256."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT
from trtmoe.checkpoint import layout
from trtmoe.checkpoint.writer import convert, write_rank
from trtmoe.errors import CheckpointError
from trtmoe.hf import safetensors_io as S
from trtmoe.hf.reader import HFCheckpoint
from trtmoe.parallel.mapping import Mapping


def _bench():
    spec = importlib.util.spec_from_file_location("bench_convert", REPO_ROOT / "scripts" / "bench_convert.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("io")
    src = _bench().write_synthetic_mixtral(root / "m", hidden=256, intermediate=768, layers=2, experts=4,
                                           vocab=1000, heads=4, kv_heads=2, shard_bytes=4 << 20)
    convert(src, root / "ref", tp=2, moe_ep=2)
    return src, _hashes(root / "ref"), root


@pytest.mark.parametrize("methods,bounce_misaligned", [
    (["sendfile", "pread"], False), (["pread"], False), (["copy_file_range", "sendfile", "pread"], True),
    (["copy_file_range", "sendfile", "pread"], False)])
def test_every_copy_method_gives_identical_bytes(synthetic, tmp_path, monkeypatch, methods, bounce_misaligned):
    src, ref, _ = synthetic
    monkeypatch.setattr(S, "_copy_methods", list(methods))
    monkeypatch.setattr(S, "_BOUNCE_MISALIGNED", bounce_misaligned)
    convert(src, tmp_path / "o", tp=2, moe_ep=2)
    assert _hashes(tmp_path / "o") == ref


def test_standalone_write_rank_and_ranges(synthetic, tmp_path):
    src, ref, _ = synthetic
    with HFCheckpoint(src) as h:
        specs = layout.rank_specs(h.model, Mapping.create(2, 1, None, 2), 1, torch.bfloat16, h)
        digest = write_rank(tmp_path / "r1.safetensors", specs)
        assert digest == ref["rank1.safetensors"]
        name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
        rng = h.byte_range(name, (5, 300))
        w = S.StreamingWriter(tmp_path / "x.safetensors", [("a", torch.bfloat16, (295, 256)),
                                                           ("b", torch.float32, (3,))])
        w.write_range(rng)
        w.write(torch.ones(3))
        assert w.close() == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
        assert torch.equal(S.SafetensorsFile(tmp_path / "x.safetensors").read("a"), h.read(name)[5:300])


@pytest.mark.parametrize("name,where,value", [
    ("model.layers.1.block_sparse_moe.experts.3.w2.weight", "first", float("nan")),
    ("model.layers.1.block_sparse_moe.experts.3.w2.weight", "last", float("inf")),
    ("model.layers.0.block_sparse_moe.experts.0.w3.weight", "middle", float("-inf")),
    ("lm_head.weight", "last", float("nan")),
])
def test_nonfinite_in_copied_ranges_is_caught_and_nothing_is_left(synthetic, tmp_path, name, where, value):
    src, _, _ = synthetic
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    with HFCheckpoint(bad) as h:
        info, path = h.info(name), h.location[name]
    n = 1
    for s in info.shape:
        n *= s
    idx = {"first": 0, "last": n - 1, "middle": n // 2}[where]
    with open(path, "r+b") as f:
        f.seek(info.start + 2 * idx)
        f.write(torch.tensor([value], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    parent = tmp_path / "out"
    parent.mkdir()
    with pytest.raises(CheckpointError) as e:
        convert(bad, parent / "ck", tp=2, moe_ep=2)
    want = "1 NaN and 0 Inf" if value != value else "0 NaN and 1 Inf"
    assert repr(name) in str(e.value) and want in str(e.value)
    assert list(parent.iterdir()) == []
