"""End-of-run report: ``report.png`` drawn from ``metrics.jsonl`` / ``eval.jsonl``, and a rich summary table.

Drawing uses matplotlib's object API (``matplotlib.figure.Figure``, rendered by Agg) rather than pyplot,
so it needs no display, sets no global backend and leaks no open figures in a long-lived process.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from vlmrl.run.tracking import read_jsonl
from vlmrl.data.tasks import chance_levels
import yaml

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


# Under GRPO's loss panel: why the number most people read first says little about learning.
GRPO_LOSS_CAPTION = "near 0 by design: advantages are zero-mean in each group"


def run_settings(output_dir: str | Path) -> tuple[float | None, dict[str, float]]:
    """(algorithm.beta, {eval metric: chance level}) of the run in `output_dir`, from its saved config.yaml and the
    task.json beside its eval data (tasks.chance_levels); (None, {}) when there is no readable config."""

    out = Path(output_dir)
    try:
        cfg = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return None, {}
    if not isinstance(cfg, dict):
        return None, {}
    beta = (cfg.get("algorithm") or {}).get("beta")
    data = cfg.get("data") or {}
    eval_path = data.get("eval_path") or ("" if data.get("train_path") else str(out / "data" / str(data.get("task", "count")) / "test.jsonl"))
    return (float(beta) if isinstance(beta, (int, float)) else None), (chance_levels(eval_path) if eval_path else {})


def _chance_lines(ax, chance: dict[str, float], eval_keys: list[str]) -> None:
    """A dashed line at each plotted eval metric's chance level, in that metric's colour."""
    for i, key in enumerate(eval_keys):
        level = chance.get(key.removeprefix("eval/"))
        if level is not None:
            ax.axhline(level, color=f"C{i}", linestyle="--", linewidth=1, label=f"chance ({key.removeprefix('eval/')} {level:.3g})")
    if any(key.removeprefix("eval/") in chance for key in eval_keys):
        ax.legend(fontsize=7)


def _caption(ax, text: str) -> None:
    ax.text(0.5, 0.98, text, transform=ax.transAxes, ha="center", va="top", fontsize=7, color="dimgray")


def _memory_curves(train: list[dict], train_keys: list[str]) -> list:
    """Measured peaks, and the planner's prediction for the device the run used only (GPU reserved, or host RSS on CPU)."""
    curves = [(k.removeprefix("mem/"), _series(train, k)) for k in train_keys if k.startswith("mem/") and "peak" in k]
    predicted = "plan/peak_reserved" if "mem/gpu_peak_reserved" in train_keys else "plan/host_peak_rss"
    return curves + [(f"{predicted.removeprefix('plan/')} (predicted)", _series(train, predicted))]


TOOL_PREFIX = "tools/"  # training metrics of tool-using rollouts (run/tool_rollout.py: tools/turns_mean, tools/calls_mean, ...)


def build_report(output_dir: str | Path, title: str | None = None) -> Figure:
    """The report's figure (see `make_report`), for saving or inspecting."""
    out = Path(output_dir)
    train = _by_step(read_jsonl(out / "metrics.jsonl"))
    evals = _by_step(read_jsonl(out / "eval.jsonl"))
    train_keys = sorted({k for r in train for k in r})
    eval_keys = sorted({k for r in evals for k in r if k.startswith("eval/") and k not in _EVAL_SKIP})
    beta, chance = run_settings(out)
    grpo = "reward" in train_keys  # SFT logs no reward: its panels for rewards, signal and KL would stay empty

    def curves(keys, rows=train, strip=""):
        return [(k.removeprefix(strip), _series(rows, k)) for k in keys]

    panels = []  # (title, draw(ax))
    if grpo:
        reward_keys = ["reward"] + [k for k in train_keys if k.startswith("rewards/") and k.endswith("/mean")]

        def reward_panel(ax):
            _panel(ax, "reward", [(k.removeprefix("rewards/").removesuffix("/mean"), _series(train, k)) for k in reward_keys])
            _shade_no_signal(ax, no_signal_spans(train))

        panels.append(reward_panel)

    def eval_panel(ax):
        _panel(ax, "eval", curves(eval_keys, evals, "eval/"), markers=True)
        _chance_lines(ax, chance, eval_keys)

    def loss_panel(ax):
        _panel(ax, "loss (policy gradient)" if grpo else "loss (target negative log-likelihood)", curves(["loss"]))
        if grpo and any(r.get("loss") is not None for r in train):
            _caption(ax, GRPO_LOSS_CAPTION)

    panels += [eval_panel, loss_panel]
    if grpo:  # what moves when GRPO learns: spread of rewards, groups with no signal, clipped tokens
        panels.append(
            lambda ax: _panel(
                ax,
                "learning signal",
                [
                    ("reward std", _series(train, "reward_std")),
                    ("groups with equal rewards", _series(train, "frac_reward_zero_std")),
                    ("clipped token fraction", _series(train, "clip_ratio")),
                ],
                legend=True,
            )
        )
        if beta != 0:  # beta 0 trains without a reference: no KL is computed, the panel would be a flat 0
            panels.append(lambda ax: _panel(ax, "KL to reference", curves(["kl"])))
        panels.append(
            lambda ax: _panel(
                ax,
                "completion length",
                [("train", _series(train, "completions/mean_length")), ("eval", _series(evals, "eval/mean_length"))],
                ylabel="tokens",
            )
        )
    else:
        panels.append(lambda ax: _panel(ax, "eval answer length", [("eval", _series(evals, "eval/mean_length"))], ylabel="tokens"))
    tool_keys = [k for k in train_keys if k.startswith(TOOL_PREFIX) and "tokens" not in k]  # counts and shares, not lengths
    if tool_keys:  # multi-turn rollouts with tools (issue 28): turns and tool calls per rollout, calls that succeeded
        panels.append(lambda ax: _panel(ax, "tool use (per rollout)", curves(tool_keys, strip=TOOL_PREFIX), legend=True))
    panels += [
        lambda ax: _panel(ax, "peak memory", _memory_curves(train, train_keys), ylabel="GiB", legend=True),
        lambda ax: _panel(ax, "step time", curves(["time/step"]), ylabel="s"),
        lambda ax: _panel(ax, "grad norm", curves(["grad_norm"])),
    ]
    cols = 4
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(16, 3.75 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, draw in zip(axes, panels):
        draw(ax)
    for ax in axes[len(panels) :]:
        ax.set_axis_off()
    fig.suptitle(title or out.resolve().name)
    return fig


def make_report(output_dir: str | Path, title: str | None = None) -> Path:
    """Draw ``output_dir/report.png`` from the run's logs and return its path.

    Panels: reward (total and per-reward means, steps without learning signal shaded), eval metrics (every
    ``eval/*`` key, with a dashed chance line where the task defines one: tasks.chance_levels), loss (GRPO's with a
    caption saying why it sits near 0), learning signal (reward std, fraction of groups with equal rewards, clipped
    token fraction), KL (left out when the run's algorithm.beta is 0), completion length, peak memory (with the
    planner's prediction for the device used), step time and grad norm. SFT runs get the panels that apply to
    them. Missing logs or keys give "not logged" panels, never an error.
    """
    out = Path(output_dir)
    fig = build_report(out, title)
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
