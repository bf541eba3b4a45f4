"""The convert I/O paths: every copy method gives the same bytes, ranged tensors are hashed and
NaN/Inf-checked like the rest, and a standalone rank write returns the file's sha256."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
from collections import deque
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT
from trtmoe.checkpoint import layout
from trtmoe.checkpoint import writer as W
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


def test_read_pieces_that_would_split_elements_give_the_same_hashes_and_checks(synthetic, tmp_path,
                                                                               monkeypatch):
    """The hashers read in pieces of ``_READ`` bytes; an odd size that would cut bf16 elements in two
    is pulled back to element boundaries, so the hashes and the NaN/Inf check are unchanged."""
    src, ref, _ = synthetic
    monkeypatch.setattr(W, "_READ", 1001)
    convert(src, tmp_path / "o", tp=2, moe_ep=2)
    assert _hashes(tmp_path / "o") == ref
    _manifest_matches_files(tmp_path / "o")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    with HFCheckpoint(bad) as h:
        info, path = h.info(name), h.location[name]
    with open(path, "r+b") as f:  # an element two pieces in, whatever the offsets
        f.seek(info.start + 2 * 1001)
        f.write(torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    with pytest.raises(CheckpointError, match="1 NaN and 0 Inf"):
        convert(bad, tmp_path / "b", tp=2, moe_ep=2)
    assert not (tmp_path / "b").exists()


class _CountingFollower(W._RankFollower):
    """The real follower, keeping its instances so a test can read ``shared_bytes`` afterwards."""
    made: list = []

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        _CountingFollower.made.append(self)


@pytest.fixture
def small_windows(monkeypatch):
    """64 KiB hash windows (16 MiB otherwise), so the tiny model's shared embedding spans several."""
    monkeypatch.setattr(W, "_WINDOW", 64 << 10)
    monkeypatch.setattr(W, "_RankFollower", _CountingFollower)
    _CountingFollower.made = []
    return _CountingFollower.made


def _manifest_matches_files(d: Path) -> None:
    listed = json.loads((d / "manifest.json").read_text())["files"]
    for rel, digest in listed.items():
        assert digest == hashlib.sha256((d / rel).read_bytes()).hexdigest(), rel


class _SlowFirstFollower(_CountingFollower):
    """The first rank file's follower starts late, as on a loaded machine."""

    def _follow(self, job):
        if job is self._first:
            time.sleep(0.5)
        super()._follow(job)


def test_a_late_first_follower_still_shares_its_prefix(synthetic, tmp_path, small_windows, monkeypatch):
    """A later rank's follower that starts before the first file's has kept any hash state waits for
    it instead of hashing the shared prefix itself."""
    monkeypatch.setattr(W, "_RankFollower", _SlowFirstFollower)
    src, ref, _ = synthetic
    convert(src, tmp_path / "o", tp=2, moe_ep=2)
    assert _hashes(tmp_path / "o") == ref
    _manifest_matches_files(tmp_path / "o")
    (follower,) = small_windows
    assert follower.shared_bytes >= 6 * (64 << 10)


def test_ranks_sharing_a_prefix_take_over_its_hash(synthetic, tmp_path, small_windows):
    src, ref, _ = synthetic
    convert(src, tmp_path / "o", tp=2, moe_ep=2)
    assert _hashes(tmp_path / "o") == ref
    _manifest_matches_files(tmp_path / "o")
    a, b = ((tmp_path / "o" / f"rank{r}.safetensors").read_bytes() for r in (0, 1))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    (follower,) = small_windows
    # rank1 hashed nothing of the windows it shares whole with rank0 (header + embedding, 512 KB)
    assert common - (64 << 10) <= follower.shared_bytes <= common
    assert follower.shared_bytes >= 6 * (64 << 10)


def test_a_source_changed_between_ranks_still_gets_each_files_own_hash(synthetic, tmp_path, monkeypatch,
                                                                        small_windows):
    """The shared prefix is compared on disk, not assumed from the layout: a source embedding that
    changes after rank0 is written gives rank1 other bytes, and its manifest hash is of those."""
    src, ref, _ = synthetic
    changed = tmp_path / "m"
    shutil.copytree(src, changed)
    with HFCheckpoint(changed) as h:
        info, path = h.info("model.embed_tokens.weight"), h.location["model.embed_tokens.weight"]
    real = W.write_rank

    def write_then_change(p, specs, progress=None, **kw):
        out = real(p, specs, progress, **kw)
        if p.name == "rank0.safetensors":
            with open(path, "r+b") as f:  # zeros (finite) a third into the embedding
                f.seek(info.start + info.nbytes // 3)
                f.write(bytes(4096))
        return out

    monkeypatch.setattr(W, "write_rank", write_then_change)
    convert(changed, tmp_path / "o", tp=2, moe_ep=2)
    _manifest_matches_files(tmp_path / "o")
    a, b = ((tmp_path / "o" / f"rank{r}.safetensors").read_bytes() for r in (0, 1))
    assert a[:info.nbytes // 3] == b[:info.nbytes // 3] and a != b
    assert _hashes(tmp_path / "o")["rank0.safetensors"] == ref["rank0.safetensors"]
    assert _hashes(tmp_path / "o")["rank1.safetensors"] != ref["rank1.safetensors"]
    (follower,) = small_windows
    data = 8 + int.from_bytes(b[:8], "little")  # where rank1's embedding begins
    assert 0 < follower.shared_bytes <= data + info.nbytes // 3  # stops at the changed window


@pytest.mark.parametrize("make", [
    lambda: torch.randn(700, 1000).to(torch.bfloat16)[:, 250:750],  # rows gathered through the buffer
    lambda: torch.randn(3, 300_000)[:, ::2],  # a row larger than the buffer: one contiguous copy
    lambda: torch.randn(5000).to(torch.float16)[::3],  # 1-D strided
    lambda: torch.randn(40, 6, 8).transpose(0, 1)[:, 1:],  # 3-D
])
def test_non_contiguous_writes_give_the_tensors_bytes(tmp_path, make):
    t = make()
    assert not t.is_contiguous()
    seen = []
    w = S.StreamingWriter(tmp_path / "x.safetensors", [("a", t.dtype, tuple(t.shape)), ("b", t.dtype, (2,))],
                          on_write=lambda end, n, src: seen.append((end, n)))
    w.write(t)
    w.write(torch.zeros(2, dtype=t.dtype))
    digest = w.close()
    assert digest == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    assert torch.equal(S.SafetensorsFile(tmp_path / "x.safetensors").read("a"), t)
    assert [n for _, n in seen[1:]] == [t.nbytes, 2 * t.element_size()]  # one report per chunk, after the header


def test_every_output_file_is_fsynced_before_the_swap(synthetic, tmp_path, monkeypatch):
    """config.json, the tokenizer and manifest.json are as durable as the rank files when the
    output takes its name (a power loss after the rename must not leave them empty)."""
    from trtmoe.checkpoint import atomic

    src, _, _ = synthetic
    synced, at_swap = set(), {}
    real_fsync, real_swap = os.fsync, atomic._swap_into_place

    def fsync(fd):
        synced.add(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def swap(tmp, out, **kw):
        at_swap["files"] = {os.path.realpath(p) for p in tmp.rglob("*")}
        at_swap["synced"] = set(synced)
        return real_swap(tmp, out, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(atomic, "_swap_into_place", swap)
    convert(src, tmp_path / "o", tp=2, moe_ep=2)
    assert {Path(p).name for p in at_swap["files"]} >= {"config.json", "manifest.json", "rank0.safetensors"}
    assert at_swap["files"] - at_swap["synced"] == set()


def _big_header_file(path: Path, n: int = 3000) -> Path:
    from safetensors.torch import save_file

    save_file({f"t{i}": torch.full((2,), float(i)) for i in range(n)}, str(path))
    return path


def test_a_large_header_is_validated_once_per_version_of_its_bytes(tmp_path, monkeypatch):
    """A file opened again with the same header bytes and size reuses its validated header (convert
    reopens calibration's activations file per MoE layer); any change to either validates again."""
    p = _big_header_file(tmp_path / "a.safetensors")
    monkeypatch.setattr(S, "_HEADER_CACHE", deque())  # nothing kept from other tests
    calls = []
    real = S.SafetensorsFile._validate_header
    monkeypatch.setattr(S.SafetensorsFile, "_validate_header",
                        lambda self, *a: calls.append(self.path) or real(self, *a))
    first = S.SafetensorsFile(p)
    assert S.SafetensorsFile(p).tensors is first.tensors
    assert len(calls) == 1
    assert torch.equal(S.SafetensorsFile(p).read("t7"), torch.full((2,), 7.0))
    with pytest.raises(TypeError):
        first.tensors["x"] = None  # shared, so read-only
    n = len(calls)
    copy = tmp_path / "b.safetensors"  # the same bytes elsewhere: nothing to parse again
    shutil.copyfile(p, copy)
    S.SafetensorsFile(copy).close()
    assert len(calls) == n
    # The same header in a shorter file: validated again, and refused.
    data = p.read_bytes()
    short = tmp_path / "short.safetensors"
    short.write_bytes(data[:-4])
    with pytest.raises(CheckpointError, match="ends at byte"):
        S.SafetensorsFile(short)
    assert len(calls) == n + 1
    # One header byte changed in place, same size: validated again (a shape that no longer fits).
    raw = bytearray(data)
    at = raw.index(b'"shape":[2]')
    raw[at + 9] = ord("3")
    p.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="needs"):
        S.SafetensorsFile(p)
    assert len(calls) == n + 2


def test_the_header_cache_keeps_a_bounded_number_of_bytes(tmp_path, monkeypatch):
    """Headers are kept until their bytes pass the bound, the oldest dropped first; a header larger
    than the whole bound is never kept."""
    monkeypatch.setattr(S, "_HEADER_CACHE", deque())
    files = [_big_header_file(tmp_path / f"{i}.safetensors", n=3000 + i) for i in range(3)]
    sizes = [struct.unpack("<Q", f.read_bytes()[:8])[0] for f in files]
    monkeypatch.setattr(S, "_HEADER_CACHE_BYTES", sizes[1] + sizes[2])
    for f in files:
        S.SafetensorsFile(f).close()
    assert [len(r) for _, r, _ in S._HEADER_CACHE] == sizes[1:]  # the first was dropped for the third
    monkeypatch.setattr(S, "_HEADER_CACHE", deque())
    monkeypatch.setattr(S, "_HEADER_CACHE_BYTES", sizes[0] - 1)
    S.SafetensorsFile(files[0]).close()
    assert not S._HEADER_CACHE
