"""What the Triton Python models that run the embedded engine share: reading their parameters and
loading the engine a repository names.

Two models use it: ``tensorrt_llm`` of the default (``inflight_batcher_llm``) layout, token ids in
and out behind the ensemble, and ``tensorrt_llm`` of the ``llmapi`` layout, text in and out in one
model. Both run inside Triton's Python-backend stub, which imports trtmoe; they import this module
in ``initialize`` (it brings torch), not at the top: Triton also imports a model's file in a stub of
its own to complete its config, which would otherwise spend seconds importing torch.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..runtime.engine import EmbeddedEngine
from ..runtime.unified_load import is_unified_checkpoint, load_unified_engine
from . import cpu_binding
from .engine_dir import read_engine_dir
from .llm_request import EngineLimits
from .metrics import (IterationRecorder, MetricWriter, RoutingMetricsPublisher, TokenLengthHistograms,
                      TrtLlmMetricsPublisher, next_update_wait)
from .model_params import model_flag, model_param
from .threads import name_native_thread


@dataclass
class ServedEngine:
    engine: Any  # trtmoe.runtime.engine.EmbeddedEngine
    info: Any  # trtmoe.triton.engine_dir.EngineInfo
    limits: EngineLimits
    repo_root: str
    cores: int
    decode_cores: set[int] | None = None  # the decode thread's cores (``decode_cores``), None unbound
    binding: str = ""  # what the binding did, or why it could not, for the model's log; "" when not asked

    def resolve(self, path: str) -> str:
        """A path parameter: absolute as given, else relative to the repository root."""
        return path if os.path.isabs(path) else os.path.join(self.repo_root, path)

    def log_binding(self, logger) -> None:
        """Say in the server log what ``decode_cores`` did (info), or why it could not (warning)."""
        if self.binding:
            (logger.log_info if self.decode_cores else logger.log_warn)(f"tensorrt_llm: {self.binding}")


def load_served_engine(config: dict, model_dir: str) -> ServedEngine:
    """Set torch's threads from ``torch_num_threads`` (never more than this machine's cores: a
    repository may move to a smaller one), read the engine directory ``engine_dir`` names (relative
    to the repository root, the parent of ``model_dir``) and load its checkpoint with the engine's
    recorded settings. The token limits are the engine's, lowered by ``max_input_len`` /
    ``max_seq_len`` where the repository sets them lower. Raises ValueError when ``engine_dir`` is
    unset, and trtmoe's own errors for a bad engine directory."""
    import torch

    cores = len(cpu_binding.allowed_cores())
    threads = int(model_param(config, "torch_num_threads", "0") or 0)
    decode, binding = _bind(model_param(config, "decode_cores", ""), threads or torch.get_num_threads())
    if threads > 0:
        torch.set_num_threads(min(threads, len(decode) if decode else cores))
    engine_dir = model_param(config, "engine_dir")
    if not engine_dir:
        raise ValueError("parameter engine_dir is not set")
    repo_root = os.path.dirname(os.path.abspath(model_dir))
    if not os.path.isabs(engine_dir):
        engine_dir = os.path.join(repo_root, engine_dir)
    info = read_engine_dir(engine_dir)
    device = model_param(config, "device", "auto")
    load = load_unified_engine if is_unified_checkpoint(info.checkpoint_dir) else EmbeddedEngine.from_checkpoint
    engine = load(str(info.checkpoint_dir), device=None if device == "auto" else device,
                  max_seq_len=info.max_seq_len, cpu_matmul=info.cpu_matmul, cpu_activations=info.cpu_activations,
                  weights=model_param(config, "weights", "checkpoint"))
    max_input = min(int(model_param(config, "max_input_len", str(info.max_input_len))), info.max_input_len)
    max_seq = min(int(model_param(config, "max_seq_len", str(info.max_seq_len))), info.max_seq_len,
                  int(getattr(engine, "max_seq_len", info.max_seq_len)))
    limits = EngineLimits(max_input_len=max_input, max_seq_len=max_seq, vocab_size=int(engine.vocab_size),
                          max_beam_width=info.max_beam_width, default_end_id=info.eos_token_id,
                          gather_context_logits=info.gather_context_logits,
                          gather_generation_logits=info.gather_generation_logits)
    return ServedEngine(engine=engine, info=info, limits=limits, repo_root=repo_root, cores=cores,
                        decode_cores=decode, binding=binding)


def _bind(spec: str, threads: int) -> tuple[set[int] | None, str]:
    """Apply ``decode_cores`` to this process (see ``trtmoe.triton.cpu_binding``): every thread it has
    now moves to the cores left over, so the threads it starts later stay there too; the decode cores
    are returned for the batcher's thread to move to. Cores a launcher resolved (``trtmoe serve``, from
    the repository manifest) come first, even over a config.pbtxt edited since: the launcher has
    already kept the process off them. Returns (decode cores or None, a line for the log)."""
    decode = cpu_binding.from_environment()
    if decode is None and cpu_binding.parse_cores(spec) is None:
        return None, ""
    if decode is not None:
        rest = cpu_binding.allowed_cores() - decode
        result = (decode, rest) if rest else f"{cpu_binding.ENV} {cpu_binding.format_cores(decode)} leaves no core"
    else:
        result = cpu_binding.plan(spec, threads)
    if isinstance(result, str):
        return None, f"decode_cores not applied: {result}"
    decode, rest = result
    try:
        cpu_binding.bind_process_threads(rest)
    except OSError as e:
        return None, f"decode_cores not applied: {e}"
    return decode, (f"decode thread on cores {cpu_binding.format_cores(decode)}, the other threads on "
                    f"{cpu_binding.format_cores(rest)}")


class ServedMetrics:
    """The routing gauges (``trtmoe_*``) and TensorRT-LLM's ``nv_trt_llm_*`` gauges of an embedded model,
    updated on a thread of their own (an update is dozens of IPC calls and must not stall decoding).

    ``recorder`` wraps the engine for the batcher: it records what each iteration ran. With the
    ``enable_metrics`` parameter false nothing is published (the recorder still wraps the engine)."""

    def __init__(self, pb_utils, engine, config: dict, model_name: str, version: str, tokens_per_block: int):
        self.engine, self.tokens_per_block, self._log = engine, tokens_per_block, pb_utils.Logger
        self.recorder = IterationRecorder(engine)
        self.routing = self.trt = self.lengths = None
        if model_flag(config, "enable_metrics", True):
            writer = MetricWriter()  # one pacing for both publishers: they write from one thread
            self.routing = RoutingMetricsPublisher(pb_utils, num_layers=int(engine.num_layers),
                                                   num_experts=int(engine.num_experts), model=model_name,
                                                   min_interval_s=float(model_param(config, "metrics_interval_s", "0.5")),
                                                   writer=writer)
            self.routing.set_active_params(int(engine.active_params_per_token))
            self.trt = TrtLlmMetricsPublisher(pb_utils, model=model_name, version=version, writer=writer)
            self.lengths = TokenLengthHistograms(pb_utils, model=model_name, version=version)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, batcher) -> None:
        if self.routing is not None:
            self.thread = threading.Thread(target=self._loop, args=(batcher,), name="tensorrt_llm-metrics",
                                           daemon=True)
            self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def _loop(self, batcher) -> None:
        name_native_thread("trtmoe-metrics")
        interval = self.routing.min_interval_s
        routing_due = 0.0  # monotonic s when the per-expert series are next written
        while not self.stopping.wait(interval):
            try:
                self.update_requests(batcher)
                if time.monotonic() >= routing_due:
                    # Thousands of expert series make this slow: space them out (see trtmoe.triton.metrics),
                    # while the request and token series above keep their interval.
                    t0 = time.monotonic()
                    self.routing.update(self.engine.routing_stats(), None)
                    routing_due = time.monotonic() + next_update_wait(interval, time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001 - metrics must never take the model down
                self._log.log_warn(f"tensorrt_llm: metrics update failed: {e}")

    def update_requests(self, batcher) -> None:
        """The few series a dashboard reads per request (batcher and token counters, ``nv_trt_llm_*``
        gauges, the finished requests' token-length histograms): written every interval."""
        stats = batcher.stats()
        self.routing.update(None, stats)
        self.trt.update(TrtLlmMetricsPublisher.values(
            batcher_stats=stats, max_batch_size=batcher.max_batch_size, kv=self.engine.kv_cache_stats(),
            tokens_per_block=self.tokens_per_block, iteration=self.recorder.latest,
            max_seq_len=int(getattr(self.engine, "max_seq_len", 0) or 0)))
        for n_in, n_out in batcher.take_finished_lengths():
            self.lengths.observe(n_in, n_out)
