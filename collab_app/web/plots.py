"""Summary plot of a training run: the return and each reward level over steps, train and eval.

Reads the records `collab train` writes to `{output_dir}/metrics.jsonl` (one JSON object per line,
`kind` = "train" or "eval", `step`, `return_mean`, `level/<name>`). Built on
`matplotlib.figure.Figure` (no pyplot, no global backend switch), so the UI can hand the same
figure to `gr.Plot` and the CLI can save it as PNG (Agg).
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
