"""How the embedded model publishes its Prometheus metrics: every call on a Python-backend metric is
a round trip to tritonserver made with the GIL held, so the publishers skip unchanged gauges, write
in bursts with a GIL-releasing pause between them, and space their updates by how long the last one
took. The served metrics themselves are checked against a real tritonserver in
tests/test_triton_contract.py and tests/test_triton_server.py; here the publishers write to a
recording stand-in for ``pb_utils.MetricFamily`` (Triton's API, which only exists inside a stub)."""

from __future__ import annotations

import math

import pytest

from trtmoe.triton.metrics import (ROUTED, MetricWriter, RoutingMetricsPublisher, TrtLlmMetricsPublisher,
                                   next_update_wait)


class _Log:
    def __init__(self):
        self.calls: list[tuple[str, str, dict, float]] = []  # (family, op, labels, value)


class _Metric:
    def __init__(self, log, family, labels):
        self.log, self.family, self.labels, self.value = log, family, labels, 0.0

    def set(self, v):
        self.value = v
        self.log.calls.append((self.family, "set", self.labels, v))

    def increment(self, v):
        self.value += v
        self.log.calls.append((self.family, "increment", self.labels, v))


class _FakePbUtils:
    """The part of ``triton_python_backend_utils`` the publishers use."""

    def __init__(self):
        self.log = _Log()
        self.metrics: list[_Metric] = []
        log, metrics = self.log, self.metrics

        class MetricFamily:
            COUNTER, GAUGE = "counter", "gauge"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels):  # noqa: N802 - Triton's spelling
                m = _Metric(log, self.name, labels)
                metrics.append(m)
                return m

        self.MetricFamily = MetricFamily


def _routing(counts, entropy, tokens):
    return {"counts": counts, "entropy_sum": entropy, "tokens": tokens}


def test_writer_skips_unchanged_gauges_and_pauses_after_each_burst():
    sleeps = []
    w = MetricWriter(burst=3, pause_s=0.002, sleep=sleeps.append)
    log = _Log()
    a, b = _Metric(log, "f", {"k": "a"}), _Metric(log, "f", {"k": "b"})
    w.set(a, 1)
    w.set(a, 1.0)  # the same value: no call
    w.set(b, 1)  # another metric with that value: a call
    w.set(a, 2)
    assert [(c[2]["k"], c[3]) for c in log.calls] == [("a", 1.0), ("b", 1.0), ("a", 2.0)]
    assert sleeps == [0.002]  # after the third call
    w.set(a, math.nan)
    w.set(a, math.nan)  # NaN equals the NaN set before
    w.increment(b, 1)
    w.increment(b, 1)  # increments are never skipped
    assert w.calls == 6 and sleeps == [0.002, 0.002]
    assert b.value == 3.0


def test_next_update_waits_longer_after_a_slow_update():
    assert next_update_wait(0.5, 0.002) == 0.5
    assert next_update_wait(0.5, 0.2) == pytest.approx(4.0)  # 0.2 s took: at most 1/20 of the time
    assert next_update_wait(0.5, 0.2, duty=10) == pytest.approx(2.0)
    assert next_update_wait(0.5, -1.0) == 0.5


def test_routing_publisher_writes_only_what_changed_in_paced_bursts():
    pb = _FakePbUtils()
    sleeps = []
    layers, experts = 6, 64  # 384 expert counters
    pub = RoutingMetricsPublisher(pb, num_layers=layers, num_experts=experts, min_interval_s=0.0,
                                  writer=MetricWriter(burst=32, pause_s=0.001, sleep=sleeps.append))
    pb.log.calls.clear()
    sleeps.clear()
    before = pub.writer.calls  # the initial dead-expert gauges
    counts = [[(l * 7 + e) % 5 for e in range(experts)] for l in range(layers)]
    stats = {"active": 2, "waiting": 0, "iterations": 10, "generated_tokens": 20}
    pub.update(_routing(counts, [1.0] * layers, 40), stats)
    routed = [c for c in pb.log.calls if c[0] == ROUTED]
    busy = sum(1 for row in counts for c in row if c)
    assert len(routed) == busy and all(c[1] == "increment" for c in routed)
    first = len(pb.log.calls)
    assert len(sleeps) == (before + first) // 32 - before // 32 > 0  # a pause after every 32 calls

    # The same state again: counters have no delta and no gauge changed, so nothing is written.
    pb.log.calls.clear()
    pub.update(_routing(counts, [1.0] * layers, 40), stats)
    assert pb.log.calls == []

    # One expert of one layer gets 3 more tokens: its counter, and only the gauges that moved.
    counts2 = [row[:] for row in counts]
    counts2[2][5] += 3
    pub.update(_routing(counts2, [1.0] * layers, 40), dict(stats, iterations=11))
    ops = {(c[0], c[1], tuple(sorted(c[2].items()))) for c in pb.log.calls}
    assert (ROUTED, "increment", (("expert", "5"), ("layer", "2"), ("model", "tensorrt_llm"))) in ops
    assert sum(1 for c in pb.log.calls if c[0] == ROUTED) == 1
    assert len(pb.log.calls) < 6  # the counter, iterations, and layer 2's imbalance at most

    # The values Prometheus ends up with equal the totals, however the writes were spread.
    by = {(m.family, tuple(sorted(m.labels.items()))): m.value for m in pb.metrics}
    for l in range(layers):
        for e in range(experts):
            key = (ROUTED, (("expert", str(e)), ("layer", str(l)), ("model", "tensorrt_llm")))
            assert by[key] == counts2[l][e]


def test_trtllm_gauges_are_set_once_until_they_change():
    pb = _FakePbUtils()
    pub = TrtLlmMetricsPublisher(pb, writer=MetricWriter(sleep=lambda s: None))
    kv = {"capacity": 64, "slots": 4, "live": 1}
    it = {"scheduled_requests": 1, "context_requests": 0, "context_tokens": 0, "generation_requests": 1,
          "timestamp_us": 5, "iteration": 1}
    vals = TrtLlmMetricsPublisher.values(batcher_stats={"active": 1, "waiting": 0}, max_batch_size=4, kv=kv,
                                         tokens_per_block=32, iteration=it)
    pub.update(vals)
    assert len(pb.log.calls) == len(vals)
    pb.log.calls.clear()
    pub.update(vals)
    assert pb.log.calls == []
    pub.update(TrtLlmMetricsPublisher.values(batcher_stats={"active": 1, "waiting": 0}, max_batch_size=4, kv=kv,
                                             tokens_per_block=32, iteration=dict(it, timestamp_us=9, iteration=2)))
    assert {c[2]["general_type"] for c in pb.log.calls} == {"timestamp", "iteration_counter"}
