"""Issue 13: the helper/main role prompts, measured with the untrained team before any training.

    .venv/bin/python docs/results/archive/issue13_prompt_variants.py train v0,v1,v2   # choose on train data
    .venv/bin/python docs/results/archive/issue13_prompt_variants.py eval v0,v2       # then look at held-out

v0 = the earlier prompts ("a useful sub-step"; aux's signature left to the helper), v1 = the
contract in prose (aux takes the entry function's arguments and returns the answer), v2 = the
same contract as code (what tasks/coding.py now uses). Greedy, 128 new tokens, one joint answer
per problem, the engine `collab train` uses; `train` = every 4th problem of the train split (33).
Prints each variant's summary (as `collab eval`) and writes the per-problem returns to
issue13-prompts-<split>.json, which `collab eval --compare` reads (pick a variant with jq).
A research script: it swaps CodingTask.agent_prompts in place; the variants are not a feature.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

from tqdm import tqdm  # noqa: E402

from collab_app.commands.evaluate import EvalConfig, run_system, summarize  # noqa: E402
from collab_app.engines import make_engine  # noqa: E402
from collab_app.engines.engine_types import Sampling  # noqa: E402
from collab_app.engines.model import ensure_model  # noqa: E402
from tasks import load_task  # noqa: E402
from tasks.coding import AUX, CodingTask, _signature  # noqa: E402

current = CodingTask.agent_prompts   # v2


def _with_history(prompts, history):
    if history:
        last = history[-1]
        prompts = [p + f"\n\nYour previous answer:\n{last.outputs[i].strip()}\n\nFeedback:\n"
                   f"{last.feedback[i].strip()}\n\nWrite an improved answer." for i, p in enumerate(prompts)]
    return prompts


def v0(self, example, history, earlier=()):
    entry, head = example["entry_point"], f"Problem:\n```python\n{example['prompt'].strip()}\n```\n"
    roles = [f"You are the helper in a team of two. Write ONE helper function named `{AUX}` that "
             f"does a useful sub-step of this problem. Your teammate writes `{entry}` and calls "
             f"`{AUX}`. Do not write `{entry}`. Answer with one Python code block.",
             f"You are the main programmer in a team of two. Write the function `{entry}` with the "
             f"exact signature above. A teammate writes a helper `{AUX}(...)` that is already "
             f"defined for you: call it and use its result, but do not define `{AUX}` yourself. "
             "Answer with one Python code block."]
    return _with_history([head + r for r in roles], history)


def v1(self, example, history, earlier=()):
    entry, head = example["entry_point"], f"Problem:\n```python\n{example['prompt'].strip()}\n```\n"
    sig, call = _signature(example)
    roles = [f"You write the helper function for this problem. Write `def {AUX}{sig}:` -- it takes the same "
             f"arguments as `{entry}` and returns the answer to the problem. Write only `{AUX}`, in one Python "
             f"code block.",
             f"You write `def {entry}{sig}:`. A teammate already wrote `{AUX}{sig}`, which takes the same "
             f"arguments and returns the answer. Call `{AUX}({call})`, use its result to build the value "
             f"`{entry}` returns, and return it. Do not define `{AUX}`. Write only `{entry}`, in one Python "
             f"code block."]
    return _with_history([head + r for r in roles], history)


VARIANTS = {"v0": v0, "v1": v1, "v2": current}


def measure(split: str, variants: dict, names: list[str]) -> dict:
    """Each named variant's greedy team answers on `split` (every 4th train problem, or all of
    another split): {name: (summary as `collab eval`, rewards, examples)}; prints each summary.
    Also used by issue22_coop_prompts.py."""
    task = load_task("humaneval")
    examples = task.examples(split)[::4] if split == "train" else task.examples(split)
    engine = make_engine("auto", model=ensure_model(None), num_agents=2)
    for role in task.roles:
        engine.register_agent(role)
    out = {}
    try:
        for name in names:
            CodingTask.agent_prompts = variants[name]
            task._cache.clear()
            t0 = time.time()
            with tqdm(total=len(examples), disable=True) as progress:
                rewards = run_system("team", task, examples, engine, list(task.roles),
                                     EvalConfig(systems=["team"], max_new_tokens=128),
                                     Sampling(max_new_tokens=128, temperature=0.0, seed=0), progress)
            s = summarize(task, rewards, examples)
            s["seconds"] = round(time.time() - t0, 1)
            out[name] = (s, rewards, examples)
            print(name, split, json.dumps({k: v for k, v in s.items() if k != "returns"}), flush=True)
    finally:
        CodingTask.agent_prompts = current
        engine.close()
    return out


if __name__ == "__main__":
    split, names = sys.argv[1], sys.argv[2].split(",")
    out = {name: s for name, (s, _, _) in measure(split, VARIANTS, names).items()}
    with open(f"issue13-prompts-{split}.json", "w") as f:
        json.dump(out, f, indent=1)
