"""Expert-routing and batcher metrics, exported by the embedded ``tensorrt_llm`` Triton model as
custom Prometheus metrics on the server's metrics port (``/metrics``).

One schema, the same as the calibration report: tokens routed per (layer, expert), and per layer
the router entropy and the load imbalance (busiest expert / mean expert load).

| metric | kind | labels | meaning |
|---|---|---|---|
| ``trtmoe_expert_routed_tokens_total`` | counter | model, layer, expert | top-k assignments since start |
| ``trtmoe_router_entropy_nats`` | gauge | model, layer | mean per-token router entropy over tokens routed since the previous update (nats) |
| ``trtmoe_expert_load_imbalance`` | gauge | model, layer | max / mean of the per-expert counters (1.0 = perfectly balanced) |
| ``trtmoe_dead_experts`` | gauge | model, layer | experts that have received no token yet |
| ``trtmoe_active_params_per_token`` | gauge | model | parameters touched per token (dense + top-k experts) |
| ``trtmoe_decode_steps_total`` | counter | model | decode steps the engine ran (batched: one per step) |
| ``trtmoe_decode_distinct_experts_total`` | counter | model, layer | distinct experts read per decode step, summed over steps |
| ``trtmoe_decode_distinct_experts`` | gauge | model, layer | mean distinct experts read per decode step since the previous update |
| ``trtmoe_decode_bytes_read_total`` | counter | model, kind=experts/weights/kv_cache | bytes decode steps read: routed experts touched (at their formats' sizes), the other weights, the KV cache |
| ``trtmoe_batcher_requests`` | gauge | model, state=active/waiting | in-flight batcher occupancy |
| ``trtmoe_batcher_iterations_total`` | counter | model | decode steps run |
| ``trtmoe_generated_tokens_total`` | counter | model | tokens generated |

Beside them, the gauges TensorRT-LLM's Triton backend exports (names, label keys and label values
as its ``custom_metrics_reporter``; labels ``model`` and ``version`` on each), for dashboards built
for it. Per-iteration values describe the latest decode iteration (as the backend's iteration stats
do); they are measured by :class:`IterationRecorder` around the engine's own calls.

| family | label key | values (embedded engine) |
|---|---|---|
| ``nv_trt_llm_request_metrics`` | ``request_type`` | active (in the batch), max (max batch size), scheduled (context + generation requests of the latest iteration), context (prefilled in it), waiting (queued) |
| ``nv_trt_llm_runtime_memory_metrics`` | ``memory_type`` | cpu, gpu (bytes of the KV cache allocated now, on the engine's device), pinned (0) |
| ``nv_trt_llm_kv_cache_block_metrics`` | ``kv_cache_block_type`` | max (blocks the cache may grow to: max_batch_size sequences of max_seq_len tokens, or more when allocated), free (max - used), used (rows held by live sequences), tokens_per (the engine's ``tokens_per_block``), reused (0: no prefix reuse), fraction (used / max) |
| ``nv_trt_llm_inflight_batcher_metrics`` | ``inflight_batcher_specific_metric`` | total_context_tokens, generation_requests (latest iteration), micro_batch_id (0: no pipeline micro-batches), paused_requests (0: nothing is paused) |
| ``nv_trt_llm_general_metrics`` | ``general_type`` | timestamp (of the latest iteration, microseconds since the epoch), iteration_counter |

and the histograms ``nv_llm_input_token_len`` / ``nv_llm_output_token_len`` (label
``response_metric_type`` = total_input_tokens / total_output_tokens; buckets 10, 50, 100, 500, 1000)
of each finished request's prompt and output lengths (:class:`TokenLengthHistograms`).

The embedded engine's cache is one row per sequence (see ``trtmoe.runtime.engine``); block counts
are rows in units of ``tokens_per_block`` (ceil(row tokens / tokens_per_block) per row).

Cost: every ``set`` or ``increment`` of a Python-backend metric is a round trip to tritonserver,
made with the GIL held. A fine-grained MoE has thousands of per-expert counters (Qwen3-30B-A3B:
48 layers x 128 experts), and publishing them all at once would stall the decode thread for the
whole round of calls. So the publishers skip gauges whose value has not changed, write in short
bursts with a pause between them (:class:`MetricWriter`), and the model spaces its per-expert updates
by :func:`next_update_wait` so that publishing takes a bounded share of the wall time however many
series there are, for at most ``MAX_UPDATE_WAIT_S`` between two. The few request, token and
``nv_trt_llm_*`` series are written every ``metrics_interval_s`` whatever the expert series cost, so
a finished request moves ``trtmoe_generated_tokens_total`` within one interval.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable

ROUTED = "trtmoe_expert_routed_tokens_total"
ENTROPY = "trtmoe_router_entropy_nats"
IMBALANCE = "trtmoe_expert_load_imbalance"
DEAD = "trtmoe_dead_experts"
ACTIVE_PARAMS = "trtmoe_active_params_per_token"
BATCHER_REQUESTS = "trtmoe_batcher_requests"
BATCHER_ITERATIONS = "trtmoe_batcher_iterations_total"
GENERATED = "trtmoe_generated_tokens_total"
DECODE_STEPS = "trtmoe_decode_steps_total"
DECODE_DISTINCT = "trtmoe_decode_distinct_experts_total"
DECODE_DISTINCT_MEAN = "trtmoe_decode_distinct_experts"
DECODE_BYTES = "trtmoe_decode_bytes_read_total"
DECODE_BYTE_KINDS = {"experts": "expert_bytes", "weights": "nonexpert_bytes", "kv_cache": "kv_bytes"}


@dataclass(frozen=True)
class LayerRouting:
    """Routing summary of one MoE layer."""

    layer: int
    counts: tuple[int, ...]
    imbalance: float  # max / mean expert count; 0.0 before any token
    dead_experts: int


def _rows(x: Any) -> list[list[int]]:
    return x.tolist() if hasattr(x, "tolist") else [list(r) for r in x]


def summarize_routing(counts: Any) -> list[LayerRouting]:
    """Per-layer imbalance (max/mean) and dead-expert count from a [layers, experts] count table."""
    out = []
    for layer, row in enumerate(_rows(counts)):
        row = [int(c) for c in row]
        total = sum(row)
        mean = total / len(row) if row else 0.0
        out.append(LayerRouting(layer, tuple(row), (max(row) / mean) if mean > 0 else 0.0,
                                sum(1 for c in row if c == 0)))
    return out


# A metrics update may take at most 1 / UPDATE_DUTY of the wall time: the next one waits at least
# this many times as long as the last one took, and never more than MAX_UPDATE_WAIT_S (a host stall
# that made one update slow must not leave the gauges minutes old).
UPDATE_DUTY = 20
MAX_UPDATE_WAIT_S = 5.0
# Calls per burst and the pause after each: the decode thread waits at most one burst for the GIL.
BURST_CALLS = 32
BURST_PAUSE_S = 0.001


def next_update_wait(min_interval_s: float, took_s: float, duty: float = UPDATE_DUTY,
                     max_wait_s: float = MAX_UPDATE_WAIT_S) -> float:
    """Seconds until the next metrics update, after one that took ``took_s``: ``min_interval_s``, or
    longer when updates are slow (many series), so that they take at most 1 / ``duty`` of the time,
    but at most ``max_wait_s`` (or ``min_interval_s`` when that is longer)."""
    return min(max(min_interval_s, duty * max(took_s, 0.0)), max(max_wait_s, min_interval_s))


class MetricWriter:
    """Writes Python-backend metric values in bursts of ``burst`` calls with a ``pause_s`` sleep (which
    releases the GIL) after each, and skips a ``set`` that would not change the value last set through
    it. ``calls`` counts the calls made."""

    def __init__(self, burst: int = BURST_CALLS, pause_s: float = BURST_PAUSE_S, sleep=time.sleep):
        self.burst, self.pause_s, self._sleep = max(int(burst), 1), pause_s, sleep
        self.calls = 0
        self._last: dict[int, float] = {}  # id(metric) -> value last set (the metrics live as long as we do)

    def set(self, metric: Any, value: float) -> None:
        value = float(value)
        key = id(metric)
        last = self._last.get(key)
        if last is not None and (last == value or (math.isnan(last) and math.isnan(value))):
            return
        metric.set(value)
        self._last[key] = value
        self._tick()

    def increment(self, metric: Any, value: float) -> None:
        metric.increment(float(value))
        self._tick()

    def _tick(self) -> None:
        self.calls += 1
        if self.calls % self.burst == 0 and self.pause_s > 0:
            self._sleep(self.pause_s)


def blocks(tokens: int, tokens_per_block: int) -> int:
    """KV-cache blocks that hold ``tokens`` tokens."""
    return -(-int(tokens) // max(int(tokens_per_block), 1))


class IterationRecorder:
    """Wraps an engine (``start``/``start_many``/``step``) and records what each iteration of the
    in-flight batcher ran: prefilled requests and tokens since the previous decode step, then the
    step's generation requests. ``latest`` is replaced (not mutated) once per decode step, so another
    thread can read it without a lock. Every other attribute is the engine's."""

    def __init__(self, engine: Any):
        self._engine = engine
        self._ctx_requests = 0
        self._ctx_tokens = 0
        self.iterations = 0
        self.latest: dict[str, float] = {"context_requests": 0, "context_tokens": 0, "generation_requests": 0,
                                         "scheduled_requests": 0, "timestamp_us": 0, "iteration": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def start_many(self, prompts, params):
        seqs = self._engine.start_many(prompts, params)
        self._ctx_requests += len(prompts)
        self._ctx_tokens += sum(len(p) for p in prompts)
        return seqs

    def start(self, prompt_ids, params):
        seq = self._engine.start(prompt_ids, params)
        self._ctx_requests += 1
        self._ctx_tokens += len(prompt_ids)
        return seq

    def step(self, seqs):
        generation = sum(1 for s in seqs if not getattr(s, "finished", False))
        out = self._engine.step(seqs)
        self.iterations += 1
        self.latest = {"context_requests": self._ctx_requests, "context_tokens": self._ctx_tokens,
                       "generation_requests": generation, "scheduled_requests": self._ctx_requests + generation,
                       "timestamp_us": time.time_ns() // 1000, "iteration": self.iterations}
        self._ctx_requests = self._ctx_tokens = 0
        return out


class TrtLlmMetricsPublisher:
    """The ``nv_trt_llm_*`` gauges (see the module docstring) through ``pb_utils.MetricFamily``."""

    REQUEST = "nv_trt_llm_request_metrics"
    RUNTIME_MEMORY = "nv_trt_llm_runtime_memory_metrics"
    KV_CACHE = "nv_trt_llm_kv_cache_block_metrics"
    INFLIGHT = "nv_trt_llm_inflight_batcher_metrics"
    GENERAL = "nv_trt_llm_general_metrics"
    _GROUPS = {
        REQUEST: ("request_type", ("active", "max", "scheduled", "context", "waiting"), "TRT LLM request metrics"),
        RUNTIME_MEMORY: ("memory_type", ("cpu", "gpu", "pinned"), "TRT LLM runtime memory metrics"),
        KV_CACHE: ("kv_cache_block_type", ("max", "free", "used", "tokens_per", "reused", "fraction"),
                   "TRT LLM KV cache block metrics"),
        INFLIGHT: ("inflight_batcher_specific_metric",
                   ("total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests"),
                   "TRT LLM inflight_batcher-specific metrics"),
        GENERAL: ("general_type", ("timestamp", "iteration_counter"), "General TRT LLM metrics"),
    }

    def __init__(self, pb_utils: Any, *, model: str = "tensorrt_llm", version: str = "1",
                 writer: MetricWriter | None = None):
        mf = pb_utils.MetricFamily
        self.writer = writer or MetricWriter()
        self.families = {}  # kept: a Metric whose family is garbage-collected stops working
        self.metrics: dict[tuple[str, str], Any] = {}
        for name, (key, values, description) in self._GROUPS.items():
            fam = self.families[name] = mf(name=name, description=description, kind=mf.GAUGE)
            for v in values:
                self.metrics[(name, v)] = fam.Metric(labels={"model": model, "version": str(version), key: v})

    @staticmethod
    def values(*, batcher_stats: dict, max_batch_size: int, kv: dict, tokens_per_block: int,
               iteration: dict, max_seq_len: int = 0) -> dict[tuple[str, str], float]:
        """Every gauge's value from the batcher's stats, the engine's KV pool and the latest iteration.

        The embedded engine's cache grows with its sequences and is freed when idle, so ``max`` is what
        it may grow to (``max_batch_size`` sequences of ``max_seq_len`` tokens, or what is allocated
        when larger), not what is allocated now: an idle engine reads all free, not exhausted."""
        row = blocks(kv.get("capacity", 0), tokens_per_block)
        allocated, used = kv.get("slots", 0) * row, kv.get("live", 0) * row
        total = max(allocated, max_batch_size * blocks(max_seq_len, tokens_per_block))
        R, M, K, I, G = (TrtLlmMetricsPublisher.REQUEST, TrtLlmMetricsPublisher.RUNTIME_MEMORY,
                         TrtLlmMetricsPublisher.KV_CACHE, TrtLlmMetricsPublisher.INFLIGHT,
                         TrtLlmMetricsPublisher.GENERAL)
        cache_bytes, on_gpu = kv.get("bytes", 0), str(kv.get("device", "cpu")).startswith("cuda")
        return {
            (M, "cpu"): 0 if on_gpu else cache_bytes, (M, "gpu"): cache_bytes if on_gpu else 0, (M, "pinned"): 0,
            (R, "active"): batcher_stats.get("active", 0), (R, "max"): max_batch_size,
            (R, "scheduled"): iteration.get("scheduled_requests", 0),
            (R, "context"): iteration.get("context_requests", 0), (R, "waiting"): batcher_stats.get("waiting", 0),
            (K, "max"): total, (K, "free"): total - used, (K, "used"): used, (K, "tokens_per"): tokens_per_block,
            (K, "reused"): 0, (K, "fraction"): used / total if total else 0.0,
            (I, "total_context_tokens"): iteration.get("context_tokens", 0),
            (I, "generation_requests"): iteration.get("generation_requests", 0),
            (I, "micro_batch_id"): 0, (I, "paused_requests"): 0,
            (G, "timestamp"): iteration.get("timestamp_us", 0), (G, "iteration_counter"): iteration.get("iteration", 0),
        }

    def update(self, values: dict[tuple[str, str], float]) -> None:
        for k, v in values.items():
            self.writer.set(self.metrics[k], v)


class TokenLengthHistograms:
    """TensorRT-LLM's backend histograms of each finished request's prompt and output lengths in
    tokens: ``nv_llm_input_token_len{response_metric_type="total_input_tokens"}`` and
    ``nv_llm_output_token_len{response_metric_type="total_output_tokens"}`` (labels ``model`` and
    ``version`` on each), with its buckets. A Python backend without histogram metrics (before Triton
    24.08) has none: ``available`` is False and ``observe`` does nothing."""

    INPUT, OUTPUT = "nv_llm_input_token_len", "nv_llm_output_token_len"
    BUCKETS = (10.0, 50.0, 100.0, 500.0, 1000.0)

    def __init__(self, pb_utils: Any, *, model: str = "tensorrt_llm", version: str = "1"):
        mf = pb_utils.MetricFamily
        self.available = hasattr(mf, "HISTOGRAM")
        self.families: dict[str, Any] = {}
        self.metrics: dict[str, Any] = {}
        if not self.available:
            return
        for name, label in ((self.INPUT, "total_input_tokens"), (self.OUTPUT, "total_output_tokens")):
            fam = self.families[name] = mf(name=name, description="TRT LLM response metrics", kind=mf.HISTOGRAM)
            self.metrics[name] = fam.Metric(labels={"model": model, "version": str(version),
                                                    "response_metric_type": label}, buckets=list(self.BUCKETS))

    def observe(self, input_tokens: int, output_tokens: int) -> None:
        if self.available:
            self.metrics[self.INPUT].observe(float(input_tokens))
            self.metrics[self.OUTPUT].observe(float(output_tokens))


class RoutingMetricsPublisher:
    """Publishes engine routing stats and batcher stats through ``pb_utils.MetricFamily``.

    Families are kept as attributes: the Python backend invalidates every Metric whose family object
    has been garbage-collected. Call :meth:`update` from one thread; the caller paces the calls
    (the served model waits at least ``min_interval_s`` between them, see ``next_update_wait``).
    """

    def __init__(self, pb_utils: Any, *, num_layers: int, num_experts: int, model: str = "tensorrt_llm",
                 min_interval_s: float = 0.5, writer: MetricWriter | None = None):
        mf = pb_utils.MetricFamily
        self.writer = writer or MetricWriter()
        self.min_interval_s = min_interval_s
        labels = {"model": model}
        self.f_routed = mf(name=ROUTED, description="Tokens routed to each expert (top-k assignments)", kind=mf.COUNTER)
        self.f_entropy = mf(name=ENTROPY, description="Mean router entropy per token since the last update, nats",
                            kind=mf.GAUGE)
        self.f_imbalance = mf(name=IMBALANCE, description="Busiest expert's tokens / mean tokens per expert",
                              kind=mf.GAUGE)
        self.f_dead = mf(name=DEAD, description="Experts that have received no token", kind=mf.GAUGE)
        self.f_params = mf(name=ACTIVE_PARAMS, description="Parameters used per generated token", kind=mf.GAUGE)
        self.f_requests = mf(name=BATCHER_REQUESTS, description="In-flight batcher requests by state", kind=mf.GAUGE)
        self.f_iters = mf(name=BATCHER_ITERATIONS, description="Decode steps run by the in-flight batcher",
                          kind=mf.COUNTER)
        self.f_generated = mf(name=GENERATED, description="Tokens generated", kind=mf.COUNTER)
        self.routed = [[self.f_routed.Metric(labels={**labels, "layer": str(l), "expert": str(e)})
                        for e in range(num_experts)] for l in range(num_layers)]
        self.entropy = [self.f_entropy.Metric(labels={**labels, "layer": str(l)}) for l in range(num_layers)]
        self.imbalance = [self.f_imbalance.Metric(labels={**labels, "layer": str(l)}) for l in range(num_layers)]
        self.dead = [self.f_dead.Metric(labels={**labels, "layer": str(l)}) for l in range(num_layers)]
        self.params = self.f_params.Metric(labels=labels)
        self.active = self.f_requests.Metric(labels={**labels, "state": "active"})
        self.waiting = self.f_requests.Metric(labels={**labels, "state": "waiting"})
        self.iters = self.f_iters.Metric(labels=labels)
        self.generated = self.f_generated.Metric(labels=labels)
        self._last_counts = [[0] * num_experts for _ in range(num_layers)]
        self._last_entropy = [0.0] * num_layers
        self._last_tokens = 0
        self._last_iters = 0
        self._last_generated = 0
        for l in range(num_layers):
            self.writer.set(self.dead[l], num_experts)
        self._init_decode(mf, labels, num_layers)

    def _init_decode(self, mf: Any, labels: dict, num_layers: int) -> None:
        """The decode-traffic families (what a decode step reads; the engine's ``decode_traffic``)."""
        self.f_dec_steps = mf(name=DECODE_STEPS, description="Decode steps run by the engine", kind=mf.COUNTER)
        self.f_dec_distinct = mf(name=DECODE_DISTINCT, description="Distinct experts read per decode step, "
                                 "summed over decode steps", kind=mf.COUNTER)
        self.f_dec_mean = mf(name=DECODE_DISTINCT_MEAN, description="Mean distinct experts read per decode step "
                             "since the last update", kind=mf.GAUGE)
        self.f_dec_bytes = mf(name=DECODE_BYTES, description="Bytes read by decode steps (experts touched, other "
                              "weights, KV cache)", kind=mf.COUNTER)
        self.dec_steps = self.f_dec_steps.Metric(labels=labels)
        self.dec_distinct = [self.f_dec_distinct.Metric(labels={**labels, "layer": str(l)}) for l in range(num_layers)]
        self.dec_mean = [self.f_dec_mean.Metric(labels={**labels, "layer": str(l)}) for l in range(num_layers)]
        self.dec_bytes = {k: self.f_dec_bytes.Metric(labels={**labels, "kind": k}) for k in DECODE_BYTE_KINDS}
        self._last_dec = {"steps": 0, "distinct": [0] * num_layers, **{k: 0 for k in DECODE_BYTE_KINDS}}

    def _update_decode(self, d: dict) -> None:
        """Publish the decode traffic's deltas since the last call."""
        w, last = self.writer, self._last_dec
        steps = int(d.get("steps", 0))
        new_steps = steps - last["steps"]
        if new_steps <= 0:
            return
        w.increment(self.dec_steps, new_steps)
        distinct = [int(x) for x in (d["distinct_sum"].tolist() if hasattr(d["distinct_sum"], "tolist")
                                     else d["distinct_sum"])]
        for l, v in enumerate(distinct[: len(self.dec_distinct)]):
            dv = v - last["distinct"][l]
            if dv > 0:
                w.increment(self.dec_distinct[l], dv)
            w.set(self.dec_mean[l], dv / new_steps)
            last["distinct"][l] = v
        for kind, key in DECODE_BYTE_KINDS.items():
            v = int(d.get(key, 0))
            if v > last[kind]:
                w.increment(self.dec_bytes[kind], v - last[kind])
                last[kind] = v
        last["steps"] = steps

    def set_active_params(self, n: int) -> None:
        self.writer.set(self.params, n)

    def update(self, routing: dict | None, batcher_stats: dict | None = None) -> None:
        """Publish the deltas since the last call."""
        w = self.writer
        if batcher_stats:
            w.set(self.active, batcher_stats.get("active", 0))
            w.set(self.waiting, batcher_stats.get("waiting", 0))
            it, gen = int(batcher_stats.get("iterations", 0)), int(batcher_stats.get("generated_tokens", 0))
            if it > self._last_iters:
                w.increment(self.iters, it - self._last_iters)
                self._last_iters = it
            if gen > self._last_generated:
                w.increment(self.generated, gen - self._last_generated)
                self._last_generated = gen
        if routing:
            counts = _rows(routing["counts"])
            entropy_sum = [float(x) for x in (routing["entropy_sum"].tolist() if hasattr(routing["entropy_sum"], "tolist")
                                              else routing["entropy_sum"])]
            tokens = int(routing.get("tokens", 0))
            for l, row in enumerate(counts[: len(self.routed)]):
                for e, c in enumerate(row[: len(self.routed[l])]):
                    d = int(c) - self._last_counts[l][e]
                    if d > 0:
                        w.increment(self.routed[l][e], d)
                        self._last_counts[l][e] = int(c)
            new_tokens = tokens - self._last_tokens
            for l, s in enumerate(entropy_sum[: len(self.entropy)]):
                if new_tokens > 0:
                    w.set(self.entropy[l], (s - self._last_entropy[l]) / new_tokens)
                self._last_entropy[l] = s
            self._last_tokens = tokens
            for lr in summarize_routing(counts)[: len(self.imbalance)]:
                w.set(self.imbalance[lr.layer], lr.imbalance)
                w.set(self.dead[lr.layer], lr.dead_experts)
            if routing.get("decode"):
                self._update_decode(routing["decode"])


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Parse Prometheus text exposition into {metric name: [(labels, value), ...]}."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            v = math.nan
        out.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), v))
    return out


def routed_token_table(samples: dict[str, list[tuple[dict[str, str], float]]], model: str | None = None
                       ) -> dict[tuple[int, int], float]:
    """{(layer, expert): routed tokens} from parsed metrics."""
    table = {}
    for labels, v in samples.get(ROUTED, []):
        if model is not None and labels.get("model") != model:
            continue
        table[(int(labels["layer"]), int(labels["expert"]))] = v
    return table


def scrape(url: str, timeout: float = 5.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Fetch and parse a ``/metrics`` endpoint (``http://host:port/metrics``)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - local endpoint
        return parse_prometheus(r.read().decode("utf-8", "replace"))


def engine_activity(url: str) -> tuple[float, float]:
    """(tokens the embedded engine has generated, requests holding a batch slot) from its metrics."""
    m = scrape(url)
    active = sum(v for labels, v in m.get("trtmoe_batcher_requests", []) if dict(labels).get("state") == "active")
    return sum(v for _, v in m.get("trtmoe_generated_tokens_total", [])), active


def tokens_when_idle(url: str, timeout: float = 30.0) -> float:
    """Wait until no request holds a batch slot, then the tokens generated so far (the metrics refresh
    every 0.5 s, so the count is read one refresh later: the last step's tokens included)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.6)
        if engine_activity(url)[1] == 0:
            time.sleep(0.6)
            return engine_activity(url)[0]
    raise TimeoutError(f"a request still holds its batch slot after {timeout} s")


def format_routing_table(rows: Iterable[LayerRouting]) -> str:
    """A plain-text table: layer, per-expert counts, imbalance, dead experts."""
    lines = ["layer  imbalance  dead  counts"]
    for r in rows:
        lines.append(f"{r.layer:>5}  {r.imbalance:>9.2f}  {r.dead_experts:>4}  {' '.join(str(c) for c in r.counts)}")
    return "\n".join(lines)
