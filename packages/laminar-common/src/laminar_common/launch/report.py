"""``laminar report RUN_DIR``: a run's metrics as a short text summary and PNG plots.

Reads ``metrics.jsonl`` (one object per trainer step) and ``summary.json``
written by the trainer; given ``since`` (``laminar up``: the launch's start),
only what was written since then, so a launch never reports an earlier
launch's run. Plots need matplotlib (``laminar-common[report]``);
without it only the text is produced, and the output says so. A file that is
not what the trainer writes (a torn line, a row without a field the report
uses) is a :class:`LaminarError` naming the file and line, never a traceback.
Only ``_ROW_FIELDS`` are required of a row: the optimisation and generation
figures (loss, grad norm, KL, clip fractions, entropy, response lengths,
reward per data source) are optional, absent from older runs and simulated
steps, and a panel or summary line without them says "no data" or is left out.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from laminar_common.errors import LaminarError
from laminar_common.jsonl import iter_jsonl

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["load_metrics", "summarize", "plot_report", "write_plots", "write_timeline",
           "find_worker_stats", "busy_in_window"]


_ROW_FIELDS = ("step", "version", "time", "reward_mean", "tokens_per_s", "step_s", "wait_s")
_SUMMARY_FIELDS = ("tokens_per_s", "tokens_consumed", "trainer_idle_fraction", "staleness_mean",
                   "stall_mean_s", "send_mean_s")
_LAST_STEP_LINES = (
    ("last step", (("loss", "loss", ".4g"), ("grad norm", "grad_norm", ".4g"),
                   ("grad norm max", "grad_norm_max", ".4g"), ("entropy", "entropy", ".4g"))),
    ("last step clip fraction", (("total", "clip_fraction", ".3f"),
                                 ("low", "clip_fraction_low", ".3f"),
                                 ("high", "clip_fraction_high", ".3f"))),
    ("last step KL", (("behaviour", "behaviour_kl", ".3g"), ("proximal", "proximal_kl", ".3g"),
                      ("reference", "kl", ".3g"))),
    ("last step responses", (("length mean", "response_length_mean", ".1f"),
                             ("max", "response_length_max", ".0f"),
                             ("truncated", "truncation_rate", ".1%"))),
)
"""Summary lines on the last row's optional figures: (head, ((label, key, format), ...))."""


def _checked(value: object, fields: tuple[str, ...], where: str) -> dict:
    """``value`` if it is a JSON object holding ``fields``."""
    if not isinstance(value, dict):
        raise LaminarError(f"{where}: expected a JSON object, got {type(value).__name__}")
    missing = [f for f in fields if f not in value]
    if missing:
        raise LaminarError(f"{where}: lacks {', '.join(missing)}; "
                           "is it written by laminar-trainer?")
    return value


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


_SINCE = object()


def load_metrics(run_dir: str | Path, since: float | None = None,
                 rows_since: float | None | object = _SINCE) -> tuple[list[dict], dict]:
    """The rows of ``metrics.jsonl`` and ``summary.json`` (``{}`` until the run ends).

    Args:
        since: wall time; only rows of steps that ended at or after it, and
            ``summary.json`` only if written since (None: everything).
        rows_since: the rows' bound where it differs from ``since`` (None: every row of a
            file written since ``since``, as after a resume).

    Raises:
        LaminarError: no ``metrics.jsonl`` (or none written since ``since``:
            the message says when it was), or a line / file that is not valid
            JSON or lacks a field the report uses (named as ``path:line``).
    """
    run = Path(run_dir)
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise LaminarError(f"{run} has no metrics.jsonl: is it a trainer run_dir?"
                           if since is None else
                           f"{run} has no metrics.jsonl: the trainer wrote no step in this launch")
    written = path.stat().st_mtime
    if since is not None and written < since:
        raise LaminarError(f"{path} is an earlier launch's (last written {_when(written)}, "
                           f"before this launch began at {_when(since)}): the trainer wrote "
                           "no step in this launch")
    rows_bound = since if rows_since is _SINCE else rows_since
    rows = []
    for where, row in iter_jsonl(path):
        row = _checked(row, _ROW_FIELDS, where)
        if rows_bound is None or row["time"] >= rows_bound:
            rows.append(row)
    summary_path = run / "summary.json"
    summary: dict = {}
    if summary_path.is_file() and (since is None or summary_path.stat().st_mtime >= since):
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as exc:
            raise LaminarError(f"{summary_path}:{exc.lineno}: not valid JSON: {exc.msg}") from exc
        summary = _checked(summary, _SUMMARY_FIELDS, str(summary_path))
    return rows, summary


def _number(value: object) -> float | None:
    """``value`` if it is a JSON number (not a bool), else None: an optional figure a row
    may lack, or carry as null."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _by_source(row: dict) -> dict[str, float]:
    """A row's ``reward_by_source`` (data source -> mean reward), its numbers only."""
    by_source = row.get("reward_by_source")
    if not isinstance(by_source, dict):
        return {}
    return {str(k): v for k, raw in by_source.items() if (v := _number(raw)) is not None}


_BUCKETS = (("stale0", "0"), ("stale1", "1"), ("stale2", "2"), ("stale3p", "3+"))


def staleness_buckets(rows: list[dict]) -> dict[str, dict[str, float]]:
    """The trainer's per-staleness stats over a run, weighted by each step's tokens in
    the bucket: ``{"0": {"token_frac", "clip_frac", "ratio_mean", "is_weight_mean"}}``
    (only buckets that trained a token; empty for a run without them)."""
    out = {}
    total = sum(_number(r.get("tokens")) or 0.0 for r in rows)
    for key, label in _BUCKETS:
        weights = [(_number(r.get(f"{key}_token_frac")) or 0.0) * (_number(r.get("tokens")) or 0.0)
                   for r in rows]
        n = sum(weights)
        if not n or not total:
            continue
        out[label] = {"token_frac": n / total, **{
            stat: sum(w * (_number(r.get(f"{key}_{stat}")) or 0.0) for w, r in zip(weights, rows)) / n
            for stat in ("clip_frac", "ratio_mean", "is_weight_mean")}}
    return out


def summarize(rows: list[dict], summary: dict) -> str:
    lines = []
    if summary.get("simulated_step"):
        lines.append("NOTE: simulated training step (no model)")
    if rows:
        first, last = rows[0], rows[-1]
        lines.append(f"steps: {last['step']} (weight version {last['version']})")
        lines.append(f"train reward: first step {first['reward_mean']:.3f}, "
                     f"last step {last['reward_mean']:.3f}")
        by_source = _by_source(last)
        if len(by_source) > 1:
            lines.append("last step reward by source: " +
                         ", ".join(f"{k} {v:.3f}" for k, v in sorted(by_source.items())))
        for head, specs in _LAST_STEP_LINES:
            parts = [f"{label} {v:{fmt}}" for label, key, fmt in specs
                     if (v := _number(last.get(key))) is not None]
            if parts:
                lines.append(f"{head}: " + ", ".join(parts))
        buckets = staleness_buckets(rows)
        if buckets:
            lines.append("by staleness over the run (share of trained tokens, clipped, mean "
                         "ratio, mean importance weight): " + "; ".join(
                             f"{name}: {b['token_frac']:.0%}, clip {b['clip_frac']:.3f}, ratio "
                             f"{b['ratio_mean']:.3f}, IS {b['is_weight_mean']:.3f}"
                             for name, b in buckets.items()))
    if summary.get("eval_before") is not None:
        lines.append(f"held-out accuracy: before {summary['eval_before']:.3f}, "
                     f"after {summary['eval_after']:.3f} "
                     f"({100 * (summary['eval_after'] - summary['eval_before']):+.1f} points)")
    if summary:
        lines.append(f"throughput: {summary['tokens_per_s']:.1f} trajectory tokens/s consumed "
                     f"({summary['tokens_consumed']} tokens)")
        lines.append(f"trainer idle fraction: {summary['trainer_idle_fraction']:.2f}")
        hist = summary.get("staleness_hist", {})
        lines.append("staleness (trainer version at consume - generating version): " +
                     ", ".join(f"{k}: {v}" for k, v in hist.items()) +
                     f"; mean {summary['staleness_mean']:.2f}")
        lines.append(f"publish stall per version: {1000 * summary['stall_mean_s']:.1f} ms mean; "
                     f"background send {1000 * summary['send_mean_s']:.1f} ms mean")
    return "\n".join(lines)


def find_worker_stats(run_dir: str | Path, since: float | None = None) -> list[dict]:
    """Worker stats files (``stats_path``) in ``run_dir`` or its parent, sorted by worker;
    given ``since``, only those written since then."""
    out = []
    for d in (Path(run_dir), Path(run_dir).parent):
        for p in sorted(d.glob("*.stats.json")):
            if since is not None and p.stat().st_mtime < since:
                continue
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, json.JSONDecodeError) as exc:
                raise LaminarError(f"{p} is not a worker stats file: {exc}") from exc
        if out:
            break
    return sorted(out, key=lambda w: w["worker_id"])


def _intervals(stats: dict, t0: float, t1: float):
    """(start, end, state) of a worker's timeline, clipped to [t0, t1] (absolute times)."""
    events = [(stats["started_at"] + t, s) for t, s in stats["timeline"]] + [(t1, "end")]
    for (ta, state), (tb, _) in zip(events, events[1:]):
        lo, hi = max(ta, t0), min(tb, t1)
        if hi > lo:
            yield lo, hi, state


def busy_in_window(stats: dict, t0: float, t1: float) -> float:
    """Fraction of [t0, t1] a worker spent busy, from its timeline."""
    busy = sum(hi - lo for lo, hi, state in _intervals(stats, t0, t1) if state == "busy")
    return busy / (t1 - t0) if t1 > t0 else 0.0


def trainer_timeline(rows: list[dict]) -> dict:
    """The trainer as a timeline row (the shape of a worker's stats): from each step's
    metrics row, waiting for data (idle) then training (busy), ending at its ``time``."""
    events: list[tuple[float, str]] = []
    for r in rows:
        train_start = r["time"] - r["step_s"]
        events += [(train_start - r["wait_s"], "idle"), (train_start, "busy"), (r["time"], "idle")]
    t0 = events[0][0] if events else 0.0
    return {"worker_id": "trainer", "started_at": t0,
            "timeline": [(t - t0, state) for t, state in events]}


def write_timeline(runs: list[tuple[str, list[dict], tuple[float, float]]], path: str | Path,
                   note: str = "", title: str = "") -> Path | None:
    """Per-worker busy (green) / idle (grey) / weight load (red) bars, one panel per run
    (the trainer's row, when given as a member, is busy training, idle waiting for data)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    colors = {"busy": "tab:green", "idle": "lightgrey", "weights": "tab:red"}
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 0.5 + 0.45 * max(
        len(w) for _, w, _ in runs) * len(runs) + 0.8 * len(runs)), squeeze=False)
    for ax, (panel, workers, (t0, t1)) in zip(axes[:, 0], runs):
        for row, w in enumerate(workers):
            for lo, hi, state in _intervals(w, t0, t1):
                ax.broken_barh([(lo - t0, hi - lo)], (row - 0.4, 0.8),
                               color=colors.get(state, "white"))
        ax.set_yticks(range(len(workers)), [w["worker_id"] for w in workers])
        ax.set_title(f"{panel}: busy (green) / idle (grey) / weight load (red){note}")
        ax.set_xlim(0, t1 - t0)
        ax.invert_yaxis()  # the first member (the trainer) on top
    axes[-1, 0].set_xlabel("seconds since the first trainer step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that carry ``key`` as a number."""
    points = [(r["step"], v) for r in rows if (v := _number(r.get(key))) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _step_axis(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _no_data(ax: Axes) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
            color="grey")


def _legend_below(ax: Axes, lines=None, labels=None) -> None:
    """The legend under the panel, never over its data."""
    args = (lines, labels) if lines is not None else ()
    ax.legend(*args, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2),
              ncol=2, frameon=False)


def _panel(ax: Axes, rows: list[dict], title: str, left: tuple[tuple[str, str], ...],
           right: tuple[tuple[str, str], ...] = (), right_label: str = "",
           left_label: str = "") -> None:
    """One line per (key, label) the rows carry against step; ``right`` ones on a twin
    axis (another scale); "no data" when the rows carry none of them."""
    # A twin axis restarts the colour cycle: take colours from one sequence for both.
    colors = (f"C{i}" for i in itertools.count())
    lines, twin = [], None
    for key, label in left:
        steps, values = _series(rows, key)
        if steps:
            lines += ax.plot(steps, values, ".-", color=next(colors), label=label)
    for key, label in right:
        steps, values = _series(rows, key)
        if steps:
            if twin is None:
                twin = ax.twinx()
                twin.set_ylabel(right_label)
            lines += twin.plot(steps, values, ".--", color=next(colors), label=label)
    ax.set_title(title)
    ax.set_ylabel(left_label)
    _step_axis(ax)
    if not lines:
        _no_data(ax)
    elif len(lines) > 1:
        _legend_below(ax, lines, [line.get_label() for line in lines])


def _reward_panel(ax: Axes, rows: list[dict], summary: dict) -> None:
    """Train reward (one line per data source when there are several) and held-out
    accuracy."""
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["reward_mean"] for r in rows], ".-", label="train reward")
    sources = sorted({s for r in rows for s in _by_source(r)})
    if len(sources) > 1:
        for source in sources:
            points = [(r["step"], v) for r in rows if (v := _by_source(r).get(source)) is not None]
            ax.plot(*zip(*points), ".:", label=f"train reward: {source}")
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    # The step-0 eval: the summary's, else the first step's row's (a run without a summary:
    # interrupted, or still running).
    before = summary.get("eval_before")
    if before is None:
        before = next((_number(r.get("eval_before")) for r in rows if r["step"] == 1), None)
    if before is not None:
        evals = [(0, before), *evals]
        if summary.get("eval_after") is not None and steps:
            evals.append((steps[-1], summary["eval_after"]))
    if evals:
        ax.plot(*zip(*evals), "o--", label="held-out accuracy")
    ax.set_title("reward")
    ax.set_ylabel("mean reward / accuracy")
    _step_axis(ax)
    if rows:
        _legend_below(ax)
    else:
        _no_data(ax)


def _staleness_panel(ax: Axes, summary: dict) -> None:
    """The run's staleness histogram (``summary.json``; "no data" until the run ends)."""
    from matplotlib.ticker import MaxNLocator

    hist = {int(k): v for k, v in summary.get("staleness_hist", {}).items()}
    ax.set_xlabel("staleness (versions)")
    ax.set_title("staleness at consume")
    if not hist:
        _no_data(ax)
        return
    ax.bar(list(hist), list(hist.values()))
    ax.set_ylabel("trajectories")
    # Staleness is a whole number of versions: a tick under each bar while they fit, else
    # whole numbers spaced to be read (30 stale versions side by side ran together).
    if len(hist) <= 10:
        ax.set_xticks(sorted(hist))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def plot_report(rows: list[dict], summary: dict, title: str = "") -> Figure:
    """The report figure: a 2 x 4 grid of panels (reward, tokens/s, staleness, loss and
    grad norm; KL, clip fractions, entropy, response length and truncation rate).

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(20, 8), layout="constrained")
    axes = fig.subplots(2, 4)
    _reward_panel(axes[0, 0], rows, summary)
    _panel(axes[0, 1], rows, "trajectory tokens/s consumed", (("tokens_per_s", "tokens/s"),),
           left_label="tokens/s (since the first step)")
    _staleness_panel(axes[0, 2], summary)
    _panel(axes[0, 3], rows, "loss and grad norm", (("loss", "loss"),),
           (("grad_norm", "grad norm"), ("grad_norm_max", "grad norm max")),
           "grad norm (before clipping)", left_label="loss")
    _panel(axes[1, 0], rows, "KL (approx.)", (("behaviour_kl", "behaviour || proximal"),
                                              ("proximal_kl", "trained || proximal"),
                                              ("kl", "to reference")),
           left_label="nats / token")
    _panel(axes[1, 1], rows, "clip fraction", (("clip_fraction", "total"),
                                               ("clip_fraction_low", "low"),
                                               ("clip_fraction_high", "high")),
           left_label="fraction of tokens")
    _panel(axes[1, 2], rows, "mean token entropy", (("entropy", "entropy"),),
           left_label="nats / token")
    _panel(axes[1, 3], rows, "response length (tokens)",
           (("response_length_mean", "mean"), ("response_length_max", "max")),
           (("truncation_rate", "truncation rate"),), "truncation rate (fraction)",
           left_label="tokens")
    parts = [p for p in (title, "simulated training step" if summary.get("simulated_step")
                         else "") if p]
    if parts:
        fig.suptitle(" — ".join(parts), fontsize="x-large")
    return fig


def run_title(run_dir: str | Path) -> str:
    """``job <name> · <run dir>`` for a plot: the job from the ``laminar up`` stamp
    (``launch.json``) in the run dir or one above it, else the dir alone."""
    run = Path(run_dir).resolve()
    for where in (run, run.parent):
        try:
            stamp = json.loads((where / "launch.json").read_text())
            return f"job {stamp['job']} · {run}"
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return str(run)


def write_plots(rows: list[dict], summary: dict, out_dir: str | Path,
                workers: list[dict] | None = None, title: str | None = None) -> list[Path]:
    """Write ``report.png`` (:func:`plot_report`) and, when worker stats are given, the
    ``timeline.png`` of the trainer and the workers; returns their paths ([] without
    matplotlib). ``title``: default :func:`run_title` of ``out_dir``."""
    title = run_title(out_dir) if title is None else title
    try:
        fig = plot_report(rows, summary, title)
    except ImportError:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.png"
    fig.savefig(path, dpi=100)
    paths = [path]
    if workers and rows:
        t0 = rows[0]["time"] - rows[0]["step_s"] - rows[0]["wait_s"]
        note = " (simulated step)" if summary.get("simulated_step") else ""
        timeline = write_timeline([("trainer and workers", [trainer_timeline(rows), *workers],
                                    (t0, rows[-1]["time"]))], out / "timeline.png", note, title)
        if timeline is not None:
            paths.append(timeline)
    return paths
