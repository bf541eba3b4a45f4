"""YAML build configs, validated strictly, merged CLI > YAML > defaults.

A config has up to six sections (``model``, ``convert``, ``quantize``, ``build``, ``repo``, ``serve``):
every stage's options, so one file drives ``convert``, ``build``, ``repo`` and ``serve`` and the
command line overrides any of them. An unknown section or key, or a bad value, is a ConfigError
naming the key and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import DEFAULT_TRTLLM_VERSION
from .errors import ConfigError
from .quant import FLOAT_NAMES, QUANTIZED_NAMES


@dataclass(frozen=True)
class Key:
    type: type | tuple[type, ...]
    default: Any = None
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False
    help: str = ""


_POS = dict(minimum=1)
SCHEMA: dict[str, dict[str, Key]] = {
    "convert": {
        "tp": Key(int, 1, help="tensor-parallel size", **_POS),
        "pp": Key(int, 1, help="pipeline-parallel size", **_POS),
        "moe_tp": Key(int, None, nullable=True, help="MoE tensor-parallel size (moe_tp × moe_ep = tp)", **_POS),
        "moe_ep": Key(int, None, nullable=True, help="MoE expert-parallel size", **_POS),
        "dtype": Key(str, "auto", choices=("auto", "float32", "float16", "bfloat16")),
        "trtllm_version": Key(str, DEFAULT_TRTLLM_VERSION, choices=("1.2", "1.2.0", "1.2.1")),
    },
    "quantize": {
        # Same names as `trtmoe convert --policy` and trtmoe.quant.policies.POLICIES.
        "policy": Key(str, "none", choices=("none", "graded", "uniform", "frequency", "frequency-bytes",
                                            "random-bytes")),
        "format": Key(str, None, nullable=True, choices=QUANTIZED_NAMES,
                      help="the format for policy=uniform"),
        "budget_bpw": Key((int, float), None, nullable=True, minimum=1, maximum=32,
                          help="average bits per expert weight, scales counted"),
        "budget_gb": Key((int, float), None, nullable=True, minimum=0, help="expert bytes per GPU, in GB"),
        "granularity": Key(str, "auto", choices=("auto", "matrix", "expert", "layer"),
                           help="auto: matrix (fc and proj apart) for the embedded target's budgeted "
                                "policies, layer for tensorrt-llm"),
        "formats": Key(list, None, nullable=True,
                       choices=(*FLOAT_NAMES, *QUANTIZED_NAMES),
                       help="candidate formats, e.g. [fp16, int8, int4_g64, int4_g128]; choices apply to each item"),
        "calib": Key(str, None, nullable=True, help="calibration directory from `trtmoe calibrate`"),
        "placement": Key(str, "identity", choices=("identity", "balanced")),
        "rounding": Key(str, "awq", choices=("rtn", "awq"),
                        help="int4 rounding: awq (activation-aware, from the calibration's routed-token "
                             "statistics; round to nearest without them) or rtn (round to nearest)"),
        "seed": Key(int, 0),
    },
    "build": {
        "backend": Key(str, "embedded", choices=("embedded", "tensorrt-llm")),
        "max_batch_size": Key(int, 8, **_POS),
        "max_input_len": Key(int, 1024, **_POS),
        "max_seq_len": Key(int, None, nullable=True, **_POS),
        "max_num_tokens": Key(int, 8192, **_POS),
        "max_beam_width": Key(int, 1, choices=(1,), help="beam search is not supported"),
        "tokens_per_block": Key(int, 32, choices=(8, 16, 32, 64, 128)),
        "kv_cache_type": Key(str, "paged", choices=("paged", "continuous")),
        "gemm_plugin": Key(str, "auto", choices=("auto", "float16", "bfloat16", "float32", "disable")),
        "gpt_attention_plugin": Key(str, "auto", choices=("auto", "float16", "bfloat16", "float32")),
        "moe_plugin": Key(str, "auto", choices=("auto", "float16", "bfloat16", "float32")),
        "context_fmha": Key(bool, True),
        "use_paged_context_fmha": Key(bool, True),
        "remove_input_padding": Key(bool, True),
        "workers": Key(int, 1, **_POS),
        "device": Key(str, "auto", choices=("auto", "cpu", "cuda")),
    },
    "repo": {  # `trtmoe repo`: the Triton model repository (limits are checked against the engine's)
        "tokenizer": Key(str, None, nullable=True, help="tokenizer folder [default: beside the engine]"),
        "max_batch_size": Key(int, None, nullable=True, help="<= the engine's", **_POS),
        "max_beam_width": Key(int, None, nullable=True, help="must equal the engine's", **_POS),
        "max_input_len": Key(int, None, nullable=True, help="<= the engine's", **_POS),
        "max_seq_len": Key(int, None, nullable=True, help="<= the engine's", **_POS),
        "world_size": Key(int, None, nullable=True, help="checked against the engine's tp × pp", **_POS),
        "streaming": Key(bool, False, help="decoupled models that stream tokens (upstream's default: not)"),
        "exclude_input_in_output": Key(bool, False, help="leave the prompt out of non-streamed outputs"),
        "max_queue_delay_microseconds": Key(int, 0, minimum=0),
        "max_queue_size": Key(int, 0, minimum=0, help="0 = unbounded"),
        "preprocessing_instance_count": Key(int, 1, **_POS),
        "postprocessing_instance_count": Key(int, 1, **_POS),
        "bls_instance_count": Key(int, 1, **_POS),
        "kv_cache_free_gpu_mem_fraction": Key((int, float), None, nullable=True, minimum=0, maximum=1,
                                              help="TensorRT engines only"),
        "device": Key(str, None, nullable=True, help="embedded engine: auto, cpu, cuda, cuda:N"),
        "torch_num_threads": Key(int, 0, minimum=0, help="0 = from this machine's cores and the instance counts"),
        "stream_interval": Key(int, None, nullable=True, minimum=0, help="embedded engine: a response every N tokens"),
        "trust_remote_code": Key(bool, False),
    },
    "serve": {  # `trtmoe serve`: the tritonserver process
        "host": Key(str, "127.0.0.1", help="address to bind (0.0.0.0 exposes the server)"),
        "http_port": Key(int, 8000, minimum=0, maximum=65535, help="0 picks a free port"),
        "grpc_port": Key(int, 8001, minimum=0, maximum=65535, help="0 picks a free port"),
        "metrics_port": Key(int, 8002, minimum=0, maximum=65535, help="0 picks a free port"),
        "world_size": Key(int, None, nullable=True, help="MPI ranks [default: the repository's]", **_POS),
        "server": Key(str, None, nullable=True, choices=("system", "pytriton")),
        "timeout_s": Key((int, float), 300.0, minimum=1, help="seconds to wait for the models to load"),
        "log_verbose": Key(int, 0, minimum=0),
    },
}
TOP_LEVEL = {"model": Key(str, None, nullable=True, help="HF model directory or hub id")}


def _type_name(t) -> str:
    if isinstance(t, tuple):
        return " or ".join(x.__name__ for x in t)
    return t.__name__


def check_value(where: str, key: Key, value: Any) -> Any:
    if value is None:
        if key.nullable or key.default is None:
            return None
        raise ConfigError(f"{where} must not be null")
    if key.type is float or (isinstance(key.type, tuple) and float in key.type):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif key.type is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, key.type)
    if not ok:
        raise ConfigError(f"{where} must be {_type_name(key.type)}, got {value!r}")
    if key.choices is not None and isinstance(value, list):
        bad = [v for v in value if v not in key.choices]
        if bad:
            raise ConfigError(f"{where} has {', '.join(map(repr, bad))}, not allowed",
                              hint="allowed items: " + ", ".join(map(str, key.choices)))
    elif key.choices is not None and value not in key.choices:
        raise ConfigError(f"{where} = {value!r} is not allowed", hint="allowed: " + ", ".join(map(str, key.choices)))
    if key.minimum is not None and value < key.minimum:
        raise ConfigError(f"{where} = {value!r} is below the minimum {key.minimum}")
    if key.maximum is not None and value > key.maximum:
        raise ConfigError(f"{where} = {value!r} is above the maximum {key.maximum}")
    return value


def defaults() -> dict:
    out = {s: {k: key.default for k, key in keys.items()} for s, keys in SCHEMA.items()}
    out["model"] = None
    return out


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error as one phrase with its position (PyYAML's own text spans several lines)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    what = getattr(e, "problem", None) or getattr(e, "context", None) or type(e).__name__
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{' '.join(str(what).split())}{where}"


def load_yaml(path: str | Path | None) -> dict:
    """Read and validate a YAML build config; returns only the keys it sets."""
    if path is None:
        return {}
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError("config file not found", where=str(p)) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a YAML file", where=str(p)) from None
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror}", where=str(p)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"not UTF-8 text (byte {e.start}, line {line})", where=str(p)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {_yaml_problem(e)}", where=str(p)) from None
    except RecursionError:
        raise ConfigError("not valid YAML: nested too deeply", where=str(p)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("top level must be a mapping", where=str(p))
    out: dict = {}
    for sec, body in data.items():
        if sec in TOP_LEVEL:
            out[sec] = check_value(f"{p}: {sec}", TOP_LEVEL[sec], body)
            continue
        if sec not in SCHEMA:
            raise ConfigError(f"unknown section {sec!r}", where=str(p),
                              hint="allowed: " + ", ".join([*TOP_LEVEL, *SCHEMA]))
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"section {sec!r} must be a mapping", where=str(p))
        for k, v in body.items():
            if k not in SCHEMA[sec]:
                raise ConfigError(f"unknown key {sec}.{k}", where=str(p),
                                  hint=f"allowed in {sec}: " + ", ".join(SCHEMA[sec]))
            out.setdefault(sec, {})[k] = check_value(f"{p}: {sec}.{k}", SCHEMA[sec][k], v)
    return out


def resolve(yaml_path: str | Path | None = None, cli: dict | None = None) -> dict:
    """Merge CLI > YAML > defaults. ``cli`` is ``{section: {key: value}}``; None values mean 'not given'."""
    cfg = defaults()
    for src in (load_yaml(yaml_path), cli or {}):
        for sec, body in src.items():
            if sec in TOP_LEVEL:
                if body is not None:
                    cfg[sec] = body
                continue
            for k, v in (body or {}).items():
                if v is not None:
                    cfg[sec][k] = check_value(f"--{k.replace('_', '-')}", SCHEMA[sec][k], v)
    return cfg
