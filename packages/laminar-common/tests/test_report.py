"""`laminar report RUN_DIR` on a trainer run dir written by hand in the trainer's formats.

The files mirror what laminar-trainer's ``TrainerService`` writes (a
``metrics.jsonl`` row per step (``StepLoop.one_step``), ``consumed.jsonl``
(``RunFiles.consumed``), ``summary.json`` from ``_finish``)
and what a rollout worker writes to its ``stats_path`` on exit
(``RolloutWorker.stats()``), with numbers chosen so every figure of the
report can be computed here.
"""

from __future__ import annotations

import json
import statistics
import struct
import zlib
from pathlib import Path

import pytest

from laminar_common.errors import LaminarError
from laminar_common.launch.cli import main
from laminar_common.launch.report import (
    busy_in_window,
    find_worker_stats,
    load_metrics,
    plot_report,
    summarize,
)

T0 = 1_700_000_000.0
"""Wall time of the first step's start of waiting (the trainer's ``Progress.t_first_step``)."""

# Per step: seconds waited for data, seconds of the step, and the step's trajectories as
# (reward, response tokens, staleness = trainer version at consume - generating version).
STEPS = [
    (0.50, 0.20, [(0.0, 10, 0), (1.0, 12, 0), (0.0, 8, 0), (0.0, 10, 0)]),
    (0.10, 0.20, [(1.0, 11, 0), (1.0, 9, 1), (0.0, 10, 1), (1.0, 14, 1)]),
    (0.05, 0.25, [(1.0, 10, 1), (1.0, 10, 2), (1.0, 6, 1), (0.0, 12, 2)]),
    (0.15, 0.20, [(1.0, 10, 1), (1.0, 10, 1), (1.0, 10, 2), (1.0, 10, 0)]),
]
STALLS = [0.002, 0.004, 0.003, 0.005]
SENDS = [0.020, 0.030, 0.025, 0.025]
EVAL_BEFORE, EVAL_AT_2, EVAL_AFTER = 0.125, 0.25, 0.5
FINISH_S = 0.1
"""Seconds between the last step's end and the summary (its held-out evaluation)."""


def _write_run(run: Path) -> dict:
    """Write a finished 4-step run (publish every step, eval every 2) as the trainer does.

    Returns what the report must show, computed the trainer's way.
    """
    run.mkdir(parents=True)
    end, tokens_consumed, hist = T0, 0, {}
    with open(run / "metrics.jsonl", "w") as metrics, open(run / "consumed.jsonl", "w") as consumed:
        for i, (wait_s, step_s, trajs) in enumerate(STEPS):
            step = version = i + 1
            end += wait_s + step_s
            tokens = sum(t for _, t, _ in trajs)
            tokens_consumed += tokens
            staleness = [s for _, _, s in trajs]
            for s in staleness:
                hist[s] = hist.get(s, 0) + 1
            row = {
                "step": step, "version": version, "time": end,
                "loss": 0.5 / step, "reward_mean": statistics.fmean(r for r, _, _ in trajs),
                "tokens": tokens, "tokens_per_s": tokens_consumed / (end - T0),
                "step_s": step_s, "wait_s": wait_s, "stall_s": STALLS[i],
                "staleness_mean": statistics.fmean(staleness), "staleness_max": max(staleness),
                "buffer": 2, "simulated": False, "kl": 0.01 * step, "grad_norm": 1.5,
            }
            if step % 2 == 0:
                row["eval_accuracy"] = EVAL_AT_2 if step == 2 else EVAL_AFTER
            ids = [f"p{i}-{j}:v{version - 1 - s}" for j, (_, _, s) in enumerate(trajs)]
            consumed.write(json.dumps({"step": step, "version": version, "ids": ids}) + "\n")
            metrics.write(json.dumps(row) + "\n")
    elapsed = end + FINISH_S - T0
    hist = dict(sorted(hist.items()))
    total = sum(hist.values())
    summary = {
        "steps": len(STEPS), "version": len(STEPS), "eval_before": EVAL_BEFORE,
        "eval_after": EVAL_AFTER, "tokens_consumed": tokens_consumed,
        "tokens_per_s": tokens_consumed / elapsed,
        "trainer_idle_fraction": sum(w for w, _, _ in STEPS) / elapsed,
        "staleness_hist": hist, "staleness_mean": sum(k * v for k, v in hist.items()) / total,
        "publishes": len(STEPS), "publish_failed": 0,
        "stall_mean_s": statistics.fmean(STALLS), "send_mean_s": statistics.fmean(SENDS),
        "buffer": {"received": 17, "duplicates": 1, "already_consumed": 0, "dropped_full": 0,
                   "dropped_stale": 0, "downweighted": 0, "reward_errors": 0,
                   "staleness": hist},
        "simulated_step": False, "run_dir": str(run), "tracker_errors": 0,
    }
    # json.dumps turns the histogram's int keys into strings, as in the trainer's file.
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    return {"tokens_consumed": tokens_consumed, "elapsed": elapsed, "hist": hist,
            "summary": json.loads(json.dumps(summary))}


def _write_worker_stats(run: Path, worker_id: str, started_at: float,
                        timeline: list[tuple[float, str]]) -> None:
    """A worker's ``stats_path`` file (``{run_dir}/trainer/{name}.stats.json``)."""
    uptime = timeline[-1][0] + 1.0
    busy = sum(b[0] - a[0] for a, b in zip(timeline, timeline[1:]) if a[1] == "busy")
    stats = {"worker_id": worker_id, "uptime_s": uptime, "busy_s": busy,
             "busy_fraction": busy / uptime, "weight_wait_s": 0.1,
             "counters": {"requests": 12, "finished": 12}, "weight_version": 4, "outbox": 0,
             "started_at": started_at, "timeline": [list(e) for e in timeline]}
    (run / f"{worker_id}.stats.json").write_text(json.dumps(stats))


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "run" / "trainer"
    expected = _write_run(run)
    # worker-1 started before the trainer; worker-0 after; both given in relative seconds.
    _write_worker_stats(run, "worker-1", T0 - 1.0,
                        [(0.0, "idle"), (1.2, "busy"), (1.6, "weights"), (1.7, "busy"),
                         (2.5, "idle")])
    _write_worker_stats(run, "worker-0", T0 + 0.25,
                        [(0.0, "busy"), (0.75, "idle"), (1.0, "busy")])
    return run, expected


def test_summary_text_shows_the_run_numbers(run):
    run_dir, expected = run
    rows, summary = load_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    text = summarize(rows, summary)
    first = statistics.fmean(r for r, _, _ in STEPS[0][2])
    last = statistics.fmean(r for r, _, _ in STEPS[-1][2])
    assert (first, last) == (0.25, 1.0)
    s = expected["summary"]
    assert text.splitlines() == [
        "steps: 4 (weight version 4)",
        "train reward: first step 0.250, last step 1.000",
        "last step: loss 0.125, grad norm 1.5",
        "last step KL: reference 0.04",
        "held-out accuracy: before 0.125, after 0.500 (+37.5 points)",
        f"throughput: {expected['tokens_consumed'] / expected['elapsed']:.1f} trajectory "
        f"tokens/s consumed ({expected['tokens_consumed']} tokens)",
        f"trainer idle fraction: {0.8 / expected['elapsed']:.2f}",
        "staleness (trainer version at consume - generating version): 0: 6, 1: 7, 2: 3; "
        f"mean {(7 + 2 * 3) / 16:.2f}",
        f"publish stall per version: {1000 * statistics.fmean(STALLS):.1f} ms mean; "
        f"background send {1000 * statistics.fmean(SENDS):.1f} ms mean",
    ]
    # The hand-computed figures agree with the file the report read them from.
    assert expected["tokens_consumed"] == 162 and s["tokens_consumed"] == 162
    assert s["staleness_hist"] == {"0": 6, "1": 7, "2": 3}
    assert "NOTE: simulated" not in text


def test_summary_before_the_run_ends_has_only_the_rows(run):
    run_dir, _ = run
    (run_dir / "summary.json").unlink()
    rows, summary = load_metrics(run_dir)
    assert summary == {}
    assert summarize(rows, summary).splitlines() == [
        "steps: 4 (weight version 4)", "train reward: first step 0.250, last step 1.000",
        "last step: loss 0.125, grad norm 1.5", "last step KL: reference 0.04"]


def test_worker_timelines_are_found_sorted_and_measured_in_the_trainer_window(run):
    run_dir, _ = run
    rows, _ = load_metrics(run_dir)
    workers = find_worker_stats(run_dir)
    assert [w["worker_id"] for w in workers] == ["worker-0", "worker-1"]
    t0 = rows[0]["time"] - rows[0]["step_s"] - rows[0]["wait_s"]
    t1 = rows[-1]["time"]
    assert t0 == pytest.approx(T0) and t1 == pytest.approx(T0 + 1.65)
    # worker-0 (from T0+0.25): busy 0.25-1.0, idle 1.0-1.25, busy 1.25-1.65 (window end).
    assert busy_in_window(workers[0], t0, t1) == pytest.approx((0.75 + 0.40) / 1.65)
    # worker-1 (from T0-1): idle until T0+0.2, busy 0.2-0.6, weights 0.6-0.7,
    # busy 0.7-1.5, idle after.
    assert busy_in_window(workers[1], t0, t1) == pytest.approx((0.4 + 0.8) / 1.65)


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG whose signature, IHDR and IEND chunks (with CRCs) check."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND", [k for k, _ in chunks]
    assert any(k == b"IDAT" for k, _ in chunks)
    return struct.unpack(">II", chunks[0][1][:8])


def test_cli_prints_the_summary_and_writes_valid_plots(run, capsys):
    pytest.importorskip("matplotlib")
    run_dir, expected = run
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "steps: 4 (weight version 4)" in out
    assert f"({expected['tokens_consumed']} tokens)" in out
    report, timeline = run_dir / "report.png", run_dir / "timeline.png"
    assert f"plots: {report}, {timeline}" in out
    # figsize (20, 8) at 100 dpi; the timeline is 12 inches wide at 90 dpi.
    assert _png_size(report) == (2000, 800)
    assert _png_size(timeline)[0] == 1080
    assert report.stat().st_size > 20_000 and timeline.stat().st_size > 5_000


def _add_training_figures(run_dir: Path, sources: tuple[str, ...] = ("gsm8k", "math")) -> None:
    """Give every metrics row the trainer's optional per-step figures (the run already has
    ``loss``, ``grad_norm`` and ``kl``); source ``i`` of ``reward_by_source`` gets
    ``reward_mean / (i + 1)``."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        s = row["step"]
        row.update({
            "grad_norm_max": 2.0 + s, "entropy": 1.0 - 0.1 * s,
            "clip_fraction": 0.05 * s, "clip_fraction_low": 0.02 * s,
            "clip_fraction_high": 0.03 * s, "behaviour_kl": 0.001 * s, "proximal_kl": 0.002 * s,
            "is_weight_mean": 1.0, "is_weight_max": 1.5, "is_truncated_fraction": 0.0,
            "response_length_mean": 10.0 + s, "response_length_max": 14, "truncation_rate": 0.25,
            "reward_by_source": {src: row["reward_mean"] / (i + 1) for i, src in enumerate(sources)},
            "groups_filtered": 0, "updates": 2,
        })
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


PANELS = ["reward", "trajectory tokens/s consumed", "staleness at consume", "loss and grad norm",
          "KL (approx.)", "clip fraction", "mean token entropy", "response length (tokens)"]


def _panels(fig) -> dict:
    """The report's panels by title (twin axes have none), laid out for reading ticks."""
    fig.draw_without_rendering()
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def _no_data(ax) -> bool:
    return [t.get_text() for t in ax.texts] == ["no data"]


def _labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


def test_the_training_figures_have_a_panel_each_in_one_grid(run):
    pytest.importorskip("matplotlib")
    run_dir, _ = run
    _add_training_figures(run_dir)
    rows, summary = load_metrics(run_dir)
    fig = plot_report(rows, summary)
    panels = _panels(fig)
    assert list(panels) == PANELS
    # 2 x 4 panels, plus the twin axes of grad norm and of truncation rate.
    assert len(fig.axes) == 10
    assert [ax.get_subplotspec().get_geometry()[:2] for ax in panels.values()] == [(2, 4)] * 8
    assert not any(_no_data(ax) for ax in panels.values())
    assert _labels(panels["reward"]) == ["train reward", "train reward: gsm8k",
                                         "train reward: math", "held-out accuracy"]
    math_line = panels["reward"].get_lines()[2]
    assert list(math_line.get_ydata()) == [r["reward_mean"] / 2 for r in rows]
    assert _labels(panels["KL (approx.)"]) == ["behaviour || proximal", "trained || proximal",
                                               "to reference"]
    assert _labels(panels["clip fraction"]) == ["total", "low", "high"]
    legend = panels["loss and grad norm"].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["loss", "grad norm", "grad norm max"]
    legend = panels["response length (tokens)"].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["mean", "max", "truncation rate"]
    twins = [ax for ax in fig.axes if not ax.get_title()]
    assert [ax.get_ylabel() for ax in twins] == ["grad norm (before clipping)",
                                                 "truncation rate (fraction)"]
    # Every panel says what its y axis counts, and no legend sits on the data (below it).
    assert all(ax.get_ylabel() for ax in panels.values())
    for ax in panels.values():
        legend = ax.get_legend()
        if legend is not None:
            box = legend.get_window_extent()
            assert box.y1 <= ax.get_window_extent().y0, ax.get_title()
    assert list(twins[1].get_lines()[0].get_ydata()) == [0.25] * 4


def test_step_and_staleness_axes_have_integer_ticks(run):
    pytest.importorskip("matplotlib")
    run_dir, _ = run
    _add_training_figures(run_dir)
    rows, summary = load_metrics(run_dir)
    panels = _panels(plot_report(rows, summary))
    # A tick under each staleness bar (0, 1 and 2 versions), none between.
    assert list(panels.pop("staleness at consume").get_xticks()) == [0, 1, 2]
    for title, ax in panels.items():
        ticks = [t for t in ax.get_xticks() if 1 <= t <= 4]
        assert ax.get_xlabel() == "step", title
        assert len(ticks) >= 2 and all(t == int(t) for t in ticks), (title, ticks)


def test_one_data_source_is_the_train_reward_line_alone(run):
    pytest.importorskip("matplotlib")
    run_dir, _ = run
    _add_training_figures(run_dir, sources=("gsm8k",))
    rows, summary = load_metrics(run_dir)
    assert _labels(_panels(plot_report(rows, summary))["reward"]) == ["train reward",
                                                                      "held-out accuracy"]
    assert not any("by source" in line for line in summarize(rows, summary).splitlines())


def test_summary_shows_the_last_steps_training_figures(run):
    run_dir, _ = run
    _add_training_figures(run_dir)
    rows, summary = load_metrics(run_dir)
    lines = summarize(rows, summary).splitlines()
    assert lines[1:8] == [
        "train reward: first step 0.250, last step 1.000",
        "last step reward by source: gsm8k 1.000, math 0.500",
        "last step: loss 0.125, grad norm 1.5, grad norm max 6, entropy 0.6",
        "last step clip fraction: total 0.200, low 0.080, high 0.120",
        "last step KL: behaviour 0.004, proximal 0.008, reference 0.04",
        "last step responses: length mean 14.0, max 14, truncated 25.0%",
        "held-out accuracy: before 0.125, after 0.500 (+37.5 points)",
    ]


def test_rows_without_the_training_figures_still_report(run):
    """Older runs and simulated steps lack the optional figures, or carry them as null:
    their panels say "no data", the summary leaves their lines out."""
    pytest.importorskip("matplotlib")
    run_dir, _ = run
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    keep = ("step", "version", "time", "reward_mean", "tokens_per_s", "step_s", "wait_s",
            "eval_accuracy")
    rows = [{k: v for k, v in r.items() if k in keep} | {"loss": None, "reward_by_source": None}
            for r in rows]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    rows, summary = load_metrics(run_dir)
    assert not any(line.startswith("last step") for line in summarize(rows, summary).splitlines())
    fig = plot_report(rows, summary)
    panels = _panels(fig)
    assert list(panels) == PANELS and len(fig.axes) == 8
    assert [title for title, ax in panels.items() if _no_data(ax)] == PANELS[3:]
    assert _labels(panels["reward"]) == ["train reward", "held-out accuracy"]
    # Before the run ends there is no staleness histogram either.
    assert _no_data(_panels(plot_report(rows, {}))["staleness at consume"])
    assert main(["report", str(run_dir)]) == 0
    assert _png_size(run_dir / "report.png") == (2000, 800)


def test_cli_without_matplotlib_says_so(run, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run_dir, _ = run
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "steps: 4 (weight version 4)" in out
    assert "plots: none (pip install 'laminar-common[report]' for matplotlib)" in out
    assert not (run_dir / "report.png").exists()


@pytest.mark.parametrize("bad_line, message", [
    ('{"step": 3, "version": 3, "time": 1700000001.2, "reward_m', r"not valid JSON"),
    ("[1, 2, 3]", r"expected a JSON object, got list"),
    ('{"step": 3, "version": 3}', r"lacks time, reward_mean, tokens_per_s, step_s, wait_s"),
])
def test_a_malformed_metrics_line_is_named_by_file_and_line(run, capsys, bad_line, message):
    run_dir, _ = run
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = bad_line
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(LaminarError, match=rf"metrics\.jsonl:3: {message}"):
        load_metrics(run_dir)
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"laminar report: error: {path}:3: "), err
    assert not (run_dir / "report.png").exists()


def test_a_torn_summary_is_named(run, capsys):
    run_dir, _ = run
    path = run_dir / "summary.json"
    path.write_text(path.read_text()[:40])
    assert main(["report", str(run_dir)]) == 2
    assert f"laminar report: error: {path}:" in capsys.readouterr().err


def test_a_dir_without_metrics_is_not_a_trainer_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "has no metrics.jsonl: is it a trainer run_dir?" in capsys.readouterr().err


def test_since_leaves_out_an_earlier_launchs_files(run):
    """`laminar up` reads only what its launch wrote: an older metrics file is refused
    (naming when it was written), older rows, summary and worker stats are left out."""
    import os

    run_dir, _ = run
    launch = T0 + 1_000.0
    for path in run_dir.iterdir():
        os.utime(path, (T0 + 10, T0 + 10))
    with pytest.raises(LaminarError, match=r"metrics\.jsonl is an earlier launch's \(last "
                                           r"written .*\): the trainer wrote no step"):
        load_metrics(run_dir, since=launch)
    # The trainer of this launch wrote two steps (no summary yet) after the old four.
    with open(run_dir / "metrics.jsonl", "a") as fh:
        for step in (1, 2):
            fh.write(json.dumps({"step": step, "version": step, "time": launch + step,
                                 "reward_mean": 0.75, "tokens_per_s": 3.0, "step_s": 0.5,
                                 "wait_s": 0.5}) + "\n")
    rows, summary = load_metrics(run_dir, since=launch)
    assert [r["time"] for r in rows] == [launch + 1, launch + 2] and summary == {}
    assert summarize(rows, summary).splitlines()[0] == "steps: 2 (weight version 2)"
    assert find_worker_stats(run_dir, since=launch) == []
    assert len(find_worker_stats(run_dir)) == 2
    assert len(load_metrics(run_dir)[0]) == 6  # `laminar report` reads everything


def test_since_without_a_metrics_file_says_no_step_was_written(tmp_path):
    with pytest.raises(LaminarError, match="the trainer wrote no step in this launch"):
        load_metrics(tmp_path, since=T0)


def test_the_plots_are_titled_with_the_job_and_the_timeline_has_the_trainer(run):
    pytest.importorskip("matplotlib")
    from laminar_common.launch.report import busy_in_window, run_title, trainer_timeline

    run_dir, _ = run
    (run_dir.parent / "launch.json").write_text(json.dumps({"job": "demo"}))
    assert run_title(run_dir) == f"job demo · {run_dir.resolve()}"
    rows, summary = load_metrics(run_dir)
    fig = plot_report(rows, summary, run_title(run_dir))
    assert fig._suptitle.get_text() == f"job demo · {run_dir.resolve()}"
    trainer = trainer_timeline(rows)
    assert trainer["worker_id"] == "trainer"
    t0 = rows[0]["time"] - rows[0]["step_s"] - rows[0]["wait_s"]
    t1 = rows[-1]["time"]
    # busy exactly while it trained: the steps' step_s over the window
    want = sum(r["step_s"] for r in rows) / (t1 - t0)
    assert busy_in_window(trainer, t0, t1) == pytest.approx(want, rel=1e-6)
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "timeline.png").stat().st_size > 0


def test_many_staleness_bars_get_readable_ticks():
    pytest.importorskip("matplotlib")
    hist = {str(k): 1 for k in range(40)}
    panels = _panels(plot_report([], {"staleness_hist": hist}))
    ticks = panels["staleness at consume"].get_xticks()
    assert 2 <= len(ticks) <= 12 and all(t == int(t) for t in ticks)


def test_an_interrupted_run_still_plots_its_step_0_eval(run):
    """No summary.json (stopped, or still running): the step-0 eval comes from the first
    step's row, where the trainer writes it."""
    pytest.importorskip("matplotlib")
    run_dir, _ = run
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["eval_before"] = 0.125
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    rows, _ = load_metrics(run_dir)
    reward = _panels(plot_report(rows, {}))["reward"]
    held_out = next(line for line in reward.get_lines() if line.get_label() == "held-out accuracy")
    assert (held_out.get_xdata()[0], held_out.get_ydata()[0]) == (0, 0.125)
