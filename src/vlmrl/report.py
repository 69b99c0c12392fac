"""End-of-run report: ``report.png`` drawn from ``metrics.jsonl`` / ``eval.jsonl``, and a rich summary table.

Drawing uses matplotlib's object API (``matplotlib.figure.Figure``, rendered by Agg) rather than pyplot,
so it needs no display, sets no global backend and leaks no open figures in a long-lived process.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from .tracking import read_jsonl

# Eval keys that are bookkeeping, not quality: plotted elsewhere or not at all.
_EVAL_SKIP = {"eval/num_samples", "eval/mean_length"}
# Above this many points the raw values are drawn faint with a smoothed line on top.
_SMOOTH_FROM = 20


def _by_step(rows: list[dict]) -> list[dict]:
    """Rows sorted by step, keeping the last line per step: a resumed run re-logs the steps between its
    checkpoint and the interruption, and the re-run values are the ones the final model followed."""
    last = {row["step"]: row for row in rows if isinstance(row.get("step"), (int, float))}
    return [last[s] for s in sorted(last)]


def _series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, values) for `key`, skipping rows where it is absent or null; None when nothing is left."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool) and math.isfinite(r[key])]
    if not pts:
        return None
    xs, ys = zip(*pts)
    return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)


def _smooth(ys: np.ndarray) -> np.ndarray:
    """Debiased exponential moving average (as TensorBoard's slider), span ~ 1/15 of the run."""
    alpha = min(1.0, 15.0 / len(ys))
    out, avg, norm = np.empty_like(ys), 0.0, 0.0
    for i, y in enumerate(ys):
        avg = (1 - alpha) * avg + alpha * y
        norm = (1 - alpha) * norm + alpha  # the debias term: early points are not pulled towards 0
        out[i] = avg / norm
    return out


def _panel(
    ax, title: str, curves: list[tuple[str, tuple[np.ndarray, np.ndarray] | None]], ylabel: str = "", markers: bool = False, legend: bool = False
) -> None:
    """Draw labelled curves into `ax`; an axis with no data says "not logged" instead of failing."""
    ax.set_title(title, fontsize=10)
    curves = [(label, s) for label, s in curves if s is not None]
    if not curves:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    for i, (label, (xs, ys)) in enumerate(curves):
        color = f"C{i}"
        if markers or len(ys) < _SMOOTH_FROM:
            ax.plot(xs, ys, color=color, label=label, marker="o" if markers or len(ys) < 2 else None, markersize=3)
        else:
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(xs, _smooth(ys), color=color, label=label)
    ax.set_xlabel("step", fontsize=8)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if legend or markers or len(curves) > 1:
        ax.legend(fontsize=7)


def no_signal_spans(rows: list[dict]) -> list[tuple[float, float]]:
    """[(first, last)] step ranges where every group's rewards were equal (``frac_reward_zero_std == 1``): steps
    whose policy gradient was zero, shaded in the reward panel so a flat curve is not mistaken for convergence."""
    spans: list[tuple[float, float]] = []
    for row in rows:
        if row.get("frac_reward_zero_std") != 1:
            continue
        step = float(row["step"])
        if spans and spans[-1][1] == step - 1:
            spans[-1] = (spans[-1][0], step)
        else:
            spans.append((step, step))
    return spans


def _shade_no_signal(ax, spans: list[tuple[float, float]]) -> None:
    for i, (first, last) in enumerate(spans):
        ax.axvspan(
            first - 0.5, last + 0.5, color="red", alpha=0.12, linewidth=0, label="no signal (all rewards in each group equal)" if i == 0 else None
        )
    if spans:
        ax.legend(fontsize=7)


def make_report(output_dir: str | Path, title: str | None = None) -> Path:
    """Draw ``output_dir/report.png`` from the run's logs and return its path.

    Panels: reward (total and per-reward means), eval metrics (every ``eval/*`` key), loss, KL,
    completion length, peak memory (``mem/*peak*``), step time and grad norm. Missing logs or keys give
    "not logged" panels, never an error.
    """
    out = Path(output_dir)
    train = _by_step(read_jsonl(out / "metrics.jsonl"))
    evals = _by_step(read_jsonl(out / "eval.jsonl"))
    train_keys = sorted({k for r in train for k in r})
    eval_keys = sorted({k for r in evals for k in r if k.startswith("eval/") and k not in _EVAL_SKIP})

    def curves(keys, rows=train, strip=""):
        return [(k.removeprefix(strip), _series(rows, k)) for k in keys]

    reward_keys = ["reward"] + [k for k in train_keys if k.startswith("rewards/") and k.endswith("/mean")]
    peak_keys = [k for k in train_keys if k.startswith("mem/") and "peak" in k]

    fig = Figure(figsize=(16, 7.5), layout="constrained")
    axes = fig.subplots(2, 4).ravel()
    _panel(axes[0], "reward", [(k.removeprefix("rewards/").removesuffix("/mean"), _series(train, k)) for k in reward_keys])
    _shade_no_signal(axes[0], no_signal_spans(train))
    _panel(axes[1], "eval", curves(eval_keys, evals, "eval/"), markers=True)
    _panel(axes[2], "loss", curves(["loss"]))
    _panel(axes[3], "KL to reference", curves(["kl"]))
    _panel(
        axes[4],
        "completion length",
        [("train", _series(train, "completions/mean_length")), ("eval", _series(evals, "eval/mean_length"))],
        ylabel="tokens",
    )
    _panel(axes[5], "peak memory", curves(peak_keys, strip="mem/"), ylabel="GiB", legend=True)
    _panel(axes[6], "step time", curves(["time/step"]), ylabel="s")
    _panel(axes[7], "grad norm", curves(["grad_norm"]))
    fig.suptitle(title or out.resolve().name)

    path = out / "report.png"
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def summary_table(rows: list[tuple[str, str]] | dict, title: str = "summary") -> str:
    """Print a two-column table with rich (e.g. the end-of-run accuracy before / after) and return it as
    plain text, for logs and tests."""
    from rich.console import Console
    from rich.table import Table

    items = list(rows.items()) if isinstance(rows, dict) else list(rows)
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in items:
        table.add_row(str(name), value if isinstance(value, str) else f"{value:.4g}" if isinstance(value, float) else str(value))
    console = Console(record=True)  # record: the same render comes back as plain text
    console.print(table)
    return console.export_text()
