"""Issue 22 item 3, the seeds of the pair: the MAGRPO team against the GRPO single agent at G=8 x 2,
30 minutes each, both runs at once on one core each (taskset, VLLM_CPU_OMP_THREADS_BIND, one
OpenMP thread), COLLAB_CALIBRATE=0 (dtype from the CPU flags: bf16 there, as the calibration also
chose), seeds 1-4 on the Xeon with AMX of 2026-11-26 (bf16; seed 0 ran on the AVX2 EPYC in fp32):

    collab train --task humaneval --max-new-tokens 128 --learning-rate 5e-4 --num-steps 200 \\
      --max-minutes 30 --dynamic-sampling 1 --eval-every 100 --eval-examples 32 --keep-versions 0 \\
      --seed S --num-generations 8 --prompts-per-step 2 [--num-agents 1]

Each seed is a pair on one machine; the seeds are on different CPUs and dtypes, so they are
reported one by one and then pooled per problem (each problem's mean over the seeds, team and
single alike: 32 paired differences, the problems not counted twice).

    .venv/bin/python docs/results/archive/issue22_pair_seeds.py   # prints; writes issue22-pair-seeds.json
"""
import json
import os
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")   # docs/results: the raw files
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from collab_app.commands.evaluate import paired_difference  # noqa: E402
from collab_app.web.plots import load_metrics  # noqa: E402

SEEDS = {"seed 0 (AVX2 EPYC, fp32)": ("humaneval-issue22-pair-g8-team-metrics.jsonl",
                                      "humaneval-issue22-pair-g8-single-metrics.jsonl"),
         "seed 1 (Xeon with AMX, bf16)": ("humaneval-issue22-pair-g8-s1-amx-team-metrics.jsonl",
                                          "humaneval-issue22-pair-g8-s1-amx-single-metrics.jsonl"),
         "seed 2 (Xeon with AMX, bf16)": ("humaneval-issue22-pair-g8-s2-amx-team-metrics.jsonl",
                                          "humaneval-issue22-pair-g8-s2-amx-single-metrics.jsonl"),
         "seed 3 (Xeon with AMX, bf16)": ("humaneval-issue22-pair-g8-s3-amx-team-metrics.jsonl",
                                          "humaneval-issue22-pair-g8-s3-amx-single-metrics.jsonl"),
         "seed 4 (Xeon with AMX, bf16)": ("humaneval-issue22-pair-g8-s4-amx-team-metrics.jsonl",
                                          "humaneval-issue22-pair-g8-s4-amx-single-metrics.jsonl")}


def arm(path: str) -> dict:
    records = load_metrics(os.path.join(HERE, path))
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    first, last = evals[0], evals[-1]
    return {"steps": len(train), "untrained": round(first["return_mean"], 3), "held_out": round(last["return_mean"], 3),
            "pass@1": round(last["pass@1"], 3), "cooperation": round(last.get("level/cooperation", 0.0), 3),
            "returns": last["returns"]}


def main() -> None:
    out, teams, singles = {}, [], []
    for name, (team_file, single_file) in SEEDS.items():
        team, single = arm(team_file), arm(single_file)
        teams.append(team["returns"])
        singles.append(single["returns"])
        out[name] = {"team": {k: v for k, v in team.items() if k != "returns"},
                     "single": {k: v for k, v in single.items() if k != "returns"},
                     "team - single": paired_difference(single["returns"], team["returns"])}
    ids = sorted(set.intersection(*(set(r) for r in teams + singles)))
    mean = lambda runs: {i: sum(r[i] for r in runs) / len(runs) for i in ids}   # noqa: E731
    out["pooled per problem (mean of the seeds)"] = paired_difference(mean(singles), mean(teams))
    with open(os.path.join(HERE, "issue22-pair-seeds.json"), "w") as f:
        json.dump(out, f, indent=1)
    for name, s in out.items():
        print(f"{name}: {json.dumps(s)}")
    plot()


def plot() -> None:
    """issue22-pair-seeds.png: per seed, the team's and the single agent's held-out return (left),
    and the team's train-time cooperation level per step (right: where a seed learns to delegate)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    names = list(SEEDS)
    for k, (name, files) in enumerate(SEEDS.items()):
        for off, (label, path, color) in enumerate((("team MAGRPO", files[0], "tab:blue"),
                                                     ("single GRPO", files[1], "tab:orange"))):
            left.bar(k + 0.4 * off, arm(path)["held_out"], 0.4, color=color, label=label if k == 0 else None)
        train = [r for r in load_metrics(os.path.join(HERE, files[0])) if r.get("kind") == "train"]
        right.plot([r["step"] for r in train], [r.get("level/cooperation", 0.0) for r in train], label=name.split(" (")[0])
    left.axhline(2.0, color="gray", ls="--", lw=1, label="target 2.0")
    left.set_xticks([k + 0.2 for k in range(len(names))], [n.split(" (")[0] for n in names])
    left.set_ylabel("held-out return (32 problems, greedy)")
    left.set_ylim(1.0, 2.4)
    left.legend(fontsize=8)
    right.set_xlabel("MAGRPO step (30 min, one core)")
    right.set_ylabel("team's train-time cooperation level")
    right.legend(fontsize=8)
    fig.suptitle("HumanEval, G=8 x 2: MAGRPO team vs GRPO single agent, per seed")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "issue22-pair-seeds.png"), dpi=100)


if __name__ == "__main__":
    main()
