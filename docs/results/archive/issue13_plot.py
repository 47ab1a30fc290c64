"""Issue 13's figure: held-out HumanEval return against training minutes, ours and comlrl's.

    .venv/bin/python docs/results/archive/issue13_plot.py     # reads the files in docs/results, writes the PNG there

comlrl is evaluated only before and after (`collab bench comlrl`), on its own evaluator
(transformers, float32): its two points are drawn as they are, not shifted onto ours.
"""
import json
import os
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")   # docs/results: the raw files
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from collab_app.web.plots import eval_minutes, load_metrics, minutes_figure  # noqa: E402

curves = {
    "collab train, new contract + dynamic sampling": eval_minutes(
        load_metrics(os.path.join(HERE, "humaneval-issue13-ours-metrics.jsonl"))),
    "collab train, old prompts (steps 1-5 slowed by a shared CPU)": eval_minutes(
        load_metrics(os.path.join(HERE, "humaneval-issue13-baseline-metrics.jsonl"))),
}
comlrl = json.load(open(os.path.join(HERE, "humaneval-issue13-comlrl.json")))
curves["comlrl 1.4.3 MAGRPO (full fine-tune; transformers fp32 evaluator)"] = [
    (0.0, comlrl["systems"]["before"]["mean_return"]),
    (comlrl["train"]["minutes"], comlrl["systems"]["after"]["mean_return"])]
fig = minutes_figure(curves, "HumanEval/0..31, SmolLM2-135M, 2-core CPU", target=2.0)
fig.savefig(os.path.join(HERE, "humaneval-issue13-minutes.png"), dpi=110)
print("wrote", os.path.join(HERE, "humaneval-issue13-minutes.png"))
