"""Plots of training: the return and each reward level over steps, train and eval; held-out return
against training minutes; and people's arena ratings of each team state against its step.

Reads the records `collab train` writes to `{output_dir}/metrics.jsonl` (one JSON object per line,
`kind` = "train" or "eval", `step`, `return_mean`, `level/<name>`), or the arena's boards
(web/arena.py `arena_board`). Built on `matplotlib.figure.Figure` (no pyplot, no global backend
switch), so the UI can hand the same figure to `gr.Plot` and the CLI can save it as PNG (Agg).
"""
from __future__ import annotations

import json
import math


def load_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records
           if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def summary_figure(records: list[dict], title: str = "", smooth: int = 5):
    """One panel for the return and one per reward level; train (sampled rollouts, thin line plus a
    `smooth`-step moving average) and eval (held-out split) on each."""
    from matplotlib.figure import Figure

    train = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    levels: list[str] = []
    for r in records:
        levels += [k for k in r if k.startswith("level/") and k not in levels]
    panels = ["return_mean"] + levels
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, key in zip(axes, panels):
        x, y = _series(train, key)
        if x:
            ax.plot(x, y, color="tab:blue", alpha=0.3, linewidth=1)
            ax.plot(x, _moving_average(y, smooth), color="tab:blue", label=f"train ({smooth}-step mean)")
        x, y = _series(evals, key)
        if x:
            ax.plot(x, y, "o-", color="tab:orange", label="eval (held out)")
        ax.set_title("return" if key == "return_mean" else key.split("/", 1)[1])
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def save_summary_plot(records: list[dict], path: str, title: str = "") -> str:
    """Write the summary figure as PNG to `path` and return it."""
    summary_figure(records, title).savefig(path, dpi=110)
    return path


# ------------------------------------------------------------------------------- runs against the clock
def eval_minutes(records: list[dict]) -> list[tuple[float, float]]:
    """(training minutes, held-out return) of each eval record of a `collab train` run. Minutes are
    rollout + reward + update + save time summed over the train records up to the eval's step
    (evaluation itself and start-up are not counted), so runs compare at equal training time."""
    spent, by_step = 0.0, {0: 0.0}
    for r in sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"]):
        spent += sum(v for k, v in r.items() if k.startswith("time/") and isinstance(v, (int, float)))
        by_step[r["step"]] = spent / 60.0
    return [(by_step[r["step"]], r["return_mean"]) for r in records
            if r.get("kind") == "eval" and r["step"] in by_step]


def minutes_figure(curves: dict[str, list[tuple[float, float]]], title: str = "", target: float | None = None):
    """Held-out return against training minutes, one line per run (ours, comlrl's, ...)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for name, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("training minutes (rollouts + updates; evaluation not counted)")
    ax.set_ylabel("held-out team return (of 4)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    return fig


# ------------------------------------------------------------------------------- the arena's learning curve
def arena_points(board: dict) -> list[dict]:
    """The states of one arena board that have votes and a place on the step axis (base at step 0;
    a state no step made, e.g. an admin's pin of one agent, has none: it is in the table only),
    by step."""
    pts = []
    for s in board["states"]:
        step = 0 if s["state"] == "base" else s.get("step")
        if s["votes"] and step is not None:
            pts.append({**s, "x": step})
    return sorted(pts, key=lambda p: p["x"])


def arena_rating_figure(boards: list[dict]):
    """People's blind votes as a learning curve: per task with votes, each team state's
    Bradley–Terry rating (Elo-like scale) with its 95% bootstrap interval against the training step
    that made it (base at 0); the state being served is starred."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    voted = [b for b in boards if b["votes"]] or boards[:1]
    cols = min(2, max(1, len(voted)))
    rows = math.ceil(len(voted) / cols)
    fig = Figure(figsize=(5.2 * cols, 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, board in zip(axes, voted):
        pts = arena_points(board)
        if pts:
            x = [p["x"] for p in pts]
            y = [p["rating"] for p in pts]
            err = [[max(0.0, p["rating"] - p["low"]) for p in pts], [max(0.0, p["high"] - p["rating"]) for p in pts]]
            ax.errorbar(x, y, yerr=err, fmt="o-", color="tab:purple", ecolor="tab:purple", elinewidth=1,
                        capsize=4, label="rating (95% interval)")
            for p in pts:
                ax.annotate(f"n={p['votes']}", (p["x"], p["rating"]), textcoords="offset points", xytext=(6, -10),
                            fontsize="x-small", color="grey")
            serving = [p for p in pts if p.get("serving")]
            if serving:
                ax.plot([p["x"] for p in serving], [p["rating"] for p in serving], "*", markersize=14,
                        color="tab:orange", label="serving now")
        ax.axhline(1000, color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(f"{board['task']}: rated by people ({board['votes']} vote{'s' if board['votes'] != 1 else ''})")
        ax.set_xlabel("training step (base = 0)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("Bradley–Terry rating")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    for ax in axes[len(voted):]:
        ax.set_visible(False)
    return fig
