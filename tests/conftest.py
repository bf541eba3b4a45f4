"""Shared test fixtures: tiny seeded MoE checkpoints and reference logits."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _load_script(name: str):
    """Import ``scripts/<name>.py`` as a module (scripts/ is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


make_tiny_models = _load_script("make_tiny_models")

# pytest-timeout's limit for tests marked slow or server (the default, for the rest, is pyproject's
# [tool.pytest.ini_options] timeout): a module's first server test also starts the server.
SLOW_TIMEOUT_S = 1200
SERVER_MODULE_PREFIXES = ("test_triton_", "test_serving_")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name.startswith(SERVER_MODULE_PREFIXES):
            item.add_marker(pytest.mark.server)
        if (item.get_closest_marker("slow") or item.get_closest_marker("server")) \
                and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


def hf_logits(model_dir: str | Path, input_ids: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference logits [B, T, vocab] (float32) for an HF checkpoint directory.

    mixtral/qwen2_moe/qwen3_moe run through transformers with weights cast to ``dtype``;
    DeepSeek-MoE v1 runs through tests/reference/deepseek_v1.py, which is fp32 only.
    """
    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    if model_type == "deepseek":
        if dtype != torch.float32:
            raise ValueError("the DeepSeek-MoE v1 reference computes in float32 only")
        from tests.reference.deepseek_v1 import deepseek_v1_logits

        return deepseek_v1_logits(model_dir, input_ids)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


@pytest.fixture(name="hf_logits")
def hf_logits_fixture() -> Callable[..., torch.Tensor]:
    """The ``hf_logits(model_dir, input_ids, dtype=torch.float32)`` helper as a fixture."""
    return hf_logits


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[..., Path]:
    """Factory: ``tiny_model(arch, dtype=..., sharded=..., tied=..., seed=..., **overrides)``
    returns a checkpoint directory, built once per distinct argument set per session and shared
    between tests, so treat it as read-only (copy it before changing anything)."""
    cache: dict[str, Path] = {}

    def make(arch: str, **kwargs: Any) -> Path:
        key = json.dumps([arch, kwargs], sort_keys=True, default=str)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_models.make_tiny_model(arch, out, **kwargs)
        return cache[key]

    return make


TRAINED_MIXTRAL = REPO_ROOT / "tests" / "fixtures" / "trained_mixtral"
TRAINED_QWEN3_MOE = REPO_ROOT / "tests" / "fixtures" / "trained_qwen3_moe"

# Under CI (CI=true, as CI services and .ci/run set it) whatever the test extra installs and every
# committed fixture must be present: a missing one fails instead of skipping, so a broken install
# cannot pass as a run with fewer tests. Elsewhere it skips, saying what is missing.
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(reason: str) -> None:
    """Skip the calling test (or module, at import time) with ``reason``; under CI, fail with it."""
    if IN_CI:
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(module: str, why: str = "installed by the test extra: pip install -e '.[test]'"):
    """``import module`` for a dependency the test extra installs; missing, the caller is skipped
    locally and fails under CI (see ``IN_CI``)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        error = exc
    missing(f"{module} cannot be imported ({error}); {why}")


def no_w4a8_search(monkeypatch) -> None:
    """Make any W4A8 pre-quant scale and clip search fail the test: what runs after it must take the
    recipes a calibration stored."""
    from trtmoe.quant import awq

    def refuse(*a, **k):
        raise AssertionError("searched although the calibration stored the recipe")
    monkeypatch.setattr(awq, "_w4a8_search", refuse)


def require_fixture(path: Path) -> Path:
    """``path`` (a committed trained fixture); missing, the caller is skipped locally, saying how to
    make it, and fails under CI."""
    if not (path / "config.json").is_file():
        missing(f"tests/fixtures/{path.name} is missing (make it with scripts/make_trained_fixture.py)")
    return path


MODELOPT_LOCAL = REPO_ROOT / ".venv-modelopt"  # scripts/modelopt_env.sh's default (git-ignored)
MODELOPT_SHARED = Path("/work/venvs/modelopt")  # a machine-wide one, used when the local one is absent


def modelopt_python_path() -> Path:
    """Where the optional ModelOpt environment's interpreter is: $TRTMOE_MODELOPT_PYTHON, else the
    repo-local ``.venv-modelopt`` that scripts/modelopt_env.sh makes, else /work/venvs/modelopt when
    only that one exists."""
    env = os.environ.get("TRTMOE_MODELOPT_PYTHON")
    if env:
        return Path(env)
    local = MODELOPT_LOCAL / "bin" / "python"
    shared = MODELOPT_SHARED / "bin" / "python"
    return shared if not local.exists() and shared.exists() else local


MODELOPT_FIND = ("import importlib.util, sys; "
                 "m = [n for n in ('modelopt', 'transformers', 'torch', 'safetensors') if not importlib.util.find_spec(n)]; "
                 "print(', '.join(m)); sys.exit(1 if m else 0)")
_MODELOPT_PROBLEM: list[str | None] = []


def modelopt_problem() -> str | None:
    """Why the ModelOpt environment cannot run the oracle scripts (None: it can), checked once per run:
    its interpreter must exist and have ModelOpt, transformers, torch and safetensors installed (found,
    not imported: importing ModelOpt takes half a minute, which the oracle processes pay anyway)."""
    if not _MODELOPT_PROBLEM:
        exe = modelopt_python_path()
        why = None
        if not os.access(exe, os.X_OK):
            why = f"{exe} is not there (make it with scripts/modelopt_env.sh or set TRTMOE_MODELOPT_PYTHON)"
        else:
            try:
                p = subprocess.run([str(exe), "-c", MODELOPT_FIND], capture_output=True, text=True, timeout=120,
                                   cwd=tempfile.gettempdir())
                if p.returncode:
                    why = f"{exe} lacks {p.stdout.strip() or p.stderr.strip()[-200:]}"
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"{exe} is unusable: {e}"
        _MODELOPT_PROBLEM.append(why)
    return _MODELOPT_PROBLEM[0]


def modelopt_python() -> str:
    """The interpreter of the optional ModelOpt environment (modelopt_python_path()). ModelOpt is no
    dependency of trtmoe, so a missing or broken one always skips the caller (.ci/allowed-skips lists
    this reason); called at module level it skips the whole module."""
    why = modelopt_problem()
    if why:
        pytest.skip(f"needs the optional ModelOpt environment: {why}", allow_module_level=True)
    return str(modelopt_python_path())


@pytest.fixture(scope="session")
def modelopt_py() -> str:
    """modelopt_python() as a fixture: only the tests that ask for it pay the environment check."""
    return modelopt_python()


def wait_settled(read: Callable[[], Any], quiet_s: float = 1.0, timeout_s: float = 30.0, what: str = "",
                 interval_s: float = 0.1):
    """The value of ``read()`` once it has not changed for ``quiet_s`` (for counters published every
    0.5 s: pick ``quiet_s`` above the publication period); an AssertionError naming ``what`` when it
    is still changing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last, since = read(), time.monotonic()
    while True:
        now = time.monotonic()
        if now - since >= quiet_s:
            return last
        if now >= deadline:
            raise AssertionError(f"still changing after {timeout_s:g} s: {what or read} (last: {last!r})")
        time.sleep(interval_s)
        value = read()
        if value != last:
            last, since = value, time.monotonic()


def wait_until(condition: Callable[[], Any], timeout_s: float = 10.0, what: str = "", interval_s: float = 0.05):
    """Call ``condition`` until it returns something true, and return that; an AssertionError naming
    ``what`` and the last value when ``timeout_s`` passes first. For counters and metrics that are
    published asynchronously: wait on the condition itself, never a fixed time."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what or condition} (last: {value!r})")
        time.sleep(interval_s)


def float_engine(fixture: Path, tmp_path_factory, name: str):
    """``fixture`` converted to a float32 checkpoint (lossless from its bf16 weights) and loaded in the
    embedded engine on CPU."""
    from trtmoe.checkpoint.writer import convert
    from trtmoe.runtime.engine import EmbeddedEngine

    ckpt = tmp_path_factory.mktemp(name) / "ckpt"
    convert(fixture, ckpt, dtype="float32")
    return EmbeddedEngine.from_checkpoint(ckpt, device="cpu")


def tokenized_tiny_mixtral(tiny_model, root: Path, name: str) -> tuple[Path, Path]:
    """A writable copy of the tiny Mixtral (vocabulary 2048) with the trained fixture's tokenizer, so
    every command (calibrate, repo, serve) can run on it, and a small calibration text beside it."""
    from trtmoe.data import write_split_text

    model = Path(shutil.copytree(tiny_model("mixtral", vocab_size=2048), root / name))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(TRAINED_MIXTRAL / f, model / f)
    text = root / "calib.txt"
    write_split_text("calib", text, max_bytes=20000)
    return model, text


def tiny_mixtral_engine(tiny_model, root: Path, name: str) -> tuple[Path, Path, Path, Path]:
    """``tokenized_tiny_mixtral`` converted (float) into ``root/ckpt`` and built as an embedded engine
    into ``root/engine`` (max_input_len 64). Returns (model, calibration text, ckpt, engine)."""
    from trtmoe.build.embedded import build_embedded
    from trtmoe.checkpoint.writer import convert
    from trtmoe.config import defaults

    model, text = tokenized_tiny_mixtral(tiny_model, root, name)
    convert(model, root / "ckpt")
    build_embedded(root / "ckpt", root / "engine", {**defaults()["build"], "max_input_len": 64})
    return model, text, root / "ckpt", root / "engine"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: one thread is faster, and an oversubscribed shared CPU makes OpenMP crawl."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def start_serve_command(repo: Path, log_file: Path, timeout_s: float = 240,
                        extra_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """Run the real `trtmoe serve REPO` (free ports, then ``extra_args``) in a child process until it
    prints its ready line. Returns the process and that line; the caller stops the process."""
    script = ("import sys; from trtmoe.triton.commands import serve_command; "
              "serve_command.main(sys.argv[1:], standalone_mode=True)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(repo), "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0", "--log-file", str(log_file), *extra_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    lines = []
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("ready:") or proc.poll() is not None:
            break
    if not lines or not lines[-1].startswith("ready:"):
        proc.kill()
        raise AssertionError("trtmoe serve did not get ready:\n" + "".join(lines))
    return proc, lines[-1]


def request_getter(**tensors):
    """A tensorrt_llm request's input getter (``parse_requests``' argument): prompt [1, 5, 9] of a
    length-4 row, 4 output tokens, plus ``tensors``."""
    import numpy as np

    base = {"input_ids": np.array([[1, 5, 9, 0]], np.int32), "input_lengths": np.array([[3]], np.int32),
            "request_output_len": np.array([[4]], np.int32)}
    base.update(tensors)
    return lambda name: base.get(name)


def routed_tokens_per_layer(metrics_url: str, before: dict, expected: int, timeout_s: float = 10.0) -> dict:
    """Routed-token counts per MoE layer added since ``before`` (a ``routed_token_table``), read from a
    served model's metrics until every layer shows ``expected`` (they are published every 0.5 s) or
    ``timeout_s`` passes; the last reading either way."""
    import time

    from trtmoe.triton.metrics import routed_token_table, scrape

    per_layer: dict = {}
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        after = routed_token_table(scrape(metrics_url))
        per_layer = {li: sum(v - before.get((li, e), 0) for (l2, e), v in after.items() if l2 == li)
                     for li in {k[0] for k in after}}
        if per_layer and all(v == expected for v in per_layer.values()):
            break
        time.sleep(0.3)
    return per_layer


def thread_affinities(pid: int) -> dict[str, list[int]]:
    """Every thread of process ``pid``: "name:tid" -> the cores it may run on (``--decode-cores`` tests)."""
    import os

    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            out[f"{name}:{tid}"] = sorted(os.sched_getaffinity(int(tid)))
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
    return out


def assert_decode_thread_alone(server, decode: list[int], rest: list[int]) -> None:
    """A served embedded model's decode thread (``trtmoe-decode``) is the only thread on ``decode``; every
    other thread of every backend process, and of tritonserver, is on ``rest``."""
    on_decode = []
    for pid in server.stubs:
        threads = thread_affinities(pid)
        on_decode += [n.split(":")[0] for n, c in threads.items() if c == decode]
        assert all(c == rest for n, c in threads.items() if not n.startswith("trtmoe-decode")), threads
    assert on_decode == ["trtmoe-decode"], {pid: thread_affinities(pid) for pid in server.stubs}
    assert all(c == rest for c in thread_affinities(server.process.pid).values())


def grpc_stream(url: str, model: str, inputs: list, timeout: float = 60.0, on_first=None,
                **infer_kwargs) -> tuple[list, Exception | None]:
    """A raw ModelStreamInfer call through tritonclient: every response until the one flagged final,
    or the first error (returned with the responses before it). ``on_first()`` runs once the first
    response arrived; ``infer_kwargs`` go to ``async_stream_infer`` (request_id, ...)."""
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, **infer_kwargs)
        out = []
        while True:
            res, err = q.get(timeout=timeout)
            if err is not None:
                return out, err
            out.append(res)
            if len(out) == 1 and on_first is not None:
                on_first()
            if res.get_response().parameters["triton_final_response"].bool_param:
                return out, None
    finally:
        client.stop_stream()
        client.close()


@pytest.fixture(scope="module")
def tiny_qwen3_with_ids(tiny_model, tmp_path_factory):
    """A tiny bf16 Qwen3-MoE (expert FFN 64) and a directory holding ``ids.json``: two seeded windows of
    16 calibration token ids, for converts that measure input amax."""
    import random

    model = tiny_model("qwen3_moe", dtype="bfloat16", moe_intermediate_size=64)
    d = tmp_path_factory.mktemp("qwen3-ids")
    rng = random.Random(0)
    (d / "ids.json").write_text(json.dumps([[rng.randrange(250) for _ in range(16)] for _ in range(2)]))
    return model, d
