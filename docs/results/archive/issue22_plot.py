"""Issue 22's figures: held-out return against training minutes, the MAGRPO team and the single
agent trained with GRPO by the same trainer (`collab train --num-agents 1`), each on one core of
the same 2-core AVX2 box at the same time: HumanEval 30 minutes each, TL;DR 20 minutes each.

    .venv/bin/python docs/results/archive/issue22_plot.py     # reads the metrics in docs/results, writes the PNG there
"""
import os
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")   # docs/results: the raw files
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from collab_app.web.plots import eval_minutes, load_metrics, minutes_figure  # noqa: E402

for task, title, minutes in (("humaneval", "HumanEval/0..31 held out", 30), ("tldr", "TL;DR, 5 held-out texts", 20)):
    runs = {arm: load_metrics(os.path.join(HERE, f"{task}-issue22-{arm}-metrics.jsonl")) for arm in ("team", "single")}
    steps = {arm: max(r["step"] for r in rs if r.get("kind") == "train") for arm, rs in runs.items()}
    curves = {f"MAGRPO team, {steps['team']} steps": eval_minutes(runs["team"]),
              f"GRPO single agent, {steps['single']} steps": eval_minutes(runs["single"])}
    fig = minutes_figure(curves, f"{title}, SmolLM2-135M, one AVX2 core each, {minutes} min",
                         target=2.0 if task == "humaneval" else None)
    fig.axes[0].set_ylabel("held-out return (of 4)" if task == "humaneval" else "held-out return (of 3)")
    out = os.path.join(HERE, f"{task}-issue22-minutes.png")
    fig.savefig(out, dpi=110)
    print("wrote", out)
