"""Bad inputs to ``trtmoe convert`` fail through the real CLI with exit code 2, one line naming the
problem, and nothing left on disk; interrupted converts leave nothing behind (or only a stale
partial that the next run removes); converts are byte-reproducible; ``trtmoe verify`` catches
edits.

Every broken input is a copy of a tiny fixture with bytes or JSON corrupted by hand. The CLI runs
as a subprocess (``python -m trtmoe.cli``); the error cases run concurrently because each process
pays the torch import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "trtmoe.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}


def run_cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, env=ENV, cwd=REPO_ROOT,
                          timeout=timeout)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [l for l in proc.stderr.splitlines() if l.strip()]


# ---- byte-level corruption helpers --------------------------------------------------------------

def read_header(path: Path) -> tuple[dict, bytes]:
    """(header dict, data section bytes) of a safetensors file, parsed by hand."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_with_header(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d, indent=2))


def set_value(model_dir: Path, name: str, value: float) -> Path:
    """Put ``value`` into one element of tensor ``name`` of a single-file checkpoint."""
    f = model_dir / "model.safetensors"
    tensors = load_file(f)
    t = tensors[name].clone()
    t.view(-1)[t.numel() // 2 + 3] = value
    tensors[name] = t
    save_file(tensors, f, metadata={"format": "pt"})
    return f


class _Unpickled:
    """Unpickling this object creates a directory: proof that someone unpickled the file."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.mkdir, (str(self.sentinel),))


# ---- the cases ------------------------------------------------------------------------------------

@dataclass
class Case:
    args: list
    expect: list[str]  # substrings of the one-line message
    out: Path  # output directory the command was asked to write
    exit_code: int = 2
    # Directory that must hold nothing after the run (no output, no hidden partial sibling).
    clean_parent: Path | None = None
    extra: dict = field(default_factory=dict)


def _convert_case(work: Path, model: Path, expect: list[str], *layout, **extra) -> Case:
    parent = work / "outputs"
    parent.mkdir()
    out = parent / "ckpt"
    return Case(["convert", model, "-o", out, *layout], expect, out, clean_parent=parent, extra=extra)


def build_cases(tiny_model, root: Path) -> dict[str, Case]:
    mixtral = tiny_model("mixtral")
    mixtral_sharded = tiny_model("mixtral", sharded=True)
    cases: dict[str, Case] = {}

    def work(name: str) -> Path:
        p = root / name
        p.mkdir()
        return p

    # Truncated file: the last 30% of the data is gone.
    w = work("truncated")
    m = copy_model(mixtral, w / "model")
    f = m / "model.safetensors"
    os.truncate(f, int(f.stat().st_size * 0.7))
    cases["truncated"] = _convert_case(w, m, ["model.safetensors", "ends at byte", "truncated"])

    # Header lies: the last tensor claims twice its rows, so its offsets run past the file end.
    w = work("offsets_beyond_file")
    m = copy_model(mixtral, w / "model")
    header, data = read_header(m / "model.safetensors")
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    a, b = header[name]["data_offsets"]
    header[name]["shape"][0] *= 2
    header[name]["data_offsets"] = [a, a + 2 * (b - a)]
    write_with_header(m / "model.safetensors", header, data)
    size = (m / "model.safetensors").stat().st_size
    cases["offsets_beyond_file"] = _convert_case(w, m, ["model.safetensors", repr(name), "ends at byte",
                                                         f"the file has {size} bytes"])

    # Header lies: an expert's shape no longer matches its byte span.
    w = work("size_mismatch")
    m = copy_model(mixtral, w / "model")
    header, data = read_header(m / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    header[name]["shape"] = [48, 63]
    write_with_header(m / "model.safetensors", header, data)
    cases["size_mismatch"] = _convert_case(w, m, [repr(name), "hold 12288 bytes", "F32[48, 63] needs 12096"])

    # Header lies: one norm's bytes start inside another's.
    w = work("overlap")
    m = copy_model(mixtral, w / "model")
    header, data = read_header(m / "model.safetensors")
    n0, n1 = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"
    a0, b0 = header[n0]["data_offsets"]
    header[n1]["data_offsets"] = [a0 + 128, b0 + 128]
    write_with_header(m / "model.safetensors", header, data)
    cases["overlap"] = _convert_case(w, m, ["model.safetensors", "overlap", n0, n1])

    # The index names a shard that is not there.
    w = work("missing_shard")
    m = copy_model(mixtral_sharded, w / "model")
    shards = sorted(m.glob("model-*.safetensors"))
    assert len(shards) >= 3, "the sharded fixture should span several files"
    shards[1].unlink()
    cases["missing_shard"] = _convert_case(w, m, ["model.safetensors.index.json", repr(shards[1].name),
                                                   "does not exist"])

    # A tensor present in a shard is missing from the index.
    w = work("not_in_index")
    m = copy_model(mixtral_sharded, w / "model")
    name = "model.layers.2.block_sparse_moe.experts.3.w2.weight"
    edit_json(m / "model.safetensors.index.json", lambda d: d["weight_map"].pop(name))
    cases["not_in_index"] = _convert_case(w, m, ["not in the index", repr(name)])

    # The index places a tensor in the wrong shard.
    w = work("index_wrong_shard")
    m = copy_model(mixtral_sharded, w / "model")
    idx = json.loads((m / "model.safetensors.index.json").read_text())
    name = "model.layers.1.block_sparse_moe.experts.0.w3.weight"
    real = idx["weight_map"][name]
    other = next(s.name for s in sorted(m.glob("model-*.safetensors")) if s.name != real)
    edit_json(m / "model.safetensors.index.json", lambda d: d["weight_map"].__setitem__(name, other))
    cases["index_wrong_shard"] = _convert_case(w, m, [repr(name), repr(other), real])

    # One expert has the wrong shape (a consistent header, so only the config check can catch it).
    w = work("wrong_shape_expert")
    m = copy_model(mixtral, w / "model")
    tensors = load_file(m / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    tensors[name] = tensors[name][:47].contiguous()
    save_file(tensors, m / "model.safetensors", metadata={"format": "pt"})
    cases["wrong_shape_expert"] = _convert_case(w, m, [repr(name), "[47, 64]", "[48, 64]"])

    # NaN in the last expert of the last layer: found only after rank 0 has been written in full.
    w = work("nan_expert")
    m = copy_model(mixtral, w / "model")
    name = "model.layers.2.block_sparse_moe.experts.3.w2.weight"
    set_value(m, name, float("nan"))
    cases["nan_expert"] = _convert_case(w, m, [repr(name), "1 NaN and 0 Inf"], "--tp", 2, "--moe-ep", 2)

    # +Inf in a bf16 Qwen3-MoE expert deep in the file.
    w = work("inf_expert")
    m = copy_model(tiny_model("qwen3_moe", dtype="bfloat16"), w / "model")
    name = "model.layers.2.mlp.experts.7.down_proj.weight"
    set_value(m, name, float("inf"))
    cases["inf_expert"] = _convert_case(w, m, [repr(name), "0 NaN and 1 Inf"], "--tp", 2, "--moe-ep", 2)

    # A float weight whose header says I32 (same byte count): refused by name, never cast bit by bit.
    w = work("integer_dtype")
    m = copy_model(mixtral, w / "model")
    header, data = read_header(m / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.0.w2.weight"
    assert header[name]["dtype"] == "F32"
    header[name]["dtype"] = "I32"
    write_with_header(m / "model.safetensors", header, data)
    cases["integer_dtype"] = _convert_case(w, m, [repr(name), "I32", "integer"])

    # A finite fp32 value that float16 cannot hold: refused after the cast, by name.
    w = work("float16_overflow")
    m = copy_model(mixtral, w / "model")
    name = "model.embed_tokens.weight"
    set_value(m, name, 1.0e6)
    cases["float16_overflow"] = _convert_case(w, m, [repr(name), "beyond the float16 range", "1e+06"],
                                              "--dtype", "float16")

    # The same overflow in an expert quantized at conversion (the packed-format path).
    w = work("float16_overflow_packed")
    m = copy_model(mixtral, w / "model")
    name = "model.layers.2.block_sparse_moe.experts.1.w3.weight"
    set_value(m, name, -7.0e4)
    cases["float16_overflow_packed"] = _convert_case(w, m, [repr(name), "beyond the float16 range", "70000"],
                                                     "--dtype", "float16", "--policy", "uniform",
                                                     "--format", "int8", "--granularity", "expert")

    # An architecture with no adapter: the message lists the supported ones.
    w = work("unsupported_arch")
    m = copy_model(mixtral, w / "model")
    edit_json(m / "config.json", lambda d: d.update(architectures=["LlamaForCausalLM"], model_type="llama"))
    cases["unsupported_arch"] = _convert_case(w, m, [
        "'LlamaForCausalLM' is not supported", "supported:", "DeepseekForCausalLM", "MixtralForCausalLM",
        "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])

    # Pickle-only checkpoint: refused without being unpickled.
    w = work("pickle_only")
    m = w / "model"
    m.mkdir()
    shutil.copyfile(mixtral / "config.json", m / "config.json")
    sentinel = w / "unpickled"
    (m / "pytorch_model.bin").write_bytes(pickle.dumps(_Unpickled(sentinel)))
    cases["pickle_only"] = _convert_case(w, m, ["pytorch_model.bin", "pickle", "never unpickles", "safetensors"],
                                         sentinel=sentinel)

    # Impossible layouts: rejected before any work (not even the output's parent is created).
    odd = tiny_model("mixtral", num_local_experts=6, intermediate_size=42)
    for name, model, layout, expect in [
        ("experts_not_divisible_by_moe_ep", odd, ("--tp", 4, "--moe-ep", 4),
         ["num_experts=6 is not divisible by moe_ep=4"]),
        ("ffn_not_divisible_by_moe_tp", odd, ("--tp", 4, "--moe-tp", 4),
         ["expert intermediate size 42 is not divisible by moe_tp=4"]),
        ("heads_not_divisible_by_tp", mixtral, ("--tp", 3),
         ["num_attention_heads=4 is not divisible by tp=3"]),
        ("moe_product_not_tp", mixtral, ("--tp", 4, "--moe-tp", 2, "--moe-ep", 4),
         ["moe_tp × moe_ep must equal tp", "2 × 4 = 8 ≠ 4"]),
    ]:
        w = work(name)
        out = w / "not-created" / "ckpt"
        cases[name] = Case(["convert", model, "-o", out, *layout], expect, out, extra={"untouched": out.parent})

    # Existing output without --force: refused, the directory left exactly as it was.
    w = work("existing_output")
    out = w / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    cases["existing_output"] = Case(["convert", mixtral, "-o", out], ["already exists", "--force"], out,
                                    extra={"existing": True})
    return cases


@pytest.fixture(scope="module")
def error_runs(tiny_model, tmp_path_factory):
    """Build every broken input, then run all the CLI invocations concurrently."""
    cases = build_cases(tiny_model, tmp_path_factory.mktemp("bad-inputs"))
    with ThreadPoolExecutor(max_workers=4) as pool:
        procs = dict(zip(cases, pool.map(lambda c: run_cli(c.args), cases.values())))
    return {name: (cases[name], procs[name]) for name in cases}


CASE_NAMES = [
    "truncated", "offsets_beyond_file", "size_mismatch", "overlap", "missing_shard", "not_in_index",
    "index_wrong_shard", "wrong_shape_expert", "nan_expert", "inf_expert", "integer_dtype", "float16_overflow",
    "float16_overflow_packed", "unsupported_arch", "pickle_only",
    "experts_not_divisible_by_moe_ep", "ffn_not_divisible_by_moe_tp", "heads_not_divisible_by_tp",
    "moe_product_not_tp", "existing_output",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_fails_cleanly(error_runs, name):
    case, proc = error_runs[name]
    lines = error_lines(proc)
    assert proc.returncode == case.exit_code, (proc.returncode, proc.stderr)
    assert len(lines) == 1, f"expected a one-line message, got:\n{proc.stderr}"
    msg = lines[0]
    assert msg.startswith("error: ")
    assert "Traceback" not in proc.stderr
    for part in case.expect:
        assert part in msg, f"{part!r} missing from: {msg}"
    if case.clean_parent is not None:
        # Neither the output nor a hidden partial sibling (".ckpt.trtmoe-partial-…") survives.
        assert list(case.clean_parent.iterdir()) == [], list(case.clean_parent.iterdir())
    if "untouched" in case.extra:
        assert not case.extra["untouched"].exists(), "layout errors must come before creating anything"
    if case.extra.get("existing"):
        assert sorted(p.name for p in case.out.iterdir()) == ["keep.txt"]
        assert (case.out / "keep.txt").read_text() == "user data"
        assert [p.name for p in case.out.parent.iterdir()] == ["ckpt"]


def test_pickle_is_never_unpickled(error_runs):
    case, proc = error_runs["pickle_only"]
    assert proc.returncode == 2
    assert not case.extra["sentinel"].exists(), "the pickle was executed"
    # The file's payload really runs when unpickled, so the check above can fail.
    pickle.loads((case.args[1] / "pytorch_model.bin").read_bytes())
    assert case.extra["sentinel"].is_dir()


# ---- interrupted and repeated converts -------------------------------------------------------------

def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_convert", REPO_ROOT / "scripts" / "bench_convert.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def synthetic_mixtral(tmp_path_factory) -> Path:
    """A ~250 MB Mixtral-shaped bf16 checkpoint in 4 shards: big enough that a convert spends
    a second or more writing rank files, so a signal can land mid-write."""
    d = tmp_path_factory.mktemp("synthetic") / "mixtral"
    torch.set_num_threads(1)
    _bench_module().write_synthetic_mixtral(d, hidden=1024, intermediate=3584, layers=2, experts=6, vocab=8000,
                                            heads=8, kv_heads=2, shard_bytes=80 << 20)
    return d


def _start_convert(model: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "convert", str(model), "-o", str(out), "--tp", "2", "--moe-ep", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO_ROOT)


def _partials(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.trtmoe-partial-*"))


def _wait_mid_write(proc: subprocess.Popen, parent: Path, name: str, timeout: float = 180) -> Path:
    """Block until the child has written some rank bytes into its hidden partial directory."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for p in _partials(parent, name):
            rank0 = p / "rank0.safetensors"
            if rank0.is_file() and rank0.stat().st_size > (4 << 20):
                return p
        if proc.poll() is not None:
            pytest.fail(f"convert finished before it could be interrupted:\n{proc.stderr.read()}")
        time.sleep(0.005)
    proc.kill()
    pytest.fail("convert never started writing")


def _manifest_hashes(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())["files"]


def _all_bytes(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_interrupted_convert_then_rerun_is_identical(synthetic_mixtral, tmp_path):
    parents = {k: tmp_path / k for k in ("ref", "term", "kill")}
    for p in parents.values():
        p.mkdir()
    outs = {k: p / "ckpt" for k, p in parents.items()}
    # An uninterrupted reference run, and two runs to interrupt, each started only when it is next to be
    # watched (on a quiet machine a convert that waited its turn could finish before its signal).
    procs = {k: _start_convert(synthetic_mixtral, outs[k]) for k in ("ref", "term")}
    try:
        _wait_mid_write(procs["term"], parents["term"], "ckpt")
        procs["term"].send_signal(signal.SIGTERM)
        procs["kill"] = _start_convert(synthetic_mixtral, outs["kill"])
        _wait_mid_write(procs["kill"], parents["kill"], "ckpt")
        procs["kill"].send_signal(signal.SIGKILL)
        errs = {k: p.communicate(timeout=240)[1] for k, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert procs["ref"].returncode == 0, errs["ref"]

    # SIGTERM: the handler removes the partial directory; nothing at all is left.
    assert procs["term"].returncode == 130, errs["term"]
    assert "interrupted" in errs["term"]
    assert list(parents["term"].iterdir()) == []

    # SIGKILL: no final output, only the hidden partial of the dead process.
    assert procs["kill"].returncode == -signal.SIGKILL
    assert not outs["kill"].exists()
    stale = _partials(parents["kill"], "ckpt")
    assert len(stale) == 1 and (stale[0] / "rank0.safetensors").is_file()

    # The next run removes the stale partial and produces exactly the uninterrupted bytes.
    proc = run_cli(["convert", synthetic_mixtral, "-o", outs["kill"], "--tp", 2, "--moe-ep", 2])
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in parents["kill"].iterdir()] == ["ckpt"]
    assert _manifest_hashes(outs["kill"]) == _manifest_hashes(outs["ref"])
    # Two converts of the same input agree on every byte of every file, manifest.json included.
    assert _all_bytes(outs["kill"]) == _all_bytes(outs["ref"])


def test_stale_partials_of_dead_processes_are_removed(tiny_model, tmp_path):
    """A kill during ``--force`` can also strand the replaced output ("…-PID-old-HEX"); the next run
    removes both kinds when PID is dead, and leaves a live process's partial alone."""
    from trtmoe.checkpoint.writer import convert

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [tmp_path / f".ckpt.trtmoe-partial-{dead.pid}-0123abcd",
             tmp_path / f".ckpt.trtmoe-partial-{dead.pid}-old-4567ef01"]
    live = tmp_path / f".ckpt.trtmoe-partial-{os.getpid()}-89abcdef"
    for d in (*stale, live):
        d.mkdir()
        (d / "rank0.safetensors").write_bytes(b"partial")
    convert(tiny_model("mixtral"), tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "ckpt"])


@pytest.fixture(scope="module")
def converted_tiny(tiny_model, tmp_path_factory) -> Path:
    from trtmoe.checkpoint.writer import convert

    out = tmp_path_factory.mktemp("verify") / "ckpt"
    convert(tiny_model("qwen2_moe"), out, tp=2, moe_ep=2)
    return out


def test_verify_passes_then_catches_edits(converted_tiny, tmp_path):
    flipped = shutil.copytree(converted_tiny, tmp_path / "flipped")
    f = flipped / "rank1.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))

    edited = shutil.copytree(converted_tiny, tmp_path / "edited")
    edit_json(edited / "config.json", lambda d: d["mapping"].update(auto_parallel=False))

    # The same edit with the manifest re-hashed: only the schema check can still catch it.
    rehashed = shutil.copytree(edited, tmp_path / "rehashed")
    from trtmoe.hf.hashing import sha256_file

    edit_json(rehashed / "manifest.json",
              lambda d: d["files"].__setitem__("config.json", sha256_file(rehashed / "config.json")))

    with ThreadPoolExecutor(max_workers=4) as pool:
        ok, bad_rank, bad_cfg, bad_schema = pool.map(lambda d: run_cli(["verify", d]),
                                                     [converted_tiny, flipped, edited, rehashed])
    assert ok.returncode == 0, ok.stderr
    assert "match the manifest" in ok.stdout

    for proc in (bad_rank, bad_cfg, bad_schema):
        assert proc.returncode == 1, proc.stderr
        assert len(error_lines(proc)) == 1, proc.stderr
    assert "rank1.safetensors: sha256" in bad_rank.stderr
    assert "rank0.safetensors" not in bad_rank.stderr
    # An edited config.json names the file *and* what TensorRT-LLM would reject in it.
    assert "config.json: sha256" in bad_cfg.stderr
    assert "'mapping' has keys TensorRT-LLM 1.2 rejects: ['auto_parallel']" in bad_cfg.stderr
    assert "sha256" not in bad_schema.stderr
    assert "'mapping' has keys TensorRT-LLM 1.2 rejects: ['auto_parallel']" in bad_schema.stderr
