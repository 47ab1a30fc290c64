"""Issue 22 item 4: does a main prompt that asks main to BUILD ON aux's result raise cooperation
(answers where aux's result reaches the return, decided at run time: tasks/coding.py), and what
does it cost in return? Measured with the untrained team (a prompt is the cheapest change to
try before paying for training), paired per problem against the default prompt (v2).

    .venv/bin/python docs/results/archive/issue22_coop_prompts.py train v2,c1,c2   # choose on train data
    .venv/bin/python docs/results/archive/issue22_coop_prompts.py eval v2,c1,c2    # then held-out

v2 = the default (tasks/coding.py: aux returns the answer; main is given `result = aux(...)` to
complete). c1 = the same, and main is told that aux may be wrong on some inputs: check `result`,
correct it where needed, return it, do not solve the problem again. c2 = the helper solves a
sub-step named by its signature only (aux returns "the main part of the answer"), main turns
`result` into the answer. Greedy, 128 new tokens, one joint answer per problem, the engine
`collab serve` would use; `train` = every 4th problem of the train split (33). Writes
issue22-coop-prompts-<split>.json (summaries, per-problem returns and cooperation levels, and the
paired differences B - v2 with 95% bootstrap CIs). A research script: it swaps
CodingTask.agent_prompts in place; the variants are not a feature.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

from collab_app.commands.evaluate import paired_difference  # noqa: E402
from issue13_prompt_variants import measure  # noqa: E402 - this folder is on sys.path when run as a script
from tasks.coding import AUX, CodingTask, _signature  # noqa: E402

current = CodingTask.agent_prompts   # v2


def _two(example, helper, main):
    head = f"Problem:\n```python\n{example['prompt'].strip()}\n```\n"
    return [head + helper, head + main]


def c1(self, example, history, earlier=()):
    entry, (sig, call) = example["entry_point"], _signature(example)
    helper = (f"Write a helper function with this exact signature, which returns the answer to the problem:\n"
              f"```python\ndef {AUX}{sig}:\n```\nAnswer with the complete function `{AUX}` in one Python code "
              f"block, nothing else.")
    main = (f"Write the function `{entry}`. A teammate's helper `{AUX}{sig}` already exists and returns an answer "
            f"that is right on most inputs but may be wrong on some (edge cases, empty inputs, the exact type "
            f"asked for). Complete this code: check `result`, correct it where it is wrong, and return it. Do not "
            f"solve the whole problem again.\n```python\ndef {entry}{sig}:\n    result = {AUX}({call})\n```\n"
            f"Answer with the complete function `{entry}` in one Python code block, nothing else. Do not define "
            f"`{AUX}`.")
    return _two(example, helper, main)


def c2(self, example, history, earlier=()):
    entry, (sig, call) = example["entry_point"], _signature(example)
    helper = (f"Write a helper function with this exact signature that computes the main part of the answer "
              f"(the hardest step), which the teammate's `{entry}` then turns into the final answer:\n"
              f"```python\ndef {AUX}{sig}:\n```\nAnswer with the complete function `{AUX}` in one Python code "
              f"block, nothing else.")
    main = (f"Write the function `{entry}`. A helper `{AUX}{sig}` already exists and computes the main part of "
            f"the answer. Complete this code: turn `result` into the exact value `{entry}` must return.\n"
            f"```python\ndef {entry}{sig}:\n    result = {AUX}({call})\n```\nAnswer with the complete function "
            f"`{entry}` in one Python code block, nothing else. Do not define `{AUX}`.")
    return _two(example, helper, main)


VARIANTS = {"v2": current, "c1": c1, "c2": c2}

if __name__ == "__main__":
    split, names = sys.argv[1], sys.argv[2].split(",")
    out = {}
    for name, (s, rewards, examples) in measure(split, VARIANTS, names).items():
        s["cooperation_levels"] = {str(ex["id"]): r.levels["cooperation"] for ex, r in zip(examples, rewards)}
        out[name] = s
    if "v2" in out:
        for name in out:
            if name != "v2":
                out[name]["vs_v2"] = {
                    "return": paired_difference(out["v2"]["returns"], out[name]["returns"]),
                    "cooperation": paired_difference(out["v2"]["cooperation_levels"], out[name]["cooperation_levels"])}
                print(name, "- v2:", json.dumps({k: {x: v[x] for x in ("mean_diff", "ci95", "b_better", "b_worse")}
                                                 for k, v in out[name]["vs_v2"].items()}), flush=True)
    with open(f"issue22-coop-prompts-{split}.json", "w") as f:
        json.dump(out, f, indent=1)
