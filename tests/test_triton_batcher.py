"""In-flight batcher over the real embedded engine: batched answers equal one-at-a-time generation,
requests join a running batch, and failures stay with their request."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
from conftest import request_getter, wait_until
import pytest
import torch

from trtmoe.checkpoint.writer import convert
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams
from trtmoe.triton.batcher import (FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, BatcherClosed,
                                   BatcherSettings, InflightBatcher, QueueFull)
from trtmoe.triton.cancel_channel import CancelListener, CancelSender
from trtmoe.triton.llm_request import EngineLimits, RequestError, parse_requests, word_list


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model):
    torch.manual_seed(0)
    ckpt = tmp_path_factory.mktemp("batcher") / "ckpt"
    convert(tiny_model("mixtral"), ckpt)
    return EmbeddedEngine.from_checkpoint(ckpt, device="cpu")


PROMPTS = [[1, 5, 9, 33], [1, 7], [1, 100, 101, 102, 103, 104, 105], [2, 3, 4], [1, 44, 45], [1, 9, 9, 9, 9, 9],
           [1, 60, 61, 62, 63], [1, 200]]


class Collector:
    def __init__(self):
        self.events = []
        self.done = threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if ev.finished:
            self.done.set()

    @property
    def tokens(self):
        return [t for e in self.events for t in e.new_tokens]

    @property
    def final(self):
        return self.events[-1]


def _params(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


class CountingPrefills:
    """The real engine, recording how many requests each batched prefill held."""

    def __init__(self, engine):
        self.engine, self.sizes = engine, []

    def start(self, prompt, params):
        self.sizes.append(1)
        return self.engine.start(prompt, params)

    def start_many(self, prompts, params):
        self.sizes.append(len(prompts))
        return self.engine.start_many(prompts, params)

    def step(self, seqs):
        return self.engine.step(seqs)


def test_batched_equals_sequential_and_requests_join(engine):
    refs = [engine.generate(p, _params(6 + i)) for i, p in enumerate(PROMPTS)]
    seen_active = []
    counting = CountingPrefills(engine)
    b = InflightBatcher(counting, max_batch_size=3, on_iteration=lambda bt: seen_active.append(bt.num_active),
                        idle_callback_period_s=60)
    try:
        cols = []
        for i, p in enumerate(PROMPTS[:4]):
            cols.append(Collector())
            b.submit(p, _params(6 + i), cols[-1])
        time.sleep(0.05)  # later requests arrive while the first ones decode
        for i, p in enumerate(PROMPTS[4:], start=4):
            cols.append(Collector())
            b.submit(p, _params(6 + i), cols[-1])
        for c in cols:
            assert c.done.wait(60)
    finally:
        b.shutdown()
    for c, ref in zip(cols, refs):
        assert c.tokens == ref and c.final.finish_reason in ("length", "stop")
        assert c.final.request.first_token_ns >= c.final.request.first_scheduled_ns >= c.final.request.arrival_ns
    assert max(seen_active) == 3  # never more than max_batch_size, and batches really formed
    assert sum(counting.sizes) == len(PROMPTS) and max(counting.sizes) > 1  # prefills were batched
    assert b.stats()["completed_requests"] == len(PROMPTS)
    # The tokens arrived one per event (streaming), after the first event of each request.
    assert all(len(e.new_tokens) <= 1 for c in cols for e in c.events)


def test_failures_stay_with_their_request(engine):
    b = InflightBatcher(engine, max_batch_size=4)
    try:
        good, bad_prompt, raising = Collector(), Collector(), Collector()

        def broken(ev):
            raising.events.append(ev)
            if len(raising.events) == 2:
                raise RuntimeError("client went away")

        b.submit([1, 5, 9], _params(8), good)
        b.submit([1, 10_000], _params(8), bad_prompt)  # outside the vocabulary: prefill fails
        b.submit([1, 6, 7], _params(8), broken)
        assert good.done.wait(30) and bad_prompt.done.wait(30)
        deadline = time.time() + 10
        while not (raising.events and raising.events[-1].request.finished) and time.time() < deadline:
            time.sleep(0.01)
    finally:
        b.shutdown()
    assert good.tokens == engine.generate([1, 5, 9], _params(8))
    assert bad_prompt.final.finish_reason == FINISH_ERROR and "vocabulary" in str(bad_prompt.final.error)
    assert raising.events[-1].request.finish_reason == FINISH_CANCELLED and len(raising.events) == 2
    assert b.stats()["failed_requests"] == 1


class PoisonedStep:
    """The real engine, except that a step containing a poisoned sequence raises (fault injection)."""

    def __init__(self, engine, poison_first_token):
        self.engine, self.poison = engine, poison_first_token

    def start(self, prompt, params):
        return self.engine.start(prompt, params)

    def step(self, seqs):
        if any(s.prompt[1] == self.poison for s in seqs):
            raise RuntimeError("kernel failure")
        return self.engine.step(seqs)


def test_step_failure_is_isolated(engine):
    b = InflightBatcher(PoisonedStep(engine, poison_first_token=66), max_batch_size=4)
    try:
        ok, poisoned = Collector(), Collector()
        b.submit([1, 5, 9], _params(8), ok)
        b.submit([1, 66, 67], _params(8), poisoned)
        assert ok.done.wait(30) and poisoned.done.wait(30)
    finally:
        b.shutdown()
    assert ok.tokens == engine.generate([1, 5, 9], _params(8))
    assert poisoned.final.finish_reason == FINISH_ERROR and "kernel failure" in str(poisoned.final.error)
    assert len(poisoned.tokens) == 1  # the prefill token was delivered before the failing step


def test_stop_sequence_cancel_and_shutdown(engine):
    ref = engine.generate([1, 5, 9], _params(10))
    stop = ref[2:4]
    b = InflightBatcher(engine, max_batch_size=2, prefill_budget_s=0.0)
    try:
        c = Collector()
        b.submit([1, 5, 9], _params(10), c, stop_sequences=[stop])
        assert c.done.wait(30)
        end = next(i for i in range(1, len(ref) + 1) if ref[:i][-len(stop):] == stop)  # first completion of `stop`
        assert c.tokens == ref[:end] and end < len(ref)
        assert c.final.finish_reason == FINISH_STOP
        slow = Collector()
        b.submit([1, 5, 9], _params(200), slow, request_id="r-1")
        while not slow.events:
            time.sleep(0.005)
        assert b.cancel("r-1")
        assert slow.done.wait(10) and slow.final.finish_reason == FINISH_CANCELLED and len(slow.tokens) < 200
        # Queued behind a full batch and then shut down: told so, not left hanging.
        blockers = [Collector() for _ in range(2)]
        for bc in blockers:
            b.submit([1, 5, 9], _params(200), bc)
        waiting = Collector()
        b.submit([1, 5], _params(5), waiting)
    finally:
        b.shutdown()
    assert waiting.done.wait(5) and waiting.final.finish_reason == FINISH_ERROR
    assert isinstance(waiting.final.error, BatcherClosed)
    with pytest.raises(BatcherClosed):
        b.submit([1], _params(1), Collector())


def test_cancel_poll_period_per_request(engine):
    """A request submitted with cancel_poll_s is asked is_cancelled at most that often (its cancels
    come by id); one without it about once per decode step (here: per minimum check period, as the
    batcher thread is held in a callback); both are still cancelled by the poll."""
    b = InflightBatcher(engine, max_batch_size=4, min_cancel_check_period_s=0.002)
    polls = {"slow": 0, "step": 0}
    flags = {"slow": False, "step": False}

    def poller(name):
        def is_cancelled():
            polls[name] += 1
            return flags[name]
        return is_cancelled

    slow, step = Gated(2), Collector()
    try:
        t0 = time.monotonic()
        b.submit([1, 7], _params(40), step, is_cancelled=poller("step"))
        b.submit([1, 5, 9], _params(40), slow, is_cancelled=poller("slow"), cancel_poll_s=0.4)
        assert slow.reached[2].wait(30)
        # Until the per-step one has been asked many times more often than the slow one (never, if
        # cancel_poll_s were ignored) ...
        wait_until(lambda: polls["slow"] >= 1 and polls["step"] > 5 * polls["slow"] + 20, 30,
                   "the per-step request polled more than 5x as often as the cancel_poll_s=0.4 one")
        seen, elapsed = dict(polls), time.monotonic() - t0
        flags["slow"] = flags["step"] = True
        # ... and the slow one is asked again (it is due within 0.4 s), now cancelled
        wait_until(lambda: polls["slow"] > seen["slow"], 10, "the slow request polled again")
        slow.release[2].set()
        assert step.done.wait(10) and step.final.finish_reason == FINISH_CANCELLED
        assert slow.done.wait(10) and slow.final.finish_reason == FINISH_CANCELLED
    finally:
        slow.release[2].set()
        b.shutdown()
    assert 1 <= seen["slow"] <= elapsed / 0.4 + 2, seen
    assert seen["step"] > 5 * seen["slow"], seen


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
def test_serving_threads_carry_os_names(engine):
    """The decode loop and the cancel watcher name their OS threads (what top -H and the peers
    benchmark's CPU split read); a callback on the decode thread sees its own name."""
    def comm(tid):
        return open(f"/proc/self/task/{tid}/comm").read().strip()

    b = InflightBatcher(engine, max_batch_size=2)
    seen = Gated(1)
    try:
        b.submit([1, 7], _params(4), seen, is_cancelled=lambda: False)
        assert seen.reached[1].wait(30)
        names = sorted(comm(t) for t in os.listdir("/proc/self/task"))
        decode = comm(b._thread.native_id)
        seen.release[1].set()
        assert seen.done.wait(30)
    finally:
        seen.release[1].set()
        b.shutdown()
    assert decode == "trtmoe-decode"
    assert "trtmoe-cancel" in names, names


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Gated(Collector):
    """Holds the batcher thread in its callback at the given event numbers until released, so a
    test decides what arrives while a request is still generating."""

    def __init__(self, *at):
        super().__init__()
        self.reached = {n: threading.Event() for n in at}
        self.release = {n: threading.Event() for n in at}

    def __call__(self, ev):
        super().__call__(ev)
        n = len(self.events)
        if n in self.reached:
            self.reached[n].set()
            assert self.release[n].wait(60)


def test_cancel_channel_frees_a_slot_while_the_queue_is_full(engine):
    """One slot, one place in the queue, both taken (a third request is refused): a key sent over
    the cancel channel still ends the running request before its next step, and the waiting one
    gets the slot. A key that arrives before its request cancels that request before any prefill,
    even with the queue full; a process that is not a sibling stub (here a child) is refused
    unread."""
    model = f"test-{uuid.uuid4().hex}"  # its own address: other test runs may share this parent
    b = InflightBatcher(engine, max_batch_size=1, max_waiting=1, prefill_budget_s=0.0)
    listener = CancelListener(model, lambda key: b.cancel(key, remember=True))
    sender = CancelSender(model)
    long = _params(240, min_tokens=240)
    running, blocker = Gated(2), Gated(2, 4)
    try:
        waiting = Collector()
        b.submit([1, 5, 9], long, running, request_id="run")
        assert running.reached[2].wait(30)  # 2 tokens out; the batcher thread waits in the callback
        b.submit([1, 5], _params(3), waiting, request_id="wait")
        # TensorRT-LLM's executor wording, which upstream's test_max_queue_size.py looks for.
        with pytest.raises(QueueFull, match="Maximum queue size of 1 has been reached"):
            b.submit([1, 7], _params(3), Collector())
        sender.send("run")
        _wait_for(lambda: listener.received == 1)
        running.release[2].set()
        assert running.done.wait(30) and running.final.finish_reason == FINISH_CANCELLED, running.final
        assert len(running.tokens) == 2
        assert waiting.done.wait(30) and waiting.final.finish_reason == FINISH_LENGTH and len(waiting.tokens) == 3

        filler, early = Collector(), Collector()
        b.submit([1, 5, 9], long, blocker, request_id="block")
        assert blocker.reached[2].wait(30)
        b.submit([1, 5], _params(3), filler, request_id="fill")
        sender.send("early")
        _wait_for(lambda: listener.received == 2)
        b.submit([1, 5], _params(3), early, request_id="early")  # the queue is full, yet no QueueFull
        child = (f"from trtmoe.triton.cancel_channel import CancelSender\n"
                 f"try:\n    CancelSender({model!r}, server_pid={os.getppid()}).send('block')\n"
                 f"except OSError:\n    pass  # the listener hung up on it\n")
        subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
        _wait_for(lambda: listener.refused >= 1)
        blocker.release[2].set()
        assert early.done.wait(30) and early.final.finish_reason == FINISH_CANCELLED and early.tokens == []
        assert blocker.reached[4].wait(30) and not blocker.done.is_set()  # the child's key was not taken
        sender.send("block")
        _wait_for(lambda: listener.received == 3)
        blocker.release[4].set()
        assert blocker.done.wait(30) and blocker.final.finish_reason == FINISH_CANCELLED and len(blocker.tokens) == 4
        assert filler.done.wait(30) and filler.final.finish_reason == FINISH_LENGTH
    finally:
        for g in (running, blocker):
            for e in g.release.values():
                e.set()
        sender.close()
        listener.close()
        b.shutdown()


def test_stream_interval_groups_tokens(engine):
    """With stream_interval 4 the first token comes alone, then tokens in fours, and the final event
    carries the remainder; the tokens are exactly the greedy answer. A cancelled request still gets
    the tokens generated since its last event."""
    refs = [engine.generate(p, _params(11)) for p in PROMPTS[:3]]
    cols = [Collector() for _ in refs]
    flushed = []  # events delivered so far, at each on_flush
    b = InflightBatcher(engine, max_batch_size=3, stream_interval=4,
                        on_flush=lambda: flushed.append(sum(len(c.events) for c in cols)))
    try:
        for p, c in zip(PROMPTS, cols):
            b.submit(p, _params(11), c)
        for c in cols:
            assert c.done.wait(60)
        # Every burst of events is followed by a flush: the last flush saw every event.
        wait_until(lambda: flushed and flushed[-1] == 3 * 4, 10, "a flush after the last event")
        assert flushed and flushed[-1] == sum(len(c.events) for c in cols) == 3 * 4
        assert len(set(flushed)) >= 4  # one per burst (first tokens, then every fourth step)
        slow = Collector()
        b.submit([1, 5, 9], _params(200), slow, request_id="r-slow")
        while len(slow.tokens) < 6:
            time.sleep(0.002)
        assert b.cancel("r-slow") and slow.done.wait(10)
    finally:
        b.shutdown()
    for c, ref in zip(cols, refs):
        assert c.tokens == ref
        sizes = [len(e.new_tokens) for e in c.events]
        assert sizes == [1, 4, 4, 2] and c.events[-1].finished
    assert slow.final.finish_reason == FINISH_CANCELLED
    n = len(slow.final.request.tokens)
    assert slow.tokens == slow.final.request.tokens and n > 6
    assert slow.tokens == engine.generate([1, 5, 9], _params(n))
    with pytest.raises(ValueError, match="stream_interval"):
        InflightBatcher(engine, max_batch_size=1, stream_interval=-1)


def test_auto_stream_interval_follows_the_batch(engine):
    """stream_interval 0 (auto): with 4 sequences active and 2 responses per step allowed, tokens go
    out in pairs after the first; a request alone streams every token."""
    b = InflightBatcher(engine, max_batch_size=4, stream_interval=0, responses_per_step=2)
    try:
        cols = [Collector() for _ in range(4)]
        with b._cv:  # all four are waiting before the batcher looks, so they run as one batch
            for p, c in zip(PROMPTS, cols):
                b.submit(p, _params(9), c)
        for c in cols:
            assert c.done.wait(60)
        alone = Collector()
        b.submit(PROMPTS[0], _params(5), alone)
        assert alone.done.wait(60)
    finally:
        b.shutdown()
    for p, c in zip(PROMPTS, cols):
        assert c.tokens == engine.generate(p, _params(9))
        assert [len(e.new_tokens) for e in c.events] == [1, 2, 2, 2, 2]
    assert [len(e.new_tokens) for e in alone.events] == [1, 1, 1, 1, 1]


def test_settings_object_schedules_as_its_keywords_do(engine):
    """Options given as one BatcherSettings act as the same keywords: stream_interval 3 and a batch
    of two give the same token groups and tokens; settings are checked when built, giving both
    forms (or an unknown option) is a TypeError, and the shortest cancel poll period never exceeds
    the longest."""
    settings = BatcherSettings(max_batch_size=2, stream_interval=3, name="trtmoe-settings-test")
    runs = []
    for make in (lambda: InflightBatcher(engine, settings),
                 lambda: InflightBatcher(engine, max_batch_size=2, stream_interval=3, name="trtmoe-settings-test")):
        b = make()
        cols = [Collector() for _ in range(3)]
        try:
            assert b.max_batch_size == 2 and b._thread.name == "trtmoe-settings-test"
            for p, c in zip(PROMPTS, cols):
                b.submit(p, _params(8), c)
            for c in cols:
                assert c.done.wait(60)
        finally:
            b.shutdown()
        runs.append([[len(e.new_tokens) for e in c.events] for c in cols] + [c.tokens for c in cols])
        assert b.stats()["completed_requests"] == 3 and b.stats()["generated_tokens"] == 3 * 8
    assert runs[0] == runs[1]
    assert runs[0][0] == [1, 3, 3, 1] and runs[0][3] == engine.generate(PROMPTS[0], _params(8))
    with pytest.raises(TypeError, match="not both"):
        InflightBatcher(engine, settings, stream_interval=2)
    with pytest.raises(TypeError, match="BatcherSettings"):
        InflightBatcher(engine, 2)
    with pytest.raises(TypeError, match="stream_intervall"):
        InflightBatcher(engine, max_batch_size=2, stream_intervall=2)
    with pytest.raises(ValueError, match="max_batch_size"):
        BatcherSettings(max_batch_size=0)
    with pytest.raises(ValueError, match="responses_per_step"):
        BatcherSettings(max_batch_size=1, responses_per_step=0)
    assert BatcherSettings(max_batch_size=1, cancel_check_period_s=0.001).min_cancel_check_period_s == 0.001


# ---------------------------------------------------------------- request parsing
LIMITS = EngineLimits(max_input_len=8, max_seq_len=16, vocab_size=250, default_end_id=2)
_getter = request_getter


def test_parse_request_maps_sampling_inputs():
    (g,) = parse_requests(_getter(runtime_top_k=np.array([[5]], np.int32), temperature=np.array([[0.7]], np.float32),
                                  seed=np.array([[3]], np.uint64), streaming=np.array([[True]])),
                          LIMITS, SamplingParams)
    # Upstream's default: the prompt stays in the output unless the request or the repository says otherwise.
    assert g.prompt_ids == [1, 5, 9] and g.streaming and not g.exclude_input_in_output
    (h,) = parse_requests(_getter(), LIMITS, SamplingParams, default_exclude_input=True)
    assert h.exclude_input_in_output
    (h,) = parse_requests(_getter(exclude_input_in_output=np.array([[False]])), LIMITS, SamplingParams,
                          default_exclude_input=True)
    assert not h.exclude_input_in_output
    p = g.params
    assert (p.max_new_tokens, p.top_k, p.seed, p.end_id) == (4, 5, 3, 2) and abs(p.temperature - 0.7) < 1e-6
    # A bare temperature stays greedy, as in TensorRT-LLM.
    (g,) = parse_requests(_getter(temperature=np.array([[0.7]], np.float32)), LIMITS, SamplingParams)
    assert g.params.temperature == 0.0


@pytest.mark.parametrize("tensors, message", [
    (dict(request_output_len=np.array([[0]], np.int32)), "must be >= 1"),
    (dict(request_output_len=np.array([[14]], np.int32)), "max_seq_len 16"),
    (dict(input_ids=np.arange(1, 11, dtype=np.int32)[None], input_lengths=np.array([[10]], np.int32)), "max_input_len"),
    (dict(input_ids=np.array([[1, 999]], np.int32), input_lengths=np.array([[2]], np.int32)), "vocabulary"),
    (dict(beam_width=np.array([[2]], np.int32)), "Requested beam width 2 is larger than configured max beam width 1"),
    (dict(repetition_penalty=np.array([[-1.3]], np.float32)), "'repetition_penalty' must be > 0"),
    (dict(repetition_penalty=np.array([[0.0]], np.float32)), "'repetition_penalty' must be > 0"),
    (dict(presence_penalty=np.array([[np.inf]], np.float32)), "'presence_penalty' must be finite"),
    (dict(temperature=np.array([[np.nan]], np.float32)), "temperature must be a finite number"),
    (dict(temperature=np.array([[np.inf]], np.float32), runtime_top_k=np.array([[5]], np.int32)),
     "temperature must be a finite number"),
    (dict(lora_weights=np.ones((1, 2, 2), np.float16)), "lora_weights"),
    (dict(bad_words_list=np.array([[[7, 800], [2, -1]]], np.int32)), "'bad_words_list' has token id outside"),
    (dict(embedding_bias=np.ones((1, 7), np.float32)), "'embedding_bias' has 7 values"),
    (dict(len_penalty=np.array([[-1.3]], np.float32)), "'len_penalty' must be >= 0"),
    (dict(early_stopping=np.array([[-1]], np.int32)), "'early_stopping' must be >= 0"),
])
def test_parse_request_rejects_with_reason(tensors, message):
    with pytest.raises(RequestError, match=message):
        parse_requests(_getter(**tensors), LIMITS, SamplingParams)


def test_word_list_format():
    arr = np.array([[[7, 8, 9, 0], [2, 3, -1, -1]]], np.int32)
    assert word_list(arr, 0) == [[7, 8], [9]]
    assert word_list(np.array([[[0], [-1]]], np.int32), 0) == []


def test_a_batched_request_is_queued_whole_or_refused(engine):
    """submit_all queues every prompt of a batched request, or none of them: with one slot busy and
    one place in the queue, two prompts get QueueFull and neither runs; one prompt then fits."""
    b = InflightBatcher(engine, max_batch_size=1, max_waiting=1, prefill_budget_s=0.0)
    running = Gated(2)
    try:
        b.submit([1, 5, 9], _params(40, min_tokens=40), running, request_id="run")
        assert running.reached[2].wait(30)  # the slot is taken; the queue is empty
        pair = [Collector(), Collector()]
        with pytest.raises(QueueFull, match="this one brings 2"):
            b.submit_all([dict(prompt_ids=[1, 5], params=_params(3), callback=c, request_id="pair") for c in pair])
        one = Collector()
        b.submit_all([dict(prompt_ids=[1, 7], params=_params(3), callback=one, request_id="one")])
        running.release[2].set()
        assert running.done.wait(30) and one.done.wait(30) and one.final.finish_reason == FINISH_LENGTH
        assert not any(c.done.is_set() or c.tokens for c in pair)  # neither half of the pair ever ran
    finally:
        for e in running.release.values():
            e.set()
        b.shutdown()


def test_idle_engine_gives_its_freed_memory_back(engine, monkeypatch):
    """Once the loop has been idle ``trim_after_idle_s``, it calls the engine's ``trim_memory`` once
    per idle period, never while requests run."""
    calls, ticks = [], []
    real = engine.trim_memory
    monkeypatch.setattr(engine, "trim_memory", lambda: calls.append(time.monotonic()) or real())

    def idle_for(since: float) -> bool:  # the loop itself has run idle past ``since`` + 0.5 s (> 0.3 s)
        return bool(ticks) and ticks[-1] - since >= 0.5

    b = InflightBatcher(engine, max_batch_size=4, trim_after_idle_s=0.3, idle_callback_period_s=0.05,
                        on_iteration=lambda _: ticks.append(time.monotonic()))  # idle calls must not postpone the trim
    try:
        start = time.monotonic()
        wait_until(lambda: idle_for(start), 30, "idle loop iterations")
        assert calls == []  # nothing ran yet: nothing to give back
        for _ in range(2):
            c = Collector()
            finished_at = []
            b.submit(PROMPTS[2], _params(40), lambda ev: (ev.finished and finished_at.append(time.monotonic()), c(ev)))
            assert c.done.wait(30)
            n = len(calls)
            _wait_for(lambda: len(calls) == n + 1, timeout=5)
            assert calls[-1] - finished_at[0] >= 0.3 - 1e-6  # the trim waits 0.3 s from the last event on
            wait_until(lambda: idle_for(calls[-1]), 30, "idle loop iterations after the trim")
            assert len(calls) == n + 1 and b.trims == n + 1
    finally:
        b.shutdown()
