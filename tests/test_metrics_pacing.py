"""How the embedded model publishes its Prometheus metrics: every call on a Python-backend metric is
a round trip to tritonserver made with the GIL held, so the publishers skip unchanged gauges, write
in bursts with a GIL-releasing pause between them, and space their updates by how long the last one
took. The served metrics themselves are checked against a real tritonserver in
tests/test_triton_contract.py and tests/test_triton_server.py; here the publishers write to a
recording stand-in for ``pb_utils.MetricFamily`` (Triton's API, which only exists inside a stub)."""

from __future__ import annotations

import math

import pytest

from trtmoe.triton.metrics import (MAX_UPDATE_WAIT_S, ROUTED, MetricWriter, RoutingMetricsPublisher,
                                   TokenLengthHistograms, TrtLlmMetricsPublisher, next_update_wait)


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

    def observe(self, v):
        self.value += v  # the histogram's sum
        self.log.calls.append((self.family, "observe", self.labels, v))


class _FakePbUtils:
    """The part of ``triton_python_backend_utils`` the publishers use."""

    def __init__(self):
        self.log = _Log()
        self.metrics: list[_Metric] = []
        log, metrics = self.log, self.metrics

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name, description, kind):
                self.name, self.kind = name, kind

            def Metric(self, labels, buckets=None):  # noqa: N802 - Triton's spelling
                assert (buckets is not None) == (self.kind == "histogram")
                m = _Metric(log, self.name, labels)
                m.buckets = buckets
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


def test_the_wait_is_bounded_after_a_stalled_update():
    """A host stall that made one update take a minute does not leave the series 20 minutes old."""
    assert next_update_wait(0.5, 60.0) == MAX_UPDATE_WAIT_S
    assert next_update_wait(0.5, 60.0, max_wait_s=2.0) == 2.0
    assert next_update_wait(10.0, 60.0) == 10.0  # a longer interval asked for is kept


class _Engine:
    """What ServedMetrics reads of the engine; its routing statistics take ``routing_s`` to read."""

    num_layers, num_experts, active_params_per_token, max_seq_len = 2, 4, 1000, 256

    def __init__(self, routing_s):
        self.routing_s, self.routing_reads = routing_s, 0

    def routing_stats(self):
        import time

        time.sleep(self.routing_s)
        self.routing_reads += 1
        return _routing([[1, 2, 3, 4], [4, 3, 2, 1]], [0.5, 0.5], 10)

    def kv_cache_stats(self):
        return {"slots": 0, "live": 0, "capacity": 0, "bytes": 0, "device": "cpu"}


class _Batcher:
    max_batch_size = 4

    def __init__(self):
        self.generated, self.finished = 0, []

    def stats(self):
        return {"active": 0, "waiting": 0, "iterations": self.generated, "generated_tokens": self.generated}

    def take_finished_lengths(self):
        out, self.finished = self.finished, []
        return out


def test_a_finished_request_moves_the_token_counter_while_the_expert_series_are_slow():
    """The expert series take 0.4 s to write (their next write is then 5 s away, the bound), yet the
    generated-token counter and the length histograms follow a finished request within an interval."""
    import time

    from trtmoe.triton.served import ServedMetrics

    class Logger:
        @staticmethod
        def log_warn(msg):
            raise AssertionError(msg)

    pb = _FakePbUtils()
    pb.Logger = Logger
    eng, bat = _Engine(0.4), _Batcher()
    sm = ServedMetrics(pb, eng, {"parameters": {"metrics_interval_s": {"string_value": "0.05"}}}, "tensorrt_llm",
                       "1", 32)
    gen = next(m for m in pb.metrics if m.family == "trtmoe_generated_tokens_total")
    hist = {m.family: m for m in pb.metrics if m.family.startswith("nv_llm_")}
    assert {m.buckets == [10.0, 50.0, 100.0, 500.0, 1000.0] for m in hist.values()} == {True}
    sm.start(bat)
    try:
        time.sleep(0.8)  # the first expert write is done
        assert eng.routing_reads == 1
        bat.generated, bat.finished = 7, [(12, 7)]
        deadline = time.monotonic() + 1.0
        while gen.value != 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gen.value == 7
        time.sleep(0.1)
        assert hist["nv_llm_input_token_len"].value == 12 and hist["nv_llm_output_token_len"].value == 7
        assert eng.routing_reads == 1  # the expert series wait their paced turn
    finally:
        sm.stop()
        sm.thread.join(5)


def test_idle_kv_cache_reads_free_not_exhausted_and_memory_is_exported():
    K, M = TrtLlmMetricsPublisher.KV_CACHE, TrtLlmMetricsPublisher.RUNTIME_MEMORY
    idle = TrtLlmMetricsPublisher.values(batcher_stats={}, max_batch_size=4, tokens_per_block=32, iteration={},
                                         kv={"slots": 0, "live": 0, "capacity": 0, "bytes": 0, "device": "cpu"},
                                         max_seq_len=100)
    assert (idle[(K, "max")], idle[(K, "free")], idle[(K, "used")], idle[(K, "fraction")]) == (16, 16, 0, 0.0)
    busy = TrtLlmMetricsPublisher.values(batcher_stats={}, max_batch_size=4, tokens_per_block=32, iteration={},
                                         kv={"slots": 4, "live": 2, "capacity": 64, "bytes": 4096,
                                             "device": "cuda:0"}, max_seq_len=100)
    assert (busy[(K, "max")], busy[(K, "used")], busy[(K, "free")]) == (16, 4, 12)
    assert (busy[(M, "gpu")], busy[(M, "cpu")], busy[(M, "pinned")]) == (4096, 0, 0)
    pb = _FakePbUtils()
    TrtLlmMetricsPublisher(pb)
    assert {m.labels["memory_type"] for m in pb.metrics if m.family == M} == {"cpu", "gpu", "pinned"}


def test_token_length_histograms_are_upstreams_and_absent_without_histogram_support():
    pb = _FakePbUtils()
    h = TokenLengthHistograms(pb, model="m", version="2")
    h.observe(30, 5)
    got = {(c[0], c[2]["response_metric_type"], c[2]["model"], c[2]["version"]): c[3] for c in pb.log.calls}
    assert got == {("nv_llm_input_token_len", "total_input_tokens", "m", "2"): 30.0,
                   ("nv_llm_output_token_len", "total_output_tokens", "m", "2"): 5.0}
    old = _FakePbUtils()
    del old.MetricFamily.HISTOGRAM
    h = TokenLengthHistograms(old)
    h.observe(1, 1)
    assert not h.available and old.log.calls == []


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
