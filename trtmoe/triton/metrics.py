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
| ``trtmoe_batcher_requests`` | gauge | model, state=active/waiting | in-flight batcher occupancy |
| ``trtmoe_batcher_iterations_total`` | counter | model | decode steps run |
| ``trtmoe_generated_tokens_total`` | counter | model | tokens generated |
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


class RoutingMetricsPublisher:
    """Publishes engine routing stats and batcher stats through ``pb_utils.MetricFamily``.

    Families are kept as attributes: the Python backend invalidates every Metric whose family object
    has been garbage-collected. Call :meth:`update` from one thread (the batcher's).
    """

    def __init__(self, pb_utils: Any, *, num_layers: int, num_experts: int, model: str = "tensorrt_llm",
                 min_interval_s: float = 0.5):
        mf = pb_utils.MetricFamily
        self.min_interval_s = min_interval_s
        self._next = 0.0
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
            self.dead[l].set(num_experts)

    def set_active_params(self, n: int) -> None:
        self.params.set(float(n))

    def update(self, routing: dict | None, batcher_stats: dict | None = None, *, force: bool = False) -> bool:
        """Publish the deltas since the last call; rate-limited to ``min_interval_s`` unless forced."""
        now = time.monotonic()
        if not force and now < self._next:
            return False
        self._next = now + self.min_interval_s
        if batcher_stats:
            self.active.set(float(batcher_stats.get("active", 0)))
            self.waiting.set(float(batcher_stats.get("waiting", 0)))
            it, gen = int(batcher_stats.get("iterations", 0)), int(batcher_stats.get("generated_tokens", 0))
            if it > self._last_iters:
                self.iters.increment(float(it - self._last_iters))
                self._last_iters = it
            if gen > self._last_generated:
                self.generated.increment(float(gen - self._last_generated))
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
                        self.routed[l][e].increment(float(d))
                        self._last_counts[l][e] = int(c)
            new_tokens = tokens - self._last_tokens
            for l, s in enumerate(entropy_sum[: len(self.entropy)]):
                if new_tokens > 0:
                    self.entropy[l].set((s - self._last_entropy[l]) / new_tokens)
                self._last_entropy[l] = s
            self._last_tokens = tokens
            for lr in summarize_routing(counts)[: len(self.imbalance)]:
                self.imbalance[lr.layer].set(lr.imbalance)
                self.dead[lr.layer].set(float(lr.dead_experts))
        return True


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


def format_routing_table(rows: Iterable[LayerRouting]) -> str:
    """A plain-text table: layer, per-expert counts, imbalance, dead experts."""
    lines = ["layer  imbalance  dead  counts"]
    for r in rows:
        lines.append(f"{r.layer:>5}  {r.imbalance:>9.2f}  {r.dead_experts:>4}  {' '.join(str(c) for c in r.counts)}")
    return "\n".join(lines)
