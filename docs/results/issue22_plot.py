"""Issue 22's figure: held-out HumanEval return against training minutes, the MAGRPO team and the
single agent trained with GRPO by the same trainer (`collab train --num-agents 1`), each on one
core of the same 2-core AVX2 box at the same time, 30 minutes each.

    .venv/bin/python docs/results/issue22_plot.py     # reads the metrics beside it, writes the PNG
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from collab_app.web.plots import eval_minutes, load_metrics, minutes_figure  # noqa: E402

curves = {
    "MAGRPO team (helper + main), 14 steps": eval_minutes(
        load_metrics(os.path.join(HERE, "humaneval-issue22-team-metrics.jsonl"))),
    "GRPO single agent (writes aux and the function), 25 steps": eval_minutes(
        load_metrics(os.path.join(HERE, "humaneval-issue22-single-metrics.jsonl"))),
}
fig = minutes_figure(curves, "HumanEval/0..31 held out, SmolLM2-135M, one AVX2 core each", target=2.0)
out = os.path.join(HERE, "humaneval-issue22-minutes.png")
fig.savefig(out, dpi=110)
print("wrote", out)
