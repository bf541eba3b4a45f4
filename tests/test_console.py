"""Progress where stderr is not a terminal (CI logs, pipes): plain lines at a bounded rate, with the
share done and the time left, and nothing for work that ends quickly."""

from __future__ import annotations

from trtmoe import console


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(units: str = "steps"):
    clock, lines = Clock(), []
    return console.LineProgress("calibrate", units=units, interval=30.0, write=lines.append, clock=clock), clock, lines


def test_quick_work_prints_nothing():
    prog, clock, lines = make()
    with prog:
        task = prog.add_task("sensitivity", total=None)
        for i in range(1, 11):
            clock.t += 2.0
            prog.update(task, completed=i, total=10)
    assert lines == []


def test_long_work_prints_a_line_per_interval_and_one_at_the_end():
    prog, clock, lines = make()
    with prog:
        task = prog.add_task("sensitivity")
        prog.update(task, completed=0, total=100)  # the start: the clock begins here
        for i in range(1, 101):
            clock.t += 1.0
            prog.update(task, completed=i, total=100)
    assert lines == [
        "calibrate: sensitivity 30/100 (30%), 0:30 elapsed, about 1:10 left",
        "calibrate: sensitivity 60/100 (60%), 1:00 elapsed, about 0:40 left",
        "calibrate: sensitivity 90/100 (90%), 1:30 elapsed, about 0:10 left",
        "calibrate: sensitivity 100/100 (100%), 1:40 elapsed",
    ]


def test_a_resumed_run_is_timed_from_where_it_resumed():
    prog, clock, lines = make()
    with prog:
        task = prog.add_task("sensitivity")
        prog.update(task, completed=50, total=100)  # half done by an earlier, interrupted run
        clock.t += 40.0
        prog.update(task, completed=60, total=100)  # 10 steps in 40 s: 40 steps left take 160 s
    assert lines[0] == "calibrate: sensitivity 60/100 (60%), 0:40 elapsed, about 2:40 left"


def test_bytes_and_no_final_line_after_an_error():
    prog, clock, lines = make("bytes")
    try:
        with prog:
            task = prog.add_task("converting")
            prog.update(task, completed=0, total=4 * 2**30)
            clock.t += 31.0
            prog.update(task, completed=2**30, total=4 * 2**30)
            clock.t += 5.0
            prog.update(task, completed=2 * 2**30, total=4 * 2**30)
            raise OSError("disk full")
    except OSError:
        pass
    assert lines == ["calibrate: converting 1.00 GiB/4.00 GiB (25%), 0:31 elapsed, about 1:33 left"]


def test_off_a_terminal_the_factory_gives_lines():
    assert not console.err_console.is_terminal  # pytest captures stderr
    assert isinstance(console.progress("convert", units="bytes"), console.LineProgress)


# ---- calibrate's routing summary at real-model size ------------------------------------------------

def _calib_res(L: int, E: int, k: int, starved: dict[int, list[int]]) -> dict:
    counts, share = [], []
    for l in range(L):
        c = [64 + (7 * e + l) % 50 for e in range(E)]
        for e in starved.get(l, []):
            c[e] = e % 3
        counts.append(c)
        share.append([x / sum(c) for x in c])
    return {"num_experts": E, "top_k": k, "moe_layers": list(range(L)), "formats": ["int8", "int4"],
            "data": {"tokens": 4096},
            "routing": {"share": share, "counts": counts, "min_tokens_threshold": 16,
                        "entropy_nats": [4.5] * L, "max_entropy_nats": 4.85, "load_imbalance": [2.0] * L,
                        "under_observed": [{"layer": l, "expert": e, "tokens": counts[l][e]}
                                           for l in sorted(starved) for e in starved[l]]},
            "sensitivity": {"method": "fisher", "cost_forward_passes": 5.2}}


def render(res: dict, width: int) -> list[str]:
    from rich.console import Console

    from trtmoe.quant.commands import _render_coverage

    c = Console(width=width, force_terminal=False, record=True)
    _render_coverage(res, c, c)
    return c.export_text().splitlines()


def test_many_experts_get_one_row_and_one_warning_per_layer():
    """Qwen3-30B-A3B's shape: 48 layers × 128 experts in an 80-column log; experts 0..11 of layer 3
    starved. One table row per layer that fits the width, and one warning for the layer."""
    res = _calib_res(48, 128, 8, {3: list(range(12))})
    lines = render(res, 80)
    assert max(len(l) for l in lines) <= 80
    rows = [l for l in lines if l.startswith("│")]
    assert len(rows) == 48
    assert "…" not in "".join(rows)  # nothing cut off
    row3 = rows[3].split("│")
    assert row3[4].strip() == "12"  # twelve experts under the token threshold
    busiest = max(range(128), key=lambda e: res["routing"]["share"][3][e])
    assert row3[2].strip().startswith(f"{busiest}:")
    warn = " ".join(l for l in lines if not l.startswith(("│", "┃", "┏", "┡", "└")))
    assert warn.count("warning:") == 1
    assert "layer 3: 12 of 128 experts saw fewer than 16" in warn and "and 4 more" in warn


def test_under_observed_experts_in_many_layers_get_one_summary_warning():
    """48 layers each with starved experts (a fine-grained MoE on a little calibration data): one
    warning with the total and the worst layers, not 48 paragraphs; the table keeps the per-layer
    counts. Three layers still get a line each."""
    starved = {l: list(range(1 + l % 5)) for l in range(48)}
    res = _calib_res(48, 128, 8, starved)
    lines = render(res, 80)
    warn = " ".join(" ".join(l for l in lines if not l.startswith(("│", "┃", "┏", "┡", "└"))).split())
    assert warn.count("warning:") == 1
    total = sum(map(len, starved.values()))
    assert f"{total} experts in 48 of 48 layers saw fewer than 16 calibration tokens" in warn
    assert "most in layers 4 (5), 9 (5), 14 (5)" in warn and "experts < 16 tokens' column" in warn
    rows = [l for l in lines if l.startswith("│")]
    assert [int(r.split("│")[4]) for r in rows] == [len(starved[l]) for l in range(48)]
    few = " ".join(" ".join(render(_calib_res(48, 128, 8, {l: [0] for l in (2, 5, 7)}), 80)).split())
    assert few.count("warning:") == 3 and "layer 5: 1 of 128 experts" in few


def test_few_experts_keep_a_column_each_where_they_fit():
    res = _calib_res(2, 8, 2, {})
    header = next(l for l in render(res, 120) if l.startswith("┃"))
    assert [h.strip() for h in header.split("┃")[1:-1]] == ["layer", *map(str, range(8)), "entropy", "max/mean"]
    # Eight experts need 86 columns: an 80-column log gets the summary instead of cut-off cells.
    narrow = render(res, 80)
    assert any("busiest" in l and "rarest" in l for l in narrow) and "…" not in "".join(narrow)
