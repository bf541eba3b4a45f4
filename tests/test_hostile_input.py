"""Hostile input to every command, through the real CLI (in process, click's CliRunner).

Each case builds one broken input from a tiny fixture (config.json values and types, index files,
safetensors headers and bytes, manifests, calib.json, YAML build configs, option values, paths),
runs one command under a hang guard, and checks what a user would see:

* exit code 2 (bad input) or 1 (an OS error or a failed check), never 0;
* exactly one line on stderr, starting with ``error:``, with no traceback and no "internal error";
* the line names the file and key (a few words each case expects);
* nothing left behind: no output, no hidden partial sibling, no trtmoe directory in the temp
  directory, and every input file byte-identical to what it was before.

The base artifacts (a tiny model with a tokenizer, its calibration, checkpoint and embedded
engine) are built once per module; a case links their files into its own folder, and replaces a
file (never edits it in place) to corrupt it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from conftest import tiny_mixtral_engine
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from trtmoe.cli import main

REPO_ROOT = Path(__file__).resolve().parents[1]
HANG_SECONDS = 30


# ---- building blocks ----------------------------------------------------------------------------

def link_tree(src: Path, dst: Path) -> Path:
    """``src`` recreated at ``dst`` with every regular file hard-linked (cheap, and safe as long as
    files are replaced, never edited in place)."""
    for p in sorted(src.rglob("*")):
        q = dst / p.relative_to(src)
        if p.is_dir() and not p.is_symlink():
            q.mkdir(parents=True, exist_ok=True)
        else:
            q.parent.mkdir(parents=True, exist_ok=True)
            os.link(p, q)
    dst.mkdir(parents=True, exist_ok=True)
    return dst


def put(path: Path, data: bytes | str) -> None:
    """Replace ``path`` with new content (a fresh inode: the hard-linked original stays intact)."""
    if os.path.lexists(path):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def put_json(path: Path, obj) -> None:
    put(path, json.dumps(obj, indent=1))


def edit_json(path: Path, fn: Callable) -> None:
    """``fn`` mutates the parsed value in place."""
    d = json.loads(path.read_text())
    fn(d)
    put_json(path, d)


def read_st(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path: Path, header, data: bytes, *, raw_header: bytes | None = None) -> None:
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    put(path, struct.pack("<Q", len(h)) + h + data)


def edit_st(path: Path, fn: Callable[[dict], None]) -> None:
    header, data = read_st(path)
    fn(header)
    write_st(path, header, data)


def set_tensor_value(path: Path, name: str, value: float) -> None:
    tensors = load_file(path)
    t = tensors[name].clone()
    t.view(-1)[t.numel() // 2] = value
    tensors[name] = t
    path.unlink()
    save_file(tensors, path, metadata={"format": "pt"})


def snapshot(root: Path) -> dict[str, str]:
    """Every regular file under ``root`` (links not followed, special files not opened) -> sha256."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + dirnames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISDIR(st.st_mode):
                out[rel] = "dir"
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
            else:
                out[rel] = f"mode {stat.S_IFMT(st.st_mode)}"
    return out


# ---- the module's base artifacts ----------------------------------------------------------------

@dataclass
class Base:
    mix: Path  # tiny Mixtral, float32, one file
    mix_sharded: Path
    qwen: Path
    ds: Path
    tokm: Path  # tiny Mixtral with vocab 2048 and the trained fixture's tokenizer
    text: Path  # calibration text
    calib: Path  # `trtmoe calibrate tokm`
    ckpt: Path  # `trtmoe convert tokm`
    engine: Path  # `trtmoe build ckpt --backend embedded`
    bench: Path  # a minimal scripts/bench_quant.py JSON
    tmp: Path  # the temp directory every case runs with


@pytest.fixture(scope="module")
def base(tiny_model, tmp_path_factory, one_torch_thread) -> Base:
    from trtmoe.quant.calibrate import calibrate

    root = tmp_path_factory.mktemp("hostile-base")
    tokm, text, ckpt, engine = tiny_mixtral_engine(tiny_model, root, "tokm")
    calibrate(tokm, text, root / "calib", samples=2, seq_len=16, formats=("int8", "int4"))
    bench = root / "bench.json"
    bench.write_text(json.dumps({"rows": [], "targets": []}))
    tmp = root / "tmpdir"
    tmp.mkdir()
    return Base(tiny_model("mixtral"), tiny_model("mixtral", sharded=True), tiny_model("qwen2_moe"),
                tiny_model("deepseek_v1"), tokm, text, root / "calib", ckpt, engine, bench, tmp)


# ---- cases ----------------------------------------------------------------------------------------

@dataclass
class Case:
    id: str
    make: Callable[[Path, Base], list]  # builds the inputs in a fresh folder, returns the CLI args
    code: int = 2
    expect: tuple[str, ...] = ()  # words the error line must contain


CASES: list[Case] = []


def case(id: str, make, code: int = 2, expect=()):
    assert id not in {c.id for c in CASES}, id
    CASES.append(Case(id, make, code, tuple(expect)))


def out_of(w: Path, name: str = "out") -> Path:
    """The output path of a case: inside ``w/outs``, which must stay empty."""
    return w / "outs" / name


# -- config.json: values and types (inspect and convert) --

def model_with(src_attr: str, mutate: Callable[[Path], None]):
    def make_model(w: Path, b: Base) -> Path:
        m = link_tree(getattr(b, src_attr), w / "model")
        mutate(m)
        return m
    return make_model


def cfg_set(**kv):
    def mutate(m: Path):
        def fn(d):
            for k, v in kv.items():
                if v is _DELETE:
                    d.pop(k, None)
                else:
                    d[k] = v
        edit_json(m / "config.json", fn)
    return mutate


def cfg_raw(data: bytes | str):
    return lambda m: put(m / "config.json", data)


def cfg_text_value(key: str, literal: str):
    """config.json with ``key`` set to a raw JSON literal (NaN, 1e400, ...)."""
    def mutate(m: Path):
        d = json.loads((m / "config.json").read_text())
        d[key] = "@@"
        put(m / "config.json", json.dumps(d).replace('"@@"', literal))
    return mutate


_DELETE = object()

CONFIG_MUTATIONS: list[tuple[str, str, Callable, tuple]] = [
    ("top_list", "mix", cfg_raw("[]"), ("config.json", "JSON object")),
    ("top_number", "mix", cfg_raw("42"), ("config.json", "JSON object")),
    ("top_string", "mix", cfg_raw('"mixtral"'), ("config.json", "JSON object")),
    ("top_null", "mix", cfg_raw("null"), ("config.json", "JSON object")),
    ("empty_file", "mix", cfg_raw(b""), ("config.json", "JSON")),
    ("not_utf8", "mix", cfg_raw(b'{"a": "\xff\xfe"}'), ("config.json", "UTF-8")),
    ("invalid_json", "mix", cfg_raw("{"), ("config.json", "JSON")),
    ("nested_too_deep", "mix", cfg_raw("[" * 200000), ("config.json",)),
    ("is_directory", "mix", lambda m: (put(m / "config.json", b""), (m / "config.json").unlink(),
                                       (m / "config.json").mkdir()), ("config.json",)),
    ("missing", "mix", lambda m: (m / "config.json").unlink(), ("config.json",)),
    ("hidden_size_str", "mix", cfg_set(hidden_size="abc"), ("hidden_size", "integer")),
    ("hidden_size_fraction", "mix", cfg_set(hidden_size=64.9), ("hidden_size", "64.9")),
    ("hidden_size_zero", "mix", cfg_set(hidden_size=0), ("hidden_size",)),
    ("hidden_size_negative", "mix", cfg_set(hidden_size=-64), ("hidden_size",)),
    ("hidden_size_bool", "mix", cfg_set(hidden_size=True), ("hidden_size",)),
    ("hidden_size_list", "mix", cfg_set(hidden_size=[64]), ("hidden_size",)),
    ("hidden_size_inf", "mix", cfg_text_value("hidden_size", "1e400"), ("hidden_size",)),
    ("hidden_size_nan", "mix", cfg_text_value("hidden_size", "NaN"), ("hidden_size",)),
    ("hidden_size_mismatch", "mix", cfg_set(hidden_size=80), ("shape",)),
    ("hidden_size_missing", "mix", cfg_set(hidden_size=_DELETE), ("hidden_size",)),
    ("layers_zero", "mix", cfg_set(num_hidden_layers=0), ("num_hidden_layers",)),
    ("layers_huge", "mix", cfg_set(num_hidden_layers=10 ** 12), ("num_hidden_layers",)),
    ("layers_more_than_weights", "mix", cfg_set(num_hidden_layers=4), ("missing",)),
    ("layers_fewer_than_weights", "mix", cfg_set(num_hidden_layers=2), ("not understood",)),
    ("layers_str", "mix", cfg_set(num_hidden_layers="3"), ("num_hidden_layers",)),
    ("layers_missing", "mix", cfg_set(num_hidden_layers=_DELETE), ("num_hidden_layers",)),
    ("heads_zero", "mix", cfg_set(num_attention_heads=0), ("num_attention_heads",)),
    ("heads_mismatch", "mix", cfg_set(num_attention_heads=3), ("shape",)),
    ("heads_float", "mix", cfg_set(num_attention_heads=4.5), ("num_attention_heads",)),
    ("kv_heads_more_than_heads", "mix", cfg_set(num_key_value_heads=8), ("k_proj",)),
    ("kv_heads_not_dividing", "mix", cfg_set(num_key_value_heads=3), ("k_proj",)),
    ("kv_heads_zero", "mix", cfg_set(num_key_value_heads=0), ("num_key_value_heads",)),
    ("head_dim_zero", "mix", cfg_set(head_dim=0), ("head_dim",)),
    ("head_dim_mismatch", "mix", cfg_set(head_dim=17), ("shape",)),
    ("vocab_zero", "mix", cfg_set(vocab_size=0), ("vocab_size",)),
    ("vocab_mismatch", "mix", cfg_set(vocab_size=251), ("shape",)),
    ("vocab_str", "mix", cfg_set(vocab_size="250"), ("vocab_size",)),
    ("vocab_missing", "mix", cfg_set(vocab_size=_DELETE), ("vocab_size",)),
    ("experts_zero", "mix", cfg_set(num_local_experts=0), ("num_local_experts",)),
    ("experts_fewer", "mix", cfg_set(num_local_experts=3), ("gate.weight",)),
    ("experts_more", "mix", cfg_set(num_local_experts=5), ("missing",)),
    ("experts_str", "mix", cfg_set(num_local_experts="4"), ("num_local_experts",)),
    ("experts_missing", "mix", cfg_set(num_local_experts=_DELETE), ("num_local_experts",)),
    ("top_k_zero", "mix", cfg_set(num_experts_per_tok=0), ("num_experts_per_tok",)),
    ("top_k_above_experts", "mix", cfg_set(num_experts_per_tok=5), ("num_experts_per_tok",)),
    ("top_k_fraction", "mix", cfg_set(num_experts_per_tok=2.5), ("num_experts_per_tok",)),
    ("ffn_mismatch", "mix", cfg_set(intermediate_size=47), ("shape",)),
    ("ffn_zero", "mix", cfg_set(intermediate_size=0), ("intermediate_size",)),
    ("ffn_missing", "mix", cfg_set(intermediate_size=_DELETE), ("intermediate_size",)),
    ("context_zero", "mix", cfg_set(max_position_embeddings=0), ("max_position_embeddings",)),
    ("context_negative", "mix", cfg_set(max_position_embeddings=-1), ("max_position_embeddings",)),
    ("context_str", "mix", cfg_set(max_position_embeddings="4096"), ("max_position_embeddings",)),
    ("context_fraction", "mix", cfg_set(max_position_embeddings=1.5), ("max_position_embeddings",)),
    ("rope_theta_zero", "mix", cfg_set(rope_theta=0), ("rope_theta",)),
    ("rope_theta_negative", "mix", cfg_set(rope_theta=-1.0), ("rope_theta",)),
    ("rope_theta_str", "mix", cfg_set(rope_theta="x"), ("rope_theta",)),
    ("rope_theta_nan", "mix", cfg_text_value("rope_theta", "NaN"), ("rope_theta",)),
    ("rope_theta_bool", "mix", cfg_set(rope_theta=True), ("rope_theta",)),
    ("norm_eps_zero", "mix", cfg_set(rms_norm_eps=0), ("rms_norm_eps",)),
    ("norm_eps_str", "mix", cfg_set(rms_norm_eps="1e-6"), ("rms_norm_eps",)),
    ("norm_eps_negative", "mix", cfg_set(rms_norm_eps=-1e-6), ("rms_norm_eps",)),
    ("eos_outside_vocab", "mix", cfg_set(eos_token_id=250), ("eos_token_id", "vocabulary")),
    ("eos_negative", "mix", cfg_set(eos_token_id=-1), ("eos_token_id",)),
    ("eos_str", "mix", cfg_set(eos_token_id="2"), ("eos_token_id",)),
    ("eos_list_outside", "mix", cfg_set(eos_token_id=[1, 999]), ("eos_token_id",)),
    ("eos_fraction", "mix", cfg_set(eos_token_id=2.5), ("eos_token_id",)),
    ("bos_outside_vocab", "mix", cfg_set(bos_token_id=1000), ("bos_token_id",)),
    ("architectures_string", "mix", cfg_set(architectures="MixtralForCausalLM"),
     ("architectures", "string", "MixtralForCausalLM")),
    # Empty architectures: the model_type names the model (as for transformers); without one, refused.
    ("architectures_empty", "mix", cfg_set(architectures=[], model_type=_DELETE), ("architecture", "model_type")),
    ("architectures_number", "mix", cfg_set(architectures=[1]), ("architectures",)),
    ("architectures_unknown", "mix", cfg_set(architectures=["LlamaForCausalLM"], model_type="llama"),
     ("LlamaForCausalLM",)),
    # An architecture with no adapter is named before any value check: no value would make it convert.
    ("architectures_unknown_with_bad_values", "mix",
     cfg_set(architectures=["GptOssForCausalLM"], model_type="gpt_oss", sliding_window=16, eos_token_id=999),
     ("'GptOssForCausalLM' is not supported", "supported:")),
    ("architectures_two", "mix", cfg_set(architectures=["MixtralForCausalLM", "Qwen2MoeForCausalLM"]),
     ("architectures",)),
    ("architectures_missing", "mix", cfg_set(architectures=_DELETE, model_type=_DELETE), ("architecture",)),
    ("model_type_number", "mix", cfg_set(model_type=5), ("model_type",)),
    ("model_type_contradicts", "mix", cfg_set(model_type="qwen2_moe"), ("model_type",)),
    ("sliding_window_small", "mix", cfg_set(sliding_window=16), ("sliding_window",)),
    ("sliding_window_str", "mix", cfg_set(sliding_window="x"), ("sliding_window",)),
    ("sliding_window_negative", "mix", cfg_set(sliding_window=-1), ("sliding_window",)),
    ("rope_scaling_list", "mix", cfg_set(rope_scaling=[1, 2]), ("rope_scaling",)),
    ("rope_scaling_unknown_type", "mix", cfg_set(rope_scaling={"rope_type": "spiral", "factor": 2.0}),
     ("rope_scaling", "spiral")),
    ("rope_scaling_conflict", "mix", cfg_set(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
     ("rope_scaling", "rope_parameters")),
    ("rope_theta_conflict", "mix", cfg_set(rope_theta=500.0),
     ("rope_theta",)),
    ("tie_embeddings_str", "mix", cfg_set(tie_word_embeddings="yes"), ("tie_word_embeddings",)),
    ("hidden_act_unknown", "mix", cfg_set(hidden_act="spiral"), ("hidden_act", "spiral")),
    ("hidden_act_number", "mix", cfg_set(hidden_act=1), ("hidden_act",)),
    ("torch_dtype_number", "mix", cfg_set(torch_dtype=5), ("torch_dtype",)),
    ("qwen_shared_ffn_mismatch", "qwen", cfg_set(shared_expert_intermediate_size=64), ("shape",)),
    ("qwen_sparse_step_zero", "qwen", cfg_set(decoder_sparse_step=0), ("decoder_sparse_step",)),
    ("qwen_mlp_only_str", "qwen", cfg_set(mlp_only_layers=["a"]), ("mlp_only_layers",)),
    ("qwen_mlp_only_out_of_range", "qwen", cfg_set(mlp_only_layers=[99]), ("mlp_only_layers", "99")),
    ("qwen_norm_topk_str", "qwen", cfg_set(norm_topk_prob="no"), ("norm_topk_prob",)),
    ("qwen_moe_ffn_mismatch", "qwen", cfg_set(moe_intermediate_size=47), ("shape",)),
    ("qwen_experts_zero", "qwen", cfg_set(num_experts=0), ("num_experts",)),
    ("ds_first_dense_beyond", "ds", cfg_set(first_k_dense_replace=99), ("missing",)),
    ("ds_layer_freq_zero", "ds", cfg_set(moe_layer_freq=0), ("moe_layer_freq",)),
    ("ds_shared_negative", "ds", cfg_set(n_shared_experts=-1), ("n_shared_experts",)),
    ("ds_routed_str", "ds", cfg_set(n_routed_experts="4"), ("n_routed_experts",)),
    ("ds_scoring_unknown", "ds", cfg_set(scoring_func="spiral"), ("scoring_func", "spiral")),
]

# inspect counts a MoE that transformers implements outside the registry from its config, so it checks
# that config's values instead of refusing the architecture.
INSPECT_EXPECT = {"architectures_unknown_with_bad_values": ("eos_token_id", "outside the vocabulary")}

for _id, _src, _mut, _exp in CONFIG_MUTATIONS:
    _mk = model_with(_src, _mut)
    case(f"inspect-config-{_id}", lambda w, b, mk=_mk: ["inspect", mk(w, b)], 2, INSPECT_EXPECT.get(_id, _exp))
    case(f"convert-config-{_id}", lambda w, b, mk=_mk: ["convert", mk(w, b), "-o", out_of(w)], 2, _exp)


# -- model.safetensors.index.json (convert of the sharded fixture) --

INDEX = "model.safetensors.index.json"


def idx_edit(fn):
    return lambda m: edit_json(m / INDEX, fn)


def _first_shard(d):
    return sorted(set(d["weight_map"].values()))[0]


INDEX_MUTATIONS = [
    ("index_list", lambda m: put_json(m / INDEX, []), (INDEX, "weight_map")),
    ("index_number", lambda m: put_json(m / INDEX, 7), (INDEX, "weight_map")),
    ("index_not_json", lambda m: put(m / INDEX, "{weight_map"), (INDEX, "JSON")),
    ("index_not_utf8", lambda m: put(m / INDEX, b"\xff\xff"), (INDEX, "UTF-8")),
    ("index_is_directory", lambda m: (put(m / INDEX, b""), (m / INDEX).unlink(), (m / INDEX).mkdir()), (INDEX,)),
    ("weight_map_list", idx_edit(lambda d: d.__setitem__("weight_map", list(d["weight_map"]))), ("weight_map",)),
    ("weight_map_missing", idx_edit(lambda d: d.pop("weight_map")), ("weight_map",)),
    ("weight_map_null", idx_edit(lambda d: d.__setitem__("weight_map", None)), ("weight_map",)),
    ("weight_map_empty", idx_edit(lambda d: d.__setitem__("weight_map", {})), ("not in the index",)),
    ("shard_name_number", idx_edit(lambda d: d["weight_map"].__setitem__(next(iter(d["weight_map"])), 3)),
     ("weight_map[",)),
    ("shard_name_empty", idx_edit(lambda d: d["weight_map"].__setitem__(next(iter(d["weight_map"])), "")),
     ("weight_map[",)),
    ("shard_name_parent", idx_edit(lambda d: d["weight_map"].__setitem__(
        next(iter(d["weight_map"])), "../" + _first_shard(d))), ("weight_map[",)),
    ("shard_name_absolute", idx_edit(lambda d: d["weight_map"].__setitem__(next(iter(d["weight_map"])),
                                                                           "/etc/hostname")), ("weight_map[",)),
    ("shard_absent", idx_edit(lambda d: d["weight_map"].__setitem__(next(iter(d["weight_map"])),
                                                                    "model-99999-of-99999.safetensors")),
     ("does not exist",)),
    ("tensor_in_wrong_shard", lambda m: edit_json(m / INDEX, lambda d: d["weight_map"].__setitem__(
        "model.norm.weight", next(s for s in sorted(set(d["weight_map"].values()))
                                  if s != d["weight_map"]["model.norm.weight"]))), ("model.norm.weight",)),
    ("tensor_not_in_shards", idx_edit(lambda d: d["weight_map"].__setitem__("model.ghost.weight",
                                                                            _first_shard(d))), ("model.ghost.weight",)),
    ("tensor_missing_from_index", idx_edit(lambda d: d["weight_map"].pop("model.norm.weight")),
     ("not in the index",)),
    ("index_missing", lambda m: (m / INDEX).unlink(), ("no model.safetensors.index.json",)),
    ("shard_missing", lambda m: sorted(m.glob("model-*.safetensors"))[1].unlink(), ("does not exist",)),
]

for _id, _mut, _exp in INDEX_MUTATIONS:
    _mk = model_with("mix_sharded", _mut)
    case(f"convert-index-{_id}", lambda w, b, mk=_mk: ["convert", mk(w, b), "-o", out_of(w)], 2, _exp)


# -- safetensors headers and bytes (convert of the one-file fixture) --

ST = "model.safetensors"
EXPERT = "model.layers.1.block_sparse_moe.experts.2.w1.weight"  # F32 [48, 64]
NORM0, NORM1 = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"


def st_header(fn):
    return lambda m: edit_st(m / ST, fn)


def st_raw_header(raw: bytes):
    def mutate(m: Path):
        _, data = read_st(m / ST)
        write_st(m / ST, None, data, raw_header=raw)
    return mutate


def st_length(n: int):
    def mutate(m: Path):
        raw = (m / ST).read_bytes()
        put(m / ST, struct.pack("<Q", n) + raw[8:])
    return mutate


def _set(name, **kv):
    return lambda h: h[name].update(kv)


def _last_tensor(h):
    return max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])


def _grow_last(h):
    n = _last_tensor(h)
    a, b = h[n]["data_offsets"]
    h[n]["shape"][0] *= 2
    h[n]["data_offsets"] = [a, a + 2 * (b - a)]


def _overlap(h):
    a0, b0 = h[NORM0]["data_offsets"]
    h[NORM1]["data_offsets"] = [a0 + 128, b0 + 128]


def _swap_offsets(h):
    a, b = h[EXPERT]["data_offsets"]
    h[EXPERT]["data_offsets"] = [b, a]


def _fifo(m: Path):
    os.mkfifo(m / "extra.safetensors")


def _special(kind):
    def mutate(m: Path):
        p = m / "extra.safetensors"
        if kind == "dir":
            p.mkdir()
        elif kind == "chardev":
            p.symlink_to("/dev/zero")
        elif kind == "dangling":
            p.symlink_to(m / "nowhere.safetensors")
        elif kind == "loop":
            p.symlink_to(p)
    return mutate


def _duplicate_shard(m: Path):
    """A second file holding a tensor the first one also has."""
    t = load_file(m / ST)
    save_file({NORM0: t[NORM0]}, m / "model-extra.safetensors")


def _drop_tensor(h):
    h.pop(EXPERT)


def _extra_tensor(h):
    h["model.layers.0.ghost.weight"] = dict(h[NORM0])


def _to_f8(h):
    # The same bytes as a valid float8 tensor: 4x the elements at 1 byte each.
    h[EXPERT]["dtype"] = "F8_E4M3"
    h[EXPERT]["shape"] = [48, 256]


def _pickle_only(m: Path):
    (m / ST).unlink()
    put(m / "pytorch_model.bin", b"\x80\x04K\x01.")


ST_MUTATIONS = [
    ("empty_file", lambda m: put(m / ST, b""), (ST, "too short")),
    ("seven_bytes", lambda m: put(m / ST, b"\x08\x00\x00\x00\x00\x00\x00"), (ST, "too short")),
    ("truncated_data", lambda m: os.truncate(m / ST, 0) if False else put(m / ST, (m / ST).read_bytes()[:-1000]),
     (ST, "ends at byte")),
    ("truncated_header", lambda m: put(m / ST, (m / ST).read_bytes()[:40]), (ST, "header length")),
    ("header_length_huge", st_length(2 ** 63), (ST, "header length")),
    ("header_length_past_end", st_length(10 ** 9), (ST, "header length")),
    ("header_length_zero", st_length(0), (ST, "JSON")),
    ("header_not_json", st_raw_header(b"{not json"), (ST, "JSON")),
    ("header_not_utf8", st_raw_header(b'{"\xff": 1}'), (ST, "JSON")),
    ("header_a_list", st_raw_header(b"[]"), (ST, "object")),
    ("header_nested_deep", st_raw_header(b"[" * 100000), (ST,)),
    ("entry_a_number", st_header(lambda h: h.__setitem__(EXPERT, 5)), (EXPERT,)),
    ("dtype_unknown", st_header(_set(EXPERT, dtype="XYZ")), (EXPERT, "XYZ")),
    ("dtype_missing", st_header(lambda h: h[EXPERT].pop("dtype")), (EXPERT,)),
    ("dtype_float8", st_header(_to_f8), (EXPERT, "F8_E4M3", "float weights only")),
    ("dtype_integer", st_header(_set(EXPERT, dtype="I32")), (EXPERT, "I32", "integer")),
    ("dtype_bool", st_header(lambda h: h[EXPERT].update(dtype="BOOL", shape=[48, 256])), (EXPERT,)),
    ("shape_negative", st_header(_set(EXPERT, shape=[-48, -64])), (EXPERT,)),
    ("shape_string", st_header(_set(EXPERT, shape="48x64")), (EXPERT,)),
    ("shape_fraction", st_header(_set(EXPERT, shape=[48.5, 64])), (EXPERT,)),
    ("shape_mismatch_bytes", st_header(_set(EXPERT, shape=[48, 63])), (EXPERT, "needs")),
    ("shape_consistent_but_wrong", None, (EXPERT, "[47, 64]")),  # filled below
    ("offsets_reversed", st_header(_swap_offsets), (EXPERT,)),
    ("offsets_negative", st_header(lambda h: h[EXPERT].update(data_offsets=[-12288, 0])), (EXPERT,)),
    ("offsets_strings", st_header(lambda h: h[EXPERT].update(data_offsets=["0", "12288"])), (EXPERT,)),
    ("offsets_missing", st_header(lambda h: h[EXPERT].pop("data_offsets")), (EXPERT,)),
    ("offsets_overlap", st_header(_overlap), ("overlap", NORM0, NORM1)),
    ("offsets_past_end", st_header(_grow_last), ("ends at byte",)),
    ("metadata_a_list", st_header(lambda h: h.__setitem__("__metadata__", [1, 2])), (ST, "__metadata__")),
    ("tensor_missing", st_header(_drop_tensor), ("missing", EXPERT)),
    ("tensor_unknown", st_header(_extra_tensor), ("model.layers.0.ghost.weight",)),
    ("nan_value", lambda m: set_tensor_value(m / ST, EXPERT, float("nan")), (EXPERT, "NaN")),
    ("inf_value", lambda m: set_tensor_value(m / ST, NORM1, float("-inf")), (NORM1, "Inf")),
    ("duplicate_across_files", _duplicate_shard, (NORM0, "both")),
    ("fifo_weight_file", _fifo, ("extra.safetensors", "FIFO")),
    ("directory_weight_file", _special("dir"), ("extra.safetensors", "directory")),
    ("chardev_weight_file", _special("chardev"), ("extra.safetensors", "character device")),
    ("dangling_link_weight_file", _special("dangling"), ("extra.safetensors",)),
    ("link_loop_weight_file", _special("loop"), ("extra.safetensors",)),
    ("pickle_only", _pickle_only, ("pytorch_model.bin", "never unpickles")),
    ("no_weights", lambda m: (m / ST).unlink(), ("no *.safetensors",)),
]


def _wrong_shape(m: Path):
    t = load_file(m / ST)
    t[EXPERT] = t[EXPERT][:47].contiguous()
    (m / ST).unlink()
    save_file(t, m / ST, metadata={"format": "pt"})


ST_MUTATIONS = [(i, _wrong_shape if f is None else f, e) for i, f, e in ST_MUTATIONS]

for _id, _mut, _exp in ST_MUTATIONS:
    _mk = model_with("mix", _mut)
    case(f"convert-safetensors-{_id}", lambda w, b, mk=_mk: ["convert", mk(w, b), "-o", out_of(w)], 2, _exp)
case("convert-safetensors-float16_overflow",
     lambda w, b: ["convert", model_with("mix", lambda m: set_tensor_value(m / ST, EXPERT, 1e6))(w, b),
                   "-o", out_of(w), "--dtype", "float16"], 2, (EXPERT, "float16 range"))


# -- manifest.json of a checkpoint (verify and build) --

MF = "manifest.json"


def ckpt_with(mutate):
    def make(w: Path, b: Base) -> Path:
        ck = link_tree(b.ckpt, w / "ckpt")
        mutate(ck)
        return ck
    return make


def mf_edit(fn):
    return lambda ck: edit_json(ck / MF, fn)


def _flip_byte(ck: Path):
    p = ck / "rank0.safetensors"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 1
    put(p, bytes(raw))


MANIFEST_MUTATIONS = [
    ("manifest_list", lambda ck: put_json(ck / MF, []), 1, (MF,)),
    ("manifest_number", lambda ck: put_json(ck / MF, 3), 1, (MF,)),
    ("manifest_not_json", lambda ck: put(ck / MF, "{"), 1, (MF, "JSON")),
    ("manifest_not_utf8", lambda ck: put(ck / MF, b"\xff{}"), 1, (MF,)),
    ("manifest_is_directory", lambda ck: (put(ck / MF, b""), (ck / MF).unlink(), (ck / MF).mkdir()), 2, (MF,)),
    ("manifest_missing", lambda ck: (ck / MF).unlink(), 2, (MF,)),
    ("files_a_list", mf_edit(lambda d: d.__setitem__("files", list(d["files"]))), 1, ("files",)),
    ("files_hash_number", mf_edit(lambda d: d["files"].__setitem__("config.json", 5)), 1, ("config.json",)),
    ("files_parent_path", mf_edit(lambda d: d["files"].__setitem__("../x", "0" * 64)), 1, ("../x",)),
    ("files_absolute_path", mf_edit(lambda d: d["files"].__setitem__("/etc/hostname", "0" * 64)), 1,
     ("/etc/hostname",)),
    ("files_empty_key", mf_edit(lambda d: d["files"].__setitem__("", "0" * 64)), 1, ("''",)),
    ("files_listed_missing", mf_edit(lambda d: d["files"].__setitem__("rank7.safetensors", "0" * 64)), 1,
     ("rank7.safetensors", "missing")),
    ("file_unlisted", lambda ck: put(ck / "stray.txt", "x"), 1, ("stray.txt", "not in the manifest")),
    ("file_changed", _flip_byte, 1, ("rank0.safetensors", "sha256")),
    ("config_changed", lambda ck: edit_json(ck / "config.json", lambda d: d.__setitem__("dtype", "float16")), 1,
     ("config.json",)),
]

for _id, _mut, _code, _exp in MANIFEST_MUTATIONS:
    _mk = ckpt_with(_mut)
    case(f"verify-{_id}", lambda w, b, mk=_mk: ["verify", mk(w, b)], _code, _exp)
    case(f"build-{_id}", lambda w, b, mk=_mk: ["build", mk(w, b), "-o", out_of(w), "--backend", "embedded",
                                                "--max-input-len", "64"], _code, _exp)


# -- calib.json (convert --calib and report --calib) --

CJ = "calib.json"


def calib_with(mutate):
    def make(w: Path, b: Base) -> Path:
        c = link_tree(b.calib, w / "calib")
        mutate(c)
        return c
    return make


def cj_edit(fn):
    return lambda c: edit_json(c / CJ, fn)


def _del(*path):
    def fn(d):
        x = d
        for k in path[:-1]:
            x = x[k]
        del x[path[-1]]
    return fn


def _setp(value, *path):
    def fn(d):
        x = d
        for k in path[:-1]:
            x = x[k]
        x[path[-1]] = value(x[path[-1]]) if callable(value) else value
    return fn


def _ragged(rows):
    return [rows[0][:-1], *rows[1:]]


def _nan_first(rows):
    return "@NAN@"


def _nan_calib(c: Path):
    d = json.loads((c / CJ).read_text())
    d["sensitivity"]["delta_kl"]["int8"][0][0] = "@NAN@"
    put(c / CJ, json.dumps(d).replace('"@NAN@"', "NaN"))


CALIB_MUTATIONS = [
    ("top_list", lambda c: put_json(c / CJ, []), (CJ,)),
    ("top_number", lambda c: put_json(c / CJ, 1), (CJ,)),
    ("not_json", lambda c: put(c / CJ, "{"), (CJ, "JSON")),
    ("not_utf8", lambda c: put(c / CJ, b"\xff\xfe"), (CJ,)),
    ("is_directory", lambda c: (put(c / CJ, b""), (c / CJ).unlink(), (c / CJ).mkdir()), (CJ,)),
    ("missing", lambda c: (c / CJ).unlink(), (CJ,)),
    ("version_missing", cj_edit(_del("version")), ("version",)),
    ("version_newer", cj_edit(_setp(99, "version")), ("version",)),
    ("version_str", cj_edit(_setp("2", "version")), ("version",)),
    ("no_formats", cj_edit(_del("formats")), ("formats",)),
    ("formats_not_list", cj_edit(_setp("int8", "formats")), ("formats",)),
    ("formats_unknown", cj_edit(_setp(["int8", "int3"], "formats")), ("formats", "int3")),
    ("no_sensitivity", cj_edit(_del("sensitivity")), ("sensitivity",)),
    ("no_delta_kl", cj_edit(_del("sensitivity", "delta_kl")), ("sensitivity.delta_kl",)),
    ("delta_kl_format_missing", cj_edit(_del("sensitivity", "delta_kl", "int4")), ("delta_kl", "int4")),
    ("delta_kl_ragged", cj_edit(_setp(_ragged, "sensitivity", "delta_kl", "int8")), ("delta_kl", "int8")),
    ("delta_kl_too_few_layers", cj_edit(_setp(lambda r: r[:-1], "sensitivity", "delta_kl", "int8")),
     ("delta_kl", "int8")),
    ("delta_kl_str", cj_edit(_setp("big", "sensitivity", "delta_kl", "int8")), ("delta_kl", "int8")),
    ("delta_kl_value_str", cj_edit(lambda d: d["sensitivity"]["delta_kl"]["int8"][1].__setitem__(0, "x")),
     ("delta_kl", "int8")),
    ("delta_kl_nan", _nan_calib, ("delta_kl", "int8")),
    ("delta_kl_negative", cj_edit(lambda d: d["sensitivity"]["delta_kl"]["int8"][1].__setitem__(0, -1.0)),
     ("delta_kl", "int8")),
    ("matrix_delta_kl_ragged", cj_edit(_setp(_ragged, "sensitivity", "matrices", "fc", "delta_kl", "int8")),
     ("matrices.fc.delta_kl", "int8")),
    ("no_matrices", cj_edit(_del("sensitivity", "matrices")), ("matrices",)),
    ("matrix_missing", cj_edit(_del("sensitivity", "matrices", "proj")), ("proj",)),
    ("no_routing", cj_edit(_del("routing")), ("routing",)),
    ("counts_ragged", cj_edit(_setp(_ragged, "routing", "counts")), ("routing.counts",)),
    ("counts_missing", cj_edit(_del("routing", "counts")), ("routing.counts",)),
    ("share_str", cj_edit(_setp("uniform", "routing", "share")), ("routing.share",)),
    ("moe_layers_out_of_range", cj_edit(_setp([0, 1, 99], "moe_layers")), ("moe_layers", "99")),
    ("moe_layers_missing", cj_edit(_del("moe_layers")), ("moe_layers",)),
    ("num_experts_str", cj_edit(_setp("4", "num_experts")), ("num_experts",)),
    ("num_experts_other_model", cj_edit(_setp(8, "num_experts")), ("num_experts",)),
    ("bits_missing_format", cj_edit(_del("bits_per_weight", "int4")), ("bits_per_weight", "int4")),
    ("under_observed_bad", cj_edit(_setp([{"layer": "a"}], "routing", "under_observed")),
     ("routing.under_observed",)),
]

for _id, _mut, _exp in CALIB_MUTATIONS:
    _mk = calib_with(_mut)
    case(f"convert-calib-{_id}", lambda w, b, mk=_mk: ["convert", b.tokm, "-o", out_of(w), "--calib", mk(w, b),
                                                       "--budget", "6"], 2, _exp)
    case(f"report-calib-{_id}", lambda w, b, mk=_mk: ["report", "--ref", b.ckpt, "--calib", mk(w, b), "--bench", b.bench,
                                                      "-o", out_of(w)], 2, _exp)


# -- YAML build configs (convert -c and build -c) --

def yaml_file(data: bytes | str | None, kind: str = "file"):
    def make(w: Path) -> Path:
        p = w / "cfg.yaml"
        if kind == "dir":
            p.mkdir()
        elif kind == "file":
            put(p, data)
        return p
    return make


YAML_CASES = [
    ("not_utf8", yaml_file(b"convert:\n  tp: 1 # \xff\xfe\n"), ("cfg.yaml", "UTF-8")),
    ("directory", yaml_file(None, "dir"), ("cfg.yaml", "directory")),
    ("missing", yaml_file(None, "none"), ("cfg.yaml", "not found")),
    ("syntax_error", yaml_file("convert:\n  tp: [1\n"), ("cfg.yaml", "line")),
    ("bad_indent", yaml_file("convert:\n  tp: 1\n pp: 2\n"), ("cfg.yaml", "line")),
    ("tab_indent", yaml_file("convert:\n\ttp: 1\n"), ("cfg.yaml", "line")),
    ("top_list", yaml_file("- convert\n- build\n"), ("cfg.yaml", "mapping")),
    ("top_scalar", yaml_file("42\n"), ("cfg.yaml", "mapping")),
    ("unknown_section", yaml_file("deploy:\n  tp: 1\n"), ("cfg.yaml", "deploy")),
    ("unknown_key", yaml_file("convert:\n  tensor_parallel: 2\n"), ("cfg.yaml", "tensor_parallel")),
    ("section_scalar", yaml_file("convert: 5\n"), ("cfg.yaml", "convert")),
    ("tp_str", yaml_file("convert:\n  tp: two\n"), ("cfg.yaml", "convert.tp")),
    ("tp_bool", yaml_file("convert:\n  tp: true\n"), ("cfg.yaml", "convert.tp")),
    ("tp_zero", yaml_file("convert:\n  tp: 0\n"), ("cfg.yaml", "convert.tp")),
    ("tp_null", yaml_file("convert:\n  tp: null\n"), ("cfg.yaml", "convert.tp")),
    ("dtype_choice", yaml_file("convert:\n  dtype: int8\n"), ("cfg.yaml", "convert.dtype")),
    ("budget_above_max", yaml_file("quantize:\n  budget_bpw: 64\n"), ("cfg.yaml", "quantize.budget_bpw")),
    ("formats_bad_item", yaml_file("quantize:\n  formats: [int8, int3]\n"), ("cfg.yaml", "quantize.formats")),
    ("model_number", yaml_file("model: 5\n"), ("cfg.yaml", "model")),
    ("batch_zero", yaml_file("build:\n  max_batch_size: 0\n"), ("cfg.yaml", "build.max_batch_size")),
    ("backend_choice", yaml_file("build:\n  backend: onnx\n"), ("cfg.yaml", "build.backend")),
    ("beam_nine", yaml_file("build:\n  max_beam_width: 9\n"), ("cfg.yaml", "build.max_beam_width")),
    ("block_seven", yaml_file("build:\n  tokens_per_block: 7\n"), ("cfg.yaml", "build.tokens_per_block")),
    ("duplicate_key", yaml_file("convert:\n  tp: 1\n  tp: 2\n"), ("cfg.yaml", "duplicate key 'tp'", "line 3")),
    ("duplicate_section", yaml_file("build:\n  workers: 1\nbuild:\n  workers: 2\n"),
     ("cfg.yaml", "duplicate key 'build'", "line 3")),
    ("budget_nan", yaml_file("quantize:\n  budget_bpw: .nan\n"), ("cfg.yaml", "quantize.budget_bpw", "finite")),
    ("batch_2e40", yaml_file("build:\n  max_batch_size: 1099511627776\n"), ("cfg.yaml", "build.max_batch_size")),
    ("alias_bomb", yaml_file("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"
                             "c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c]\n"),
     ("cfg.yaml",)),
]

for _id, _mk, _exp in YAML_CASES:
    case(f"convert-yaml-{_id}", lambda w, b, mk=_mk: ["convert", b.mix, "-o", out_of(w), "-c", mk(w)], 2, _exp)
    case(f"build-yaml-{_id}", lambda w, b, mk=_mk: ["build", b.ckpt, "-o", out_of(w), "-c", mk(w)], 2, _exp)
    case(f"inspect-yaml-{_id}", lambda w, b, mk=_mk: ["inspect", b.mix, "-c", mk(w)], 2, _exp)


# -- option values, per command --

def _cli(*args, model="mix"):
    """CLI args where the strings MODEL, CKPT, ENGINE, CALIB, TEXT, OUT are replaced per case."""
    def make(w: Path, b: Base) -> list:
        subst = {"MODEL": getattr(b, model), "CKPT": b.ckpt, "ENGINE": b.engine, "CALIB": b.calib,
                 "TEXT": b.text, "OUT": out_of(w), "NOWHERE": w / "nowhere", "BENCH": b.bench, "TOKM": b.tokm}
        return [subst.get(a, a) if isinstance(a, str) else a for a in args]
    return make


OPTION_CASES = [
    # inspect
    ("inspect-tp-zero", _cli("inspect", "MODEL", "--tp", "0"), ("tp",)),
    ("inspect-tp-negative", _cli("inspect", "MODEL", "--tp", "-2"), ("tp",)),
    ("inspect-tp-word", _cli("inspect", "MODEL", "--tp", "two"), ("--tp",)),
    ("inspect-tp-three", _cli("inspect", "MODEL", "--tp", "3"), ("tp=3",)),
    ("inspect-moe-ep-three", _cli("inspect", "MODEL", "--tp", "2", "--moe-ep", "3"), ("moe_ep",)),
    ("inspect-pp-too-many", _cli("inspect", "MODEL", "--pp", "8"), ("pp",)),
    ("inspect-dtype-int8", _cli("inspect", "MODEL", "--dtype", "int8"), ("--dtype",)),
    ("inspect-unknown-option", _cli("inspect", "MODEL", "--tensor-parallel", "2"), ("--tensor-parallel",)),
    ("inspect-no-model", _cli("inspect"), ("MODEL",)),
    # convert
    ("convert-tp-zero", _cli("convert", "MODEL", "-o", "OUT", "--tp", "0"), ("tp",)),
    ("convert-pp-zero", _cli("convert", "MODEL", "-o", "OUT", "--pp", "0"), ("pp",)),
    ("convert-moe-tp-zero", _cli("convert", "MODEL", "-o", "OUT", "--moe-tp", "0"), ("--moe-tp",)),
    ("convert-moe-product", _cli("convert", "MODEL", "-o", "OUT", "--tp", "2", "--moe-tp", "2", "--moe-ep", "2"),
     ("moe_tp",)),
    ("convert-pp-too-many", _cli("convert", "MODEL", "-o", "OUT", "--pp", "4"), ("pp",)),
    ("convert-dtype-int8", _cli("convert", "MODEL", "-o", "OUT", "--dtype", "int8"), ("--dtype",)),
    ("convert-version-unknown", _cli("convert", "MODEL", "-o", "OUT", "--trtllm-version", "0.9"),
     ("trtllm",)),
    ("convert-budget-negative", _cli("convert", "TOKM", "-o", "OUT", "--calib", "CALIB", "--budget", "-1"),
     ("budget",)),
    ("convert-budget-word", _cli("convert", "TOKM", "-o", "OUT", "--calib", "CALIB", "--budget", "lots"),
     ("--budget",)),
    ("convert-budget-nan", _cli("convert", "TOKM", "-o", "OUT", "--calib", "CALIB", "--budget", "nan"),
     ("budget",)),
    ("convert-budget-and-gb", _cli("convert", "TOKM", "-o", "OUT", "--calib", "CALIB", "--budget", "6",
                                   "--budget-gb", "1"), ("budget",)),
    ("convert-budget-gb-negative", _cli("convert", "TOKM", "-o", "OUT", "--calib", "CALIB", "--budget-gb", "-1"),
     ("budget",)),
    ("convert-budget-without-calib", _cli("convert", "MODEL", "-o", "OUT", "--budget", "6"), ("calib",)),
    ("convert-uniform-without-format", _cli("convert", "MODEL", "-o", "OUT", "--policy", "uniform"),
     ("format",)),
    ("convert-policy-unknown", _cli("convert", "MODEL", "-o", "OUT", "--policy", "magic"), ("--policy",)),
    ("convert-format-unknown", _cli("convert", "MODEL", "-o", "OUT", "--policy", "uniform", "--format", "int3"),
     ("--format",)),
    ("convert-formats-unknown", _cli("convert", "TOKM", "-o", "OUT", "--calib", "CALIB", "--budget", "6",
                                     "--formats", "int8,int3"), ("int3",)),
    ("convert-formats-unmeasured", _cli("convert", "TOKM", "-o", "OUT", "--calib", "CALIB", "--budget", "6",
                                        "--formats", "int4_g64"), ("int4_g64",)),
    ("convert-granularity-unknown", _cli("convert", "MODEL", "-o", "OUT", "--granularity", "row"),
     ("--granularity",)),
    ("convert-calib-missing", _cli("convert", "TOKM", "-o", "OUT", "--calib", "OUT", "--budget", "6"),
     ("calib.json",)),
    ("convert-balanced-without-calib", _cli("convert", "MODEL", "-o", "OUT", "--placement", "balanced"),
     ("calib",)),
    ("convert-no-output", _cli("convert", "MODEL"), ("-o",)),
    # calibrate
    ("calibrate-samples-zero", _cli("calibrate", "TOKM", "--data", "TEXT", "-o", "OUT", "--samples", "0"),
     ("--samples",)),
    ("calibrate-seq-len-one", _cli("calibrate", "TOKM", "--data", "TEXT", "-o", "OUT", "--seq-len", "1"),
     ("--seq-len",)),
    ("calibrate-seq-len-beyond-context", _cli("calibrate", "TOKM", "--data", "TEXT", "-o", "OUT",
                                              "--seq-len", "300"), ("--seq-len", "300", "256")),
    ("calibrate-formats-unknown", _cli("calibrate", "TOKM", "--data", "TEXT", "-o", "OUT", "--formats", "int3"),
     ("int3",)),
    ("calibrate-formats-float", _cli("calibrate", "TOKM", "--data", "TEXT", "-o", "OUT", "--formats", "fp16"),
     ("fp16",)),
    ("calibrate-min-tokens-negative", _cli("calibrate", "TOKM", "--data", "TEXT", "-o", "OUT",
                                           "--min-tokens", "-1"), ("--min-tokens",)),
    ("calibrate-data-missing", _cli("calibrate", "TOKM", "--data", "OUT", "-o", "OUT"), ("not found",)),
    ("calibrate-no-tokenizer", _cli("calibrate", "MODEL", "--data", "TEXT", "-o", "OUT"), ("tokenizer",)),
    ("calibrate-tokenizer-missing", _cli("calibrate", "TOKM", "--data", "TEXT", "-o", "OUT",
                                         "--tokenizer", "OUT"), ("tokenizer",)),
    # build
    ("build-batch-zero", _cli("build", "CKPT", "-o", "OUT", "--max-batch-size", "0"), ("--max-batch-size",)),
    ("build-input-zero", _cli("build", "CKPT", "-o", "OUT", "--max-input-len", "0"), ("--max-input-len",)),
    ("build-input-beyond-seq", _cli("build", "CKPT", "-o", "OUT", "--max-input-len", "64", "--max-seq-len", "32"),
     ("max_seq_len",)),
    ("build-seq-beyond-context", _cli("build", "CKPT", "-o", "OUT", "--max-input-len", "64",
                                      "--max-seq-len", "100000"), ("max_seq_len",)),
    # Plain `build` derives max_input_len from the model (well-formed case build-defaults); one given
    # beyond the model's positions is still a contradiction.
    ("build-input-1024-beyond-seq", _cli("build", "CKPT", "-o", "OUT", "--max-input-len", "1024"),
     ("max_input_len",)),
    ("build-beam-nine", _cli("build", "CKPT", "-o", "OUT", "--max-beam-width", "9"), ("--max-beam-width",)),
    ("build-block-seven", _cli("build", "CKPT", "-o", "OUT", "--tokens-per-block", "7"), ("--tokens-per-block",)),
    ("build-workers-zero", _cli("build", "CKPT", "-o", "OUT", "--workers", "0"), ("--workers",)),
    ("build-gemm-plugin-unknown", _cli("build", "CKPT", "-o", "OUT", "--gemm-plugin", "int3"), ("--gemm-plugin",)),
    ("build-backend-unknown", _cli("build", "CKPT", "-o", "OUT", "--backend", "onnx"), ("--backend",)),
    ("build-num-tokens-zero", _cli("build", "CKPT", "-o", "OUT", "--max-num-tokens", "0"), ("--max-num-tokens",)),
    ("build-hf-model-not-checkpoint", _cli("build", "MODEL", "-o", "OUT", "--max-input-len", "64"), ("",)),
    # repo
    ("repo-batch-zero", _cli("repo", "ENGINE", "-o", "OUT", "--max-batch-size", "0"), ("max_batch_size",)),
    ("repo-batch-above-engine", _cli("repo", "ENGINE", "-o", "OUT", "--max-batch-size", "64"), ("max_batch_size",)),
    ("repo-input-above-engine", _cli("repo", "ENGINE", "-o", "OUT", "--max-input-len", "100000"),
     ("max_input_len",)),
    ("repo-seq-above-engine", _cli("repo", "ENGINE", "-o", "OUT", "--max-seq-len", "100000"), ("max_seq_len",)),
    ("repo-beam-two", _cli("repo", "ENGINE", "-o", "OUT", "--max-beam-width", "2"), ("beam",)),
    ("repo-world-size-three", _cli("repo", "ENGINE", "-o", "OUT", "--world-size", "3"), ("world",)),
    ("repo-queue-size-negative", _cli("repo", "ENGINE", "-o", "OUT", "--max-queue-size", "-1"), ("queue",)),
    ("repo-queue-delay-negative", _cli("repo", "ENGINE", "-o", "OUT", "--max-queue-delay-us", "-1"), ("delay",)),
    ("repo-instances-zero", _cli("repo", "ENGINE", "-o", "OUT", "--preprocessing-instances", "0"),
     ("instance",)),
    ("repo-kv-fraction-above-one", _cli("repo", "ENGINE", "-o", "OUT", "--kv-cache-free-gpu-mem-fraction", "1.5"),
     ("kv_cache_free_gpu_mem_fraction",)),
    ("repo-device-unknown", _cli("repo", "ENGINE", "-o", "OUT", "--device", "tpu"), ("device",)),
    ("repo-stream-interval-negative", _cli("repo", "ENGINE", "-o", "OUT", "--stream-interval", "-1"),
     ("stream_interval",)),
    ("repo-torch-threads-negative", _cli("repo", "ENGINE", "-o", "OUT", "--torch-threads", "-1"), ("thread",)),
    ("repo-on-checkpoint", _cli("repo", "CKPT", "-o", "OUT"), ("",)),
    ("repo-on-hf-model", _cli("repo", "MODEL", "-o", "OUT"), ("",)),
    ("repo-tokenizer-missing", _cli("repo", "ENGINE", "-o", "OUT", "--tokenizer", "NOWHERE"), ("tokenizer",)),
    ("repo-tokenizer-without-files", _cli("repo", "ENGINE", "-o", "OUT", "--tokenizer", "MODEL"), ("tokenizer",)),
    # report
    ("report-nothing", _cli("report", "--ref", "CKPT", "-o", "OUT"), ("nothing to report",)),
    ("report-samples-zero", _cli("report", "--ref", "CKPT", "--quant", "CKPT", "-o", "OUT", "--samples", "0"),
     ("--samples",)),
    ("report-batch-zero", _cli("report", "--ref", "CKPT", "--quant", "CKPT", "-o", "OUT", "--batch-size", "0"),
     ("--batch-size",)),
    ("report-quant-without-ref", _cli("report", "--quant", "CKPT", "-o", "OUT"), ("--ref",)),
    ("report-quant-missing", _cli("report", "--ref", "CKPT", "--quant", "NOWHERE", "-o", "OUT"), ("nowhere",)),
    ("report-bench-missing", _cli("report", "--ref", "CKPT", "--bench", "NOWHERE", "-o", "OUT"), ("nowhere",)),
    ("report-bench-not-json", _cli("report", "--ref", "CKPT", "--bench", "TEXT", "-o", "OUT"), ("JSON",)),
    ("report-device-unknown", _cli("report", "--ref", "CKPT", "--bench", "BENCH", "-o", "OUT", "--device", "tpu"),
     ("--device",)),
    # generate (argument checks happen before any connection)
    ("generate-max-tokens-zero", _cli("generate", "hi", "--url", "127.0.0.1:9", "-n", "0"), ("max_tokens",)),
    ("generate-max-tokens-negative", _cli("generate", "hi", "--url", "127.0.0.1:9", "-n", "-5"), ("max_tokens",)),
    ("generate-top-p-above-one", _cli("generate", "hi", "--url", "127.0.0.1:9", "--top-p", "2"), ("top_p",)),
    ("generate-top-p-zero", _cli("generate", "hi", "--url", "127.0.0.1:9", "--top-p", "0"), ("top_p",)),
    ("generate-top-k-negative", _cli("generate", "hi", "--url", "127.0.0.1:9", "--top-k", "-1"), ("top_k",)),
    ("generate-temperature-negative", _cli("generate", "hi", "--url", "127.0.0.1:9", "--temperature", "-1"),
     ("temperature",)),
    ("generate-temperature-nan", _cli("generate", "hi", "--url", "127.0.0.1:9", "--temperature", "nan"),
     ("temperature",)),
    ("generate-unary-and-stream", _cli("generate", "hi", "--url", "127.0.0.1:9", "--unary", "--stream"),
     ("--unary",)),
    ("generate-timeout-zero", _cli("generate", "hi", "--url", "127.0.0.1:9", "--timeout", "0"), ("timeout",)),
    ("generate-url-without-port", _cli("generate", "hi", "--url", "localhost"), ("url",)),
    ("generate-seed-word", _cli("generate", "hi", "--url", "127.0.0.1:9", "--seed", "x"), ("--seed",)),
    # top level
    ("unknown-command", _cli("transmogrify"), ("transmogrify",)),
    ("unknown-top-option", _cli("--fast", "inspect", "MODEL"), ("--fast",)),
]

for _id, _mk, _exp in OPTION_CASES:
    case(f"option-{_id}", _mk, 2, _exp)
# Well-formed but unanswerable: the connection fails (exit 1, one line), nothing hangs.
case("option-generate-no-server", _cli("generate", "hi", "--url", "127.0.0.1:9", "--model", "magic",
                                       "--timeout", "5"), 1, ("127.0.0.1:9",))


# -- paths --

def _file_as_parent(w: Path, b: Base) -> Path:
    put(w / "outs" / "afile", "x")
    return w / "outs" / "afile" / "ckpt"


PATH_CASES = [
    ("inspect-model-missing", lambda w, b: ["inspect", w / "nowhere"], 2, ("nowhere",)),
    ("inspect-model-is-file", lambda w, b: ["inspect", b.mix / "config.json"], 2, ("config.json",)),
    ("convert-model-missing", lambda w, b: ["convert", w / "nowhere", "-o", out_of(w)], 2, ("nowhere",)),
    ("convert-model-is-file", lambda w, b: ["convert", b.mix / "config.json", "-o", out_of(w)], 2, ("file",)),
    ("convert-hub-id-not-cached", lambda w, b: ["convert", "nobody/no-such-model-xyz", "-o", out_of(w)], 2,
     ("no-such-model-xyz", "cache")),
    ("convert-output-parent-is-file", lambda w, b: ["convert", b.mix, "-o", _file_as_parent(w, b)], 2,
     ("afile", "not a directory")),
    ("convert-output-under-dev-null", lambda w, b: ["convert", b.mix, "-o", "/dev/null/ckpt"], 2,
     ("/dev/null",)),
    ("convert-output-unwritable", lambda w, b: ["convert", b.mix, "-o", "/proc/trtmoe-hostile/ckpt"], 1,
     ("/proc",)),
    ("convert-output-is-model", lambda w, b: ["convert", link_tree(b.mix, w / "model"), "-o", w / "model",
                                              "--force"], 2, ("inputs",)),
    ("convert-output-inside-model", lambda w, b: ["convert", link_tree(b.mix, w / "model"), "-o",
                                                  w / "model" / "ckpt"], 2, ("inputs",)),
    ("convert-output-holds-model", lambda w, b: ["convert", link_tree(b.mix, w / "models" / "m"), "-o",
                                                 w / "models", "--force"], 2, ("inputs",)),
    ("convert-output-exists", lambda w, b: ["convert", b.mix, "-o", (w / "outs" / "x").mkdir(parents=True)
                                            or (put(w / "outs" / "x" / "keep.txt", "mine") or w / "outs" / "x")],
     2, ("already exists",)),
    ("convert-force-over-foreign-dir", lambda w, b: ["convert", b.mix, "-o", (w / "outs" / "x").mkdir(parents=True)
                                                     or (put(w / "outs" / "x" / "k.txt", "m") or w / "outs" / "x"),
                                                     "--force"], 2, ("not a trtmoe artifact",)),
    ("convert-output-is-file", lambda w, b: ["convert", b.mix, "-o", (put(w / "outs" / "f", "x") if
                                                                       (w / "outs").is_dir() else None) or
                                             w / "outs" / "f", "--force"], 2, ("not a trtmoe artifact",)),
    ("calibrate-output-is-model", lambda w, b: ["calibrate", link_tree(b.tokm, w / "m"), "--data", b.text, "-o",
                                                w / "m", "--force"], 2, ("inputs",)),
    ("calibrate-output-is-data", lambda w, b: ["calibrate", b.tokm, "--data", link_tree(b.calib, w / "d"),
                                               "-o", w / "d", "--force"], 2, ("inputs",)),
    ("calibrate-data-binary", lambda w, b: ["calibrate", b.tokm, "--data", (put(w / "d.bin", b"\0\1\2" * 100)
                                                                            or w / "d.bin"), "-o", out_of(w)], 2,
     ("d.bin", "binary")),
    ("calibrate-data-empty", lambda w, b: ["calibrate", b.tokm, "--data", (put(w / "e.txt", "  \n") or
                                                                           w / "e.txt"), "-o", out_of(w)], 2,
     ("e.txt",)),
    ("calibrate-data-jsonl-bad-line", lambda w, b: ["calibrate", b.tokm, "--data",
                                                    (put(w / "d.jsonl", '{"text": "a"}\n{bad\n') or w / "d.jsonl"),
                                                    "-o", out_of(w)], 2, ("d.jsonl:2",)),
    ("calibrate-data-jsonl-not-object", lambda w, b: ["calibrate", b.tokm, "--data",
                                                      (put(w / "d.jsonl", '[1]\n') or w / "d.jsonl"), "-o",
                                                      out_of(w)], 2, ("d.jsonl:1",)),
    ("calibrate-data-jsonl-no-field", lambda w, b: ["calibrate", b.tokm, "--data",
                                                    (put(w / "d.jsonl", '{"body": "x"}\n') or w / "d.jsonl"),
                                                    "-o", out_of(w)], 2, ("d.jsonl:1", "text")),
    ("calibrate-data-jsonl-not-utf8", lambda w, b: ["calibrate", b.tokm, "--data",
                                                    (put(w / "d.jsonl", b'{"text": "\xff"}\n') or w / "d.jsonl"),
                                                    "-o", out_of(w)], 2, ("d.jsonl", "UTF-8")),
    ("calibrate-data-too-short", lambda w, b: ["calibrate", b.tokm, "--data", (put(w / "s.txt", "hi") or
                                                                               w / "s.txt"), "-o", out_of(w)], 2,
     ("tokens",)),
    ("verify-missing", lambda w, b: ["verify", w / "nowhere"], 2, ("nowhere",)),
    ("verify-a-file", lambda w, b: ["verify", b.ckpt / "config.json"], 2, ("config.json",)),
    ("verify-hf-model", lambda w, b: ["verify", b.mix], 2, ("manifest.json",)),
    ("build-checkpoint-missing", lambda w, b: ["build", w / "nowhere", "-o", out_of(w)], 2, ("nowhere",)),
    ("build-output-is-checkpoint", lambda w, b: ["build", link_tree(b.ckpt, w / "ck"), "-o", w / "ck",
                                                 "--force", "--max-input-len", "64"], 2, ("inputs",)),
    ("build-output-inside-checkpoint", lambda w, b: ["build", link_tree(b.ckpt, w / "ck"), "-o", w / "ck" / "e",
                                                     "--max-input-len", "64"], 2, ("",)),
    ("build-output-parent-is-file", lambda w, b: ["build", b.ckpt, "-o", _file_as_parent(w, b),
                                                  "--max-input-len", "64"], 2, ("afile",)),
    ("repo-engine-missing", lambda w, b: ["repo", w / "nowhere", "-o", out_of(w)], 2, ("nowhere",)),
    ("repo-output-is-engine", lambda w, b: ["repo", link_tree(b.engine, w / "e"), "-o", w / "e", "--force"], 2,
     ("inputs",)),
    ("repo-output-inside-engine", lambda w, b: ["repo", link_tree(b.engine, w / "e"), "-o", w / "e" / "r"], 2,
     ("",)),
    ("repo-output-parent-is-file", lambda w, b: ["repo", b.engine, "-o", _file_as_parent(w, b)], 2, ("afile",)),
    ("repo-engine-config-list", lambda w, b: ["repo", (lambda e: (put_json(e / "config.json", []), e)[1])(
        link_tree(b.engine, w / "e")), "-o", out_of(w)], 2, ("config.json",)),
    ("repo-engine-config-not-json", lambda w, b: ["repo", (lambda e: (put(e / "config.json", "{"), e)[1])(
        link_tree(b.engine, w / "e")), "-o", out_of(w)], 2, ("config.json",)),
    ("repo-engine-batch-str", lambda w, b: ["repo", (lambda e: (edit_json(
        e / "config.json", lambda d: d["build_config"].__setitem__("max_batch_size", "8")), e)[1])(
        link_tree(b.engine, w / "e")), "-o", out_of(w)], 2, ("max_batch_size",)),
    ("repo-engine-checkpoint-escapes", lambda w, b: ["repo", (lambda e: (edit_json(
        e / "config.json", lambda d: d.__setitem__("checkpoint", "/etc")), e)[1])(
        link_tree(b.engine, w / "e")), "-o", out_of(w)], 2, ("",)),
    ("report-output-is-calib", lambda w, b: ["report", "--ref", b.ckpt, "--calib", link_tree(b.calib, w / "c"),
                                             "--bench", b.bench, "-o", w / "c"], 2, ("",)),
]

for _id, _mk, _code, _exp in PATH_CASES:
    case(f"path-{_id}", _mk, _code, _exp)


# -- what an option asks for must be what is written (refused by name when it cannot be) --

def _calib_without(*names):
    def make(w: Path, b: Base) -> Path:
        c = link_tree(b.calib, w / "calib")
        for n in names:
            (c / n).unlink()
        return c
    return make


HONEST_CASES = [
    # A rounding that needs activation statistics never silently falls back to round-to-nearest.
    ("convert-calib-no-activations", lambda w, b: ["convert", b.tokm, "-o", out_of(w), "--calib",
                                                   _calib_without("activations.safetensors")(w, b), "--policy",
                                                   "uniform", "--format", "int4_g128"], 2,
     ("activations.safetensors", "awq_gptq")),
    ("convert-calib-no-activations-budget", lambda w, b: ["convert", b.tokm, "-o", out_of(w), "--calib",
                                                          _calib_without("activations.safetensors")(w, b),
                                                          "--budget", "6", "--rounding", "awq"], 2,
     ("activations.safetensors",)),
    # Values no engine can hold are refused where they are given, not by a later command.
    ("build-batch-2e40", _cli("build", "CKPT", "-o", "OUT", "--max-batch-size", str(2 ** 40)), 2,
     ("--max-batch-size", "2147483647")),
    ("build-num-tokens-2e40", _cli("build", "CKPT", "-o", "OUT", "--max-num-tokens", str(2 ** 40)), 2,
     ("--max-num-tokens",)),
    ("repo-batch-2e40", _cli("repo", "ENGINE", "-o", "OUT", "--max-batch-size", str(2 ** 40)), 2,
     ("--max-batch-size",)),
    ("run-temperature-nan", _cli("run", "CKPT", "-p", "hi", "--temperature", "nan"), 2, ("temperature", "finite")),
    ("run-temperature-inf", _cli("run", "CKPT", "-p", "hi", "--temperature", "inf"), 2, ("temperature", "finite")),
    # A planning script can gate on inspect: a layout TensorRT-LLM refuses is exit 3, not 0.
    ("inspect-target-refuses", _cli("inspect", "MODEL", "--target", "tensorrt-llm", model="qwen"), 3,
     ("does not build", "dense layers")),
    ("inspect-yaml-target-refuses", lambda w, b: ["inspect", b.qwen, "-c",
                                                  yaml_file("build:\n  backend: tensorrt-llm\n")(w)], 3,
     ("does not build",)),
    # build takes the checkpoint's layout: a config asking for another one is refused, not overridden.
    ("build-yaml-layout-conflict", lambda w, b: ["build", b.ckpt, "-o", out_of(w), "--max-input-len", "64", "-c",
                                                 yaml_file("convert:\n  tp: 2\n  moe_ep: 2\n")(w)], 2,
     ("cfg.yaml", "tp 2", "moe_ep 2", "tp=1")),
    # Errors that teach: the command that fetches what is missing, the values that work.
    ("inspect-hub-id-not-cached", _cli("inspect", "nobody/no-such-model-xyz"), 2,
     ("hf download nobody/no-such-model-xyz config.json",)),
    ("convert-hub-id-not-cached-fetch", _cli("convert", "nobody/no-such-model-xyz", "-o", "OUT"), 2,
     ("hf download nobody/no-such-model-xyz --include",)),
    ("inspect-heads-tp", _cli("inspect", "MODEL", "--tp", "3"), 2, ("tp that fit this model: 1, 2, 4",)),
    ("inspect-experts-moe-ep", _cli("inspect", "MODEL", "--tp", "8", "--moe-ep", "8"), 2,
     ("num_experts=4 is not divisible by moe_ep=8", "moe_ep that divide it: 1, 2, 4")),
    ("inspect-moe-ep-not-dividing-tp", _cli("inspect", "MODEL", "--tp", "4", "--moe-ep", "3"), 2,
     ("moe_ep that do: 1, 2, 4",)),
    ("inspect-no-architectures-unknown-type", model_with("mix", cfg_set(architectures=_DELETE, model_type="llama"))
     and (lambda w, b: ["inspect", model_with("mix", cfg_set(architectures=_DELETE, model_type="llama"))(w, b)]),
     2, ("no architectures", "llama", "mixtral")),
    # Per-channel int4 measured with error-feedback codes that TensorRT-LLM's float layout loses: its
    # ΔKL would not be what the engine computes, so naming it as a candidate is refused.
    ("convert-trtllm-int4-codes-lost", _cli("convert", "TOKM", "-o", "OUT", "--calib", "CALIB", "--budget", "6",
                                            "--target", "tensorrt-llm", "--formats", "fp16,int8,int4"), 2,
     ("--formats int4", "awq_gptq", "codes")),
    ("convert-rounding-without-calib", _cli("convert", "TOKM", "-o", "OUT", "--policy", "uniform", "--format",
                                            "int4_g128", "--rounding", "gptq"), 2, ("--rounding gptq", "--calib")),
]

for _id, _mk, _code, _exp in HONEST_CASES:
    case(f"honest-{_id}", _mk, _code, _exp)


# ---- running one case ----------------------------------------------------------------------------

class Hang(Exception):
    pass


def _on_alarm(signum, frame):
    raise Hang(f"no answer within {HANG_SECONDS} s")


def run_case(c: Case, w: Path, b: Base):
    import tempfile as tf

    (w / "outs").mkdir(parents=True, exist_ok=True)
    args = [str(a) for a in c.make(w, b)]
    before = snapshot(w)
    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    old_tmp, tf.tempdir = tf.tempdir, str(b.tmp)
    signal.alarm(HANG_SECONDS)
    try:
        res = CliRunner().invoke(main, args, catch_exceptions=True)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        tf.tempdir = old_tmp
    return args, before, res


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_hostile_input(c: Case, base: Base, tmp_path):
    w = tmp_path / "w"
    w.mkdir()
    args, before, res = run_case(c, w, base)
    err = res.stderr
    shown = f"args: {args}\nexit: {res.exit_code}\nstderr:\n{err}\nstdout tail:\n{res.stdout[-400:]}"
    assert not isinstance(res.exception, Hang), shown
    assert res.exception is None or isinstance(res.exception, SystemExit), shown
    assert res.exit_code != 0, "corrupt input accepted\n" + shown
    assert "Traceback" not in err and "internal error" not in err, shown
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), "not one error line\n" + shown
    assert res.exit_code == c.code, shown
    for word in c.expect:  # a key may be named as its option (max_batch_size as --max-batch-size)
        assert word in lines[0] or word.replace("_", "-") in lines[0], f"{word!r} missing\n" + shown
    # Nothing written: no output and no partial sibling, inputs unchanged, no trtmoe temp directory.
    assert snapshot(w) == before, "an input changed or an output was written"
    leftovers = [p for p in w.rglob("*") if ".trtmoe-partial-" in p.name]
    assert not leftovers, leftovers
    assert not [n for n in os.listdir(base.tmp) if "trtmoe" in n], os.listdir(base.tmp)


def test_there_are_at_least_200_cases():
    assert len(CASES) >= 200, len(CASES)


# ---- the same inputs, well-formed, succeed (so the cases above fail for their one defect) ---------

@pytest.mark.parametrize("args", [
    lambda w, b: ["inspect", link_tree(b.mix, w / "model")],
    lambda w, b: ["convert", link_tree(b.mix_sharded, w / "model"), "-o", out_of(w)],
    lambda w, b: ["convert", b.tokm, "-o", out_of(w), "--calib", link_tree(b.calib, w / "calib"), "--budget", "6"],
    lambda w, b: ["verify", link_tree(b.ckpt, w / "ckpt")],
    lambda w, b: ["build", link_tree(b.ckpt, w / "ckpt"), "-o", out_of(w), "--max-input-len", "64"],
    lambda w, b: ["report", "--ref", b.ckpt, "--calib", link_tree(b.calib, w / "calib"), "--bench", b.bench,
                  "-o", out_of(w)],
    lambda w, b: ["convert", b.mix, "-o", out_of(w), "-c", (put(w / "cfg.yaml", "convert:\n  tp: 2\n  moe_ep: 2\n")
                                                           or w / "cfg.yaml")],
    lambda w, b: ["inspect", model_with("mix", cfg_set(architectures=_DELETE))(w, b), "--target", "tensorrt-llm"],
    lambda w, b: ["build", link_tree(b.ckpt, w / "ckpt"), "-o", out_of(w)],
], ids=["inspect", "convert-sharded", "convert-calib", "verify", "build", "report", "convert-yaml",
        "inspect-model-type-only", "build-defaults"])
def test_well_formed_inputs_succeed(args, base, tmp_path):
    w = tmp_path / "w"
    w.mkdir()
    c = Case("ok", args)
    argv, _, res = run_case(c, w, base)
    assert res.exit_code == 0, (argv, res.stderr, res.stdout[-400:])


def test_tensorrt_llm_plan_is_scored_with_what_the_engine_computes(base, tmp_path):
    """The calibration measured int4 with awq_gptq codes, which TensorRT-LLM's layer layout cannot keep:
    the budgeted plan for that target leaves int4 out (the predicted ΔKL is then of formats the engine
    runs as measured) and says what int4 would lose; the embedded target's per-matrix plan keeps it."""
    out = tmp_path / "trt"
    res = CliRunner().invoke(main, ["convert", str(base.tokm), "-o", str(out), "--calib", str(base.calib),
                                    "--budget", "9", "--target", "tensorrt-llm", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert any("int4 left out of the candidates" in n and "awq_gptq" in n for n in summary["notes"]), summary
    assert summary["quantization"]["formats_used"] == ["int8"], summary["quantization"]
    emb = tmp_path / "emb"
    res = CliRunner().invoke(main, ["convert", str(base.tokm), "-o", str(emb), "--calib", str(base.calib),
                                    "--budget", "6", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert not any("left out" in n for n in summary["notes"]) and "int4" in summary["quantization"]["formats_used"]


# ---- an OS limit hit mid-write: one line, exit 1, nothing left (a subprocess: the limit is per process) --

@pytest.mark.parametrize("command", ["convert", "build-copy"])
def test_file_size_limit_mid_write(command, base, tmp_path):
    import resource
    import subprocess
    import sys

    out = tmp_path / "outs" / "out"
    out.parent.mkdir()
    args = (["convert", base.mix, "-o", out] if command == "convert" else
            ["build", base.ckpt, "-o", out, "--backend", "embedded", "--max-input-len", "64", "--copy"])
    limit = 64 << 10  # smaller than every rank file, larger than the configs

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "trtmoe.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=240, preexec_fn=cap, cwd=REPO_ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(base.tmp)})
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert "File too large" in lines[0] and "ulimit -f" in lines[0], lines[0]
    assert list(out.parent.iterdir()) == [], list(out.parent.iterdir())
    assert not [n for n in os.listdir(base.tmp) if "trtmoe" in n]
