"""Every task's default config yields non-zero rewards (issue 11): for each task and team size,
a plausible answer that fits the smallest default `max_new_tokens` of the entry points
(trainer, `collab serve`, `collab eval`), counted with the embedded model's own tokenizer,
earns a reward > 0 -- and, for the writing tasks, passes the length gate (before the fix the
expansion task's 128-word minimum was out of reach at the trainer's 128 new tokens).

The answers are hand-written, the way a small instruct model answers these prompts (code in a
fence, plain prose paragraphs). The defaults are read from the config dataclasses, so
lowering one there re-checks every task here."""
from __future__ import annotations

import dataclasses

import pytest

from collab_app.commands.evaluate import EvalConfig
from collab_app.web.serve import ServeConfig
from tasks import load_task
from tasks.writing import SPLIT_MARKER, ExpansionTask
from trainer.config import MAGRPOConfig

# custom coding problems of this module's own must run here, whatever the sandbox level (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("people_code_runs_here")


def _default(cls, name: str) -> int:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


BUDGET = min(_default(c, "max_new_tokens") for c in (MAGRPOConfig, ServeConfig, EvalConfig))

ADD_PROMPT = 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n'
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(0, 0) == 0"

HE_AUX = "```python\ndef aux(a, b):\n    return abs(a - b)\n```"
HE_MAIN = """```python
def has_close_elements(numbers, threshold):
    for i in range(len(numbers)):
        for j in range(i + 1, len(numbers)):
            if aux(numbers[i], numbers[j]) < threshold:
                return True
    return False
```"""
ADD_AUX = "```python\ndef aux(a, b):\n    return a + b\n```"
ADD_MAIN = "```python\ndef add(a, b):\n    total = aux(a, 0)\n    return total + b\n```"

TLDR_SUMMARY = ("Lincoln honors the soldiers who died at Gettysburg and asks the living to finish "
                "their work so that democracy survives.")
TLDR_DETAIL = ("At the dedication of a cemetery on the Gettysburg battlefield, Lincoln recalls that "
               "the nation was founded on liberty and equality, and says that the civil war tests "
               "whether such a nation can endure. He argues that the soldiers who fought there have "
               "already consecrated the ground, so the living must instead commit themselves to the "
               "unfinished task, ensuring a new birth of freedom and that government of, by and for "
               "the people does not perish.")

EXP_BACKGROUND = ("Language models are increasingly asked to solve problems together, for instance "
                  "one model writing a helper function while another writes the main function. "
                  "However, such teams are usually built from models that were trained alone and "
                  "only prompted to cooperate, so nothing in their training rewards good teamwork. "
                  "This motivates training the agents jointly, so that each learns how its own "
                  "output fits with the outputs of its partners.")
EXP_METHOD = ("The method treats collaboration as cooperative multi-agent reinforcement learning. "
              "Every agent samples a group of answers to the same prompt, the joint outputs receive "
              "one shared reward, and group-relative advantages computed from these rewards update "
              "each agent's policy. As a result, the agents learn complementary roles. On coding "
              "and writing tasks, such teams produce better joint results than single models or "
              "teams that are only prompted, which suggests that shared rewards are a practical way "
              "to train cooperation.")
EXP_BACKGROUND_SHORT = ("Language models are often asked to work together, yet they are trained alone "
                        "and merely prompted to cooperate. Nothing in their training rewards good "
                        "teamwork, which motivates training the agents jointly so that each one "
                        "learns how its output fits with its partners.")
EXP_METHOD_SHORT = ("The method treats collaboration as cooperative reinforcement learning: each agent "
                    "samples several answers, the joint outputs share one reward, and group-relative "
                    "advantages update every policy. Consequently, teams trained this way beat single "
                    "models and prompted teams on coding and writing tasks.")


def _answers(name: str, num_agents: int) -> list[str]:
    two = {"humaneval": [HE_AUX, HE_MAIN], "custom-coding": [ADD_AUX, ADD_MAIN],
           "tldr": [TLDR_SUMMARY, TLDR_DETAIL], "expansion": [EXP_BACKGROUND, EXP_METHOD]}[name]
    if num_agents == 2:
        return two
    if name in ("humaneval", "custom-coding"):
        code = [b.removeprefix("```python\n").removesuffix("\n```") for b in two]
        return [f"Here is the solution:\n```python\n{code[0]}\n\n{code[1]}\n```"]
    if name == "expansion":
        two = [EXP_BACKGROUND_SHORT, EXP_METHOD_SHORT]
    return [f"{two[0]}\n{SPLIT_MARKER}\n{two[1]}"]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1  # + the end-of-turn token


CASES = [(n, k) for n in ("humaneval", "custom-coding", "tldr", "expansion") for k in (2, 1)]


@pytest.mark.parametrize("name,num_agents", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_a_plausible_answer_within_the_default_budget_earns_a_reward(tokenizer, name, num_agents):
    kw = {"prompt": ADD_PROMPT, "tests": ADD_TESTS} if name == "custom-coding" else {}
    task = load_task(name, num_agents=num_agents, **kw)
    ex = task.examples("eval")[0]
    outputs = _answers(name, num_agents)
    for text in outputs:  # each agent's answer is one generation of at most BUDGET tokens
        assert _tokens(tokenizer, text) <= BUDGET, (name, num_agents, _tokens(tokenizer, text), BUDGET)
    r = task.reward(ex, outputs)
    assert r.total > 0, (name, num_agents, r.levels, r.details)
    if name in ("tldr", "expansion"):
        assert r.levels["length"] == 0.5 and r.levels["length_ratio"] > 0, r.details
    else:
        assert r.levels["tests"] == 1.0, r.details


@pytest.mark.parametrize("num_agents", [2, 1])
def test_expansion_prompt_asks_for_a_length_that_fits(tokenizer, num_agents):
    """The words each part is asked for, at the tokens per word of the answers above, fit the
    default budget (one agent: both parts and the marker in one answer) and clear the minimum."""
    lo, hi = ExpansionTask.target_words[num_agents]
    text = " ".join([EXP_BACKGROUND, EXP_METHOD, EXP_BACKGROUND_SHORT, EXP_METHOD_SHORT])
    per_word = (_tokens(tokenizer, text) - 1) / len(text.split())
    parts = 1 if num_agents == 2 else 2
    assert parts * hi * per_word + _tokens(tokenizer, f"\n{SPLIT_MARKER}\n") <= BUDGET
    assert lo >= ExpansionTask.token_bounds[0]
    prompts = load_task("expansion", num_agents=num_agents).agent_prompts(
        load_task("expansion").examples("eval")[0], [])
    assert all(f"{lo} to {hi} words" in p for p in prompts)
