"""Re-derive the headline figures of the issue-13 section (archive/2026-11.md, the dated record of
November 2026) from the raw files beside this script, so that the text and the data cannot drift
apart unnoticed.

    .venv/bin/python docs/results/derive.py      # figure, what the record says, what the files say

Each check is a phrase of the record with `{}` where a figure stands, and the figures the files
give for it; the phrase is looked up in its section (whitespace folded, − read as -) and every
figure compared as printed text. Exit status 1 when any figure differs or a phrase is not found:
fix the text (or, if the text was right, the derivation) until it exits 0.

Paired differences use `collab eval --compare`'s own `paired_difference` (same bootstrap seed),
training minutes the plot's `eval_minutes` (rollout + reward + update + save time).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from collab_app.commands.evaluate import paired_difference  # noqa: E402
from collab_app.web.plots import eval_minutes, load_metrics  # noqa: E402

RECORD = os.path.join(HERE, "archive", "2026-11.md")   # the dated record that holds the sections below
ISSUE13 = "### Issue 13:"
CPU_RUN = "### On this CPU (2 cores, no GPU)"
CPU_VLLM_RUN = "### On this CPU with the vLLM engine"


def f3(x: float) -> str:
    return f"{x:.3f}"


def s3(x: float) -> str:
    return f"{x:+.3f}"


def f1(x: float) -> str:
    return f"{x:.1f}"


def pct(x: float) -> str:
    """0.135 -> "13.5", 0.15 -> "15" (as the text writes percentages)."""
    return f"{100 * x:.1f}".removesuffix(".0")


def load(name: str):
    path = os.path.join(HERE, name)
    return load_metrics(path) if name.endswith(".jsonl") else json.load(open(path))


class Run:
    """One `collab train` run's metrics.jsonl: eval records by step, train records, minutes."""

    def __init__(self, name: str):
        self.records = load(name)
        self.train = [r for r in self.records if r["kind"] == "train"]
        self.evals = {r["step"]: r for r in self.records if r["kind"] == "eval"}
        evals = [r for r in self.records if r["kind"] == "eval"]
        self.minutes = {r["step"]: m for r, (m, _) in zip(evals, eval_minutes(self.records))}

    def row(self, step: int, minutes: str | None = None) -> list[str]:
        """minutes, return, pass@1, structure, syntax, tests, cooperation at the eval of `step`."""
        e = self.evals[step]
        m = minutes if minutes is not None else ("0" if step == 0 else f1(self.minutes[step]))
        return [m, f3(e["return_mean"]), f3(e["pass@1"])] + [
            f3(e[f"level/{k}"]) for k in ("structure", "syntax", "tests", "cooperation")]

    def ten_step_means(self, key: str) -> tuple[float, float]:
        v = [r[key] for r in self.train]
        return statistics.mean(v[:10]), statistics.mean(v[-10:])


def paired(a: dict, b: dict, counts: str = "bew") -> list[str]:
    """B - A, its 95% CI, and the better/equal/worse counts in the order `counts` names them."""
    c = paired_difference(a, b)
    n = {"b": c["b_better"], "e": c["equal"], "w": c["b_worse"]}
    return [s3(c["mean_diff"]), s3(c["ci95"][0]), s3(c["ci95"][1])] + [str(n[k]) for k in counts]


def checks() -> list[tuple[str, str, list[str]]]:
    """(section heading, phrase with {} per figure, the figures derived from the files)."""
    ours, base = Run("humaneval-issue13-ours-metrics.jsonl"), Run("humaneval-issue13-baseline-metrics.jsonl")
    table = load("humaneval-issue13-eval-table.json")["systems"]
    two_turn = load("humaneval-issue13-eval-2turn.json")["systems"]
    comlrl = load("humaneval-issue13-comlrl.json")
    variants = load("humaneval-issue13-prompts-train.json")
    ret = lambda run, step: run.evals[step]["returns"]   # noqa: E731
    last = max(ours.evals)
    # the last row is where --max-minutes stopped the run: it shows train_seconds, the clock that
    # the stop reads (the other rows show the plot's minutes)
    stop_min = f1(ours.train[-1]["train_seconds"] / 60)
    out = []
    cols = " | ".join(["{}"] * 7)
    for step in (0, 30, 50, 60):
        out.append((ISSUE13, f"| baseline, step {step} | {cols} |", base.row(step)))
    out.append((ISSUE13, f"| **ours**, step 0 (new prompts, untrained) | {cols} |", ours.row(0)))
    for step in (20, 30, 40):
        out.append((ISSUE13, f"| ours, step {step} | {cols} |", ours.row(step)))
    r = ours.row(last, stop_min)
    out.append((ISSUE13, f"| **ours, step {last} ({{}} min)** | {{}} | **{{}}** | {' | '.join(['{}'] * 5)} |",
                [stop_min] + r))

    # paired table
    out.append((ISSUE13, f"| baseline step 60 ({{}} min) → ours step {last} ({{}} min) | **{{}}** | {{}} .. {{}} | {{}} / {{}} / {{}} |",
                [f"{base.minutes[60]:.0f}", f"{float(stop_min):.0f}"] + paired(ret(base, 60), ret(ours, last))))
    out.append((ISSUE13, "| baseline step 50 ({} min) → ours step 30 ({} min) | {} | {} .. {} | {} / {} / {} |",
                [f1(base.minutes[50]), f1(ours.minutes[30])] + paired(ret(base, 50), ret(ours, 30))))
    out.append((ISSUE13, f"| ours untrained → ours step {last} (what 30 min of training added) | {{}} | {{}} .. {{}} | {{}} / {{}} / {{}} |",
                paired(ret(ours, 0), ret(ours, last))))
    out.append((ISSUE13, "| baseline untrained → baseline step 60 | {} | {} .. {} | {} / {} / {} |",
                paired(ret(base, 0), ret(base, 60))))
    out.append((ISSUE13, "| old prompts → new prompts, both untrained | {} | {} .. {} | {} / {} / {} |",
                paired(ret(base, 0), ret(ours, 0))))

    # targets
    team = table["team"]
    coop = team["cooperation_answers"]
    out.append((ISSUE13, "Held-out return ≥ 2.0 after 30 minutes: **not met** ({}).", [f3(ours.evals[last]["return_mean"])]))
    out.append((ISSUE13, "cooperation > 0.2: **not met** ({} = {} of {} answers × 0.5;",
                [f3(ours.evals[last]["level/cooperation"]), str(coop["rewarded"]), str(team["examples"])]))
    out.append((ISSUE13, "The curve is still rising ({} → {} → {} over",
                [f3(ours.evals[s]["return_mean"]) for s in (30, 40, last)]))
    fired = [r["level/cooperation"] for r in ours.train]
    out.append((ISSUE13, "fires on {} of {} training steps (at most {} of a batch)",
                [str(sum(c > 0 for c in fired)), str(len(fired)), f"{max(fired):.2f}"]))

    # role prompts: the untrained team on 33 train problems, three prompt variants
    v = {k: variants[k]["returns"] for k in ("v0", "v1", "v2")}
    out.append((ISSUE13, "old {}, a prose contract {} ({}, CI {} .. {}), the code contract **{}** ({}, CI {} .. {})",
                [f3(variants["v0"]["mean_return"]), f3(variants["v1"]["mean_return"]), *paired(v["v0"], v["v1"], ""),
                 f3(variants["v2"]["mean_return"]), *paired(v["v0"], v["v2"], "")]))
    out.append((ISSUE13, "On the held-out 32 it gives {} before training", paired(ret(base, 0), ret(ours, 0), "")[:1]))
    out.append((ISSUE13, "the trained team gains more from it ({} vs {})",
                [paired(ret(ours, 0), ret(ours, last), "")[0], paired(ret(base, 0), ret(base, 60), "")[0]]))

    # dynamic sampling
    flat = [r["dynamic/flat_prompts"] for r in ours.train]
    extra = sum(r["dynamic/extra_prompts"] for r in ours.train)
    first_rollout = len(ours.train) * load("humaneval-issue13-ours-config.json")["prompts_per_step"]
    med = lambda run, k: f1(statistics.median(r[k] for r in run.train))   # noqa: E731
    out.append((ISSUE13, "a prompt with no signal in {} of {} steps' batches (zero-variance groups {}% on average, "
                         "{}% in the baseline); each was replaced by a fresh prompt ({} extra prompts, +{}% rollout "
                         "work: median rollout {} s vs {} s, update {} s vs {} s)",
                [str(sum(f > 0 for f in flat)), str(len(flat)),
                 pct(statistics.mean(r["zero_variance_frac"] for r in ours.train)),
                 pct(statistics.mean(r["zero_variance_frac"] for r in base.train)),
                 str(extra), pct(extra / first_rollout),
                 med(ours, "time/rollout_s"), med(base, "time/rollout_s"),
                 med(ours, "time/update_s"), med(base, "time/update_s")]))

    # two turns with the tests' feedback, at inference
    def turns(one, two):
        d = paired(one["returns"], two["returns"], "wb")
        return [f3(one["mean_return"]), f3(two["mean_return"]), *d]
    out.append((ISSUE13, "untrained ({} → {}, paired {}, CI {} .. {}; {} worse, {} better) and trained "
                         "({} → {}, {}, CI {} .. {}; {} worse, {} better)",
                turns(table["naive"], two_turn["naive"]) + turns(team, two_turn["team"])))

    # comlrl at ~20 minutes against ours at step 30
    before, after, tr = comlrl["systems"]["before"], comlrl["systems"]["after"], comlrl["train"]
    g_comlrl = paired(before["returns"], after["returns"], "")
    g_ours = paired(ret(ours, 0), ret(ours, 30), "")
    # gain per minute = the row's gain / its minutes, as printed (as a reader checks the row)
    per_min_comlrl = float(g_comlrl[0]) / float(f1(tr["minutes"]))
    per_min_ours = float(g_ours[0]) / float(f1(ours.minutes[30]))
    out.append((ISSUE13, "| comlrl {} | {} | {} ({} s each: {} s rollout, {} s update) | {} → {} | {} ({} .. {}) | {} |",
                [comlrl["comlrl_version"], f1(tr["minutes"]), str(tr["updates"]), f"{tr['seconds_per_update']:.0f}",
                 f"{tr['rollout_seconds'] / tr['updates']:.0f}", f"{tr['update_seconds'] / tr['updates']:.0f}",
                 f3(before["mean_return"]), f3(after["mean_return"]), *g_comlrl, f"{per_min_comlrl:.4f}"]))
    n30 = sum(1 for r in ours.train if r["step"] <= 30)
    out.append((ISSUE13, "| collab train (ours, eval at step 30) | {} | {} (~{} s each) | {} → {} | {} ({} .. {}) | {} |",
                [f1(ours.minutes[30]), str(n30), f"{ours.minutes[30] * 60 / n30:.0f}",
                 f3(ours.evals[0]["return_mean"]), f3(ours.evals[30]["return_mean"]), *g_ours, f"{per_min_ours:.4f}"]))
    gain = lambda a, b: {k: b[k] - a[k] for k in a}   # noqa: E731
    out.append((ISSUE13, "Ours gains more per minute ({}x), but the difference of the two gains, paired per problem, "
                         "is {} with a CI of {} .. {}:",
                [f1(per_min_ours / per_min_comlrl),
                 *paired(gain(before["returns"], after["returns"]), gain(ret(ours, 0), ret(ours, 30)), "")]))
    out.append((ISSUE13, "our team's return is {} higher (CI {} .. {};",
                [p.lstrip("+") if i == 0 else p for i, p in enumerate(paired(after["returns"], ret(ours, 30), ""))]))
    agree = paired(before["returns"], ret(ours, 0), "e")
    out.append((ISSUE13, "that evaluator and ours agree on {} of {} problems ({} vs {})",
                [agree[3], str(len(before["returns"])), f3(before["mean_return"]), f3(ours.evals[0]["return_mean"])]))
    out.append((ISSUE13, "comlrl learned structure as fast per update ({} after {} updates) but not the tests "
                         "level ({} → {}); cooperation {} → {}.",
                [f3(after["levels"]["structure"]), str(tr["updates"]), f3(before["levels"]["tests"]),
                 f3(after["levels"]["tests"]), f3(before["levels"]["cooperation"]),
                 "0" if after["levels"]["cooperation"] == 0 else f3(after["levels"]["cooperation"])]))

    # the `collab eval` table after the 30-minute run
    words = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight"]
    out.append((ISSUE13, "`cooperation_answers` says {} of {} team answers cooperate, all {} as thin wrappers",
                [str(coop["rewarded"]), str(team["examples"]), words[coop["thin_wrapper"]]]))

    def system_row(s):
        x = table[s]
        return [f3(x["pass@1"]), f3(x["mean_return"])] + [
            f3(x["levels"][k]) for k in ("structure", "syntax", "tests", "cooperation")]
    naive = table["naive"]["returns"]
    out.append((ISSUE13, "| team (trained 30 min) | {} | **{}** | {} | {} | {} | {} | **{} ({} .. {})** |",
                system_row("team") + paired(naive, team["returns"], "")))
    out.append((ISSUE13, "| naive (untrained, same prompts) | {} | {} | {} | {} | {} | {} | |", system_row("naive")))
    out.append((ISSUE13, "| sequential (main sees the helper's code) | {} | {} | {} | {} | {} | {} | {} ({} .. {}) |",
                system_row("sequential") + paired(naive, table["sequential"]["returns"], "")))
    out.append((ISSUE13, "| single agent (writes aux and main) | {} | {} | {} | {} | {} | {} | {} ({} .. {}) |",
                system_row("single") + paired(naive, table["single"]["returns"], "")))

    # the train-batch figures of the two earlier CPU runs (10-step means of the first and last ten steps)
    for heading, name in ((CPU_RUN, "humaneval-cpu-metrics.jsonl"), (CPU_VLLM_RUN, "humaneval-cpu-vllm-metrics.jsonl")):
        run = Run(name)
        r0, r1 = run.ten_step_means("return_mean")
        z0, z1 = run.ten_step_means("zero_variance_frac")
        out.append((heading, "Train-batch return (10-step means) {} -> {}; zero-variance groups {}% -> {}%",
                    [f"{r0:.2f}", f"{r1:.2f}", pct(z0), pct(z1)]))
    return out


def fold(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("−", "-"))


def section(readme: str, heading: str) -> str:
    start = readme.index(heading)
    end = readme.find("\n## ", start)
    nxt = readme.find("\n### ", start + len(heading))
    ends = [e for e in (end, nxt) if e != -1]
    return readme[start:min(ends) if ends else len(readme)]


def compare(readme: str) -> list[tuple[str, list[str] | None, list[str]]]:
    """(phrase, figures the record gives (None: phrase not found), figures derived) per check."""
    rows = []
    for heading, phrase, derived in checks():
        text = fold(section(readme, heading))
        parts = fold(phrase).split("{}")
        assert len(parts) == len(derived) + 1, (phrase, derived)
        pattern = r"([^\s|]+?)".join(re.escape(p) for p in parts)
        m = re.search(pattern, text)
        rows.append((phrase, list(m.groups()) if m else None, [fold(d) for d in derived]))
    return rows


def main() -> int:
    with open(RECORD) as f:
        readme = f.read()
    rows = compare(readme)
    bad = 0
    for phrase, said, derived in rows:
        ok = said == derived
        bad += not ok
        label = re.sub(r"\s+", " ", phrase.replace("{}", "_"))[:70]
        print(f"{'ok ' if ok else 'BAD'} {label}")
        print(f"      record: {', '.join(said) if said is not None else '(phrase not found)'}")
        if not ok:
            print(f"      files:  {', '.join(derived)}")
    print(f"{bad} of {len(rows)} figures differ from the files" if bad else "every figure matches the files")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
