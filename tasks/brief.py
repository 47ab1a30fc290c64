"""Brief: a team of three writes a brief of a text. Agent 1 "outline" lists the text's key points,
agent 2 "body" explains them in a paragraph, agent 3 "conclusion" closes with one or two
sentences. Scored with four gated levels (max 3.0) built from the writing tasks' metrics
(tasks/writing.py); a level that STOPs leaves every later level at 0. o / b / c = the outline,
body and conclusion texts. The paper has no three-agent writing task: the bands and caps are this
project's, chosen so that a plausible answer of each part within 128 new tokens scores
(tests/tasks/test_brief.py) and each level has room above and below it.

1. ``length`` (+0.5): whitespace tokens o 8..128, b 32..256, c 6..64, inclusive; else STOP.
2. ``length_ratio`` (up to 1.0): the body carries the detail. r_o = chars(b) / chars(o) scored
   by best 1.2..4.0, outer 0.8..8.0; r_c = chars(b) / chars(c) by best 2.0..8.0, outer
   1.2..16.0; each band is worth 0.5 (a `writing.Band`: linear to 0 at the outer edge); either
   ratio outside its outer band -> 0 and STOP.
3. ``unique_words`` (up to 0.5): distinct words(b) / distinct words(o), words = ``\\w+``
   lowercased: >= 1.3 -> 0.5, 0.9..1.3 linear from 0, < 0.9 -> STOP (the body must say more
   than the list it explains). No words in o -> STOP.
4. ``style`` (up to 1.0) = 0.4 x transition + 0.3 x min(J(o, b), 0.25) / 0.25 + 0.3 x
   min(J(b, c), 0.15) / 0.15. transition: `writing.transition_scale` of the transition-word
   categories found in b + c; J: Jaccard overlap of the word sets without stopwords. The two
   overlaps are the team's cooperation: the outline's points must reappear in the body and the
   conclusion must close what the body said (the conclusion is short, so its cap is lower).

Inputs: any pasted text (`from_text`) or the shipped TL;DR texts (tasks/data/writing.json, the
same fixed split; ids "brief/<name>").

Single agent (``num_agents=1``, `collab eval`'s "single"): one agent writes the three parts in
one answer, separated by lines ``[PARAGRAPH_SPLIT]``; a missing part is empty (and fails the
length level).
"""
from __future__ import annotations

import json
import math

from tasks.base import Example, Reward, Turn
from tasks.writing import (DATA, SPLIT_MARKER, Band, WritingTask, count_tokens, jaccard, transition_categories,
                           transition_scale, words)

LEVELS = ("length", "length_ratio", "unique_words", "style")
MAX_REWARD = 3.0
TOKEN_BOUNDS = {"outline": (8, 128), "body": (32, 256), "conclusion": (6, 64)}
BODY_OVER_OUTLINE = Band((1.2, 4.0), (0.8, 8.0), 0.5)
BODY_OVER_CONCLUSION = Band((2.0, 8.0), (1.2, 16.0), 0.5)
UNIQUE_BAND = Band((1.3, math.inf), (0.9, math.inf), 0.5)
OUTLINE_BODY_CAP, BODY_CONCLUSION_CAP = 0.25, 0.15


class BriefTask:
    name = team = "brief"
    kind = "writing"
    private = False
    max_reward = MAX_REWARD
    level_names = LEVELS
    parts_roles = ("outline", "body", "conclusion")
    single_role = "brief-writer"   # role names are adapter directories: unique across tasks
    instructions = ("List the key points of the text as an outline: three to five short lines, each "
                    "starting with '- '.",
                    "Write one paragraph of 50 to 90 words that explains the key points of the text, "
                    "with its specific details, in your own words.",
                    "Write a conclusion of the text in one or two sentences.")

    def __init__(self, num_agents: int = 3):
        if num_agents not in (1, 3):
            raise ValueError(f"num_agents must be 3 (outline, body, conclusion) or 1 (one writer), got {num_agents}")
        self.num_agents = num_agents
        self.roles = self.parts_roles if num_agents == 3 else (self.single_role,)

    @classmethod
    def from_text(cls, text: str, id: str | None = None) -> Example:
        """An example from any text a person pastes (the writing tasks' rule, ids "brief/pasted-<hash>")."""
        return WritingTask.from_text.__func__(cls, text, id)

    def examples(self, split: str) -> list[Example]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        with open(DATA, encoding="utf-8") as f:
            items = json.load(f)
        return [{"id": "brief/" + it["id"].split("/", 1)[1], "text": it["text"], "title": it["title"]}
                for it in items if it["task"] == "tldr" and it["split"] == split]

    def agent_prompts(self, example: Example, history: list[Turn], earlier: tuple[str, ...] = ()) -> list[str]:
        text = example["text"].strip()
        if self.num_agents == 1:
            asks = " ".join(f"Part {k + 1} ({r}): {i}" for k, (r, i) in enumerate(zip(self.parts_roles,
                                                                                   self.instructions)))
            prompts = [f"Text:\n{text}\n\nWrite three parts, each followed by a line with only "
                       f"{SPLIT_MARKER}. {asks} Write only the three parts."]
        else:
            prompts = [f"Text:\n{text}\n\n{i} Write only that." for i in self.instructions]
            for j in range(1, len(prompts)):   # sequential baseline: agent j sees the parts of agents < j
                prompts[j] += "".join(f"\n\nYour teammate already wrote the {self.parts_roles[k]}:\n{part.strip()}"
                                      for k, part in enumerate(earlier[:j]))
        if history:  # the last turn only: short contexts
            last = history[-1]
            prompts = [p + f"\n\nYour previous answer:\n{last.outputs[i].strip()}\n\nFeedback:\n"
                       f"{last.feedback[i].strip()}\n\nWrite an improved answer." for i, p in enumerate(prompts)]
        return prompts

    def parts(self, outputs: list[str]) -> tuple[str, str, str]:
        if len(outputs) != self.num_agents or not all(isinstance(o, str) for o in outputs):
            raise TypeError(f"{self.name} needs {self.num_agents} output strings, got {outputs!r:.200}")
        if self.num_agents == 1:
            split = [p.strip() for p in outputs[0].split(SPLIT_MARKER)] + ["", ""]
            return split[0], split[1], split[2]
        return outputs[0].strip(), outputs[1].strip(), outputs[2].strip()

    def combine(self, example: Example, outputs: list[str]) -> str:
        return "\n\n".join(self.parts(outputs))

    def reward(self, example: Example, outputs: list[str]) -> Reward:
        o, b, c = self.parts(outputs)
        levels = dict.fromkeys(LEVELS, 0.0)
        d: dict = {"tokens": tuple(count_tokens(t) for t in (o, b, c)), "stopped_at": None}

        def done(stop=None):
            d["stopped_at"] = stop
            return Reward(total=round(sum(levels.values()), 10), levels=levels, max_total=MAX_REWARD, details=d)

        if not all(lo <= n <= hi for n, (lo, hi) in zip(d["tokens"], TOKEN_BOUNDS.values())):
            return done("length")
        levels["length"] = 0.5
        d["ratios"] = (len(b) / len(o), len(b) / len(c))
        (s1, ok1), (s2, ok2) = BODY_OVER_OUTLINE.score(d["ratios"][0]), BODY_OVER_CONCLUSION.score(d["ratios"][1])
        levels["length_ratio"] = s1 + s2 if ok1 and ok2 else 0.0
        if not (ok1 and ok2):
            return done("length_ratio")
        uo = len(set(words(o)))
        if uo == 0:
            return done("unique_words")
        d["unique_ratio"] = len(set(words(b))) / uo
        levels["unique_words"], ok = UNIQUE_BAND.score(d["unique_ratio"])
        if not ok:
            return done("unique_words")
        cats = transition_categories(f"{b}\n{c}")
        d.update(transition_categories=cats, jaccard=(jaccard(o, b), jaccard(b, c)))
        levels["style"] = (0.4 * transition_scale(len(cats))
                           + 0.3 * min(d["jaccard"][0], OUTLINE_BODY_CAP) / OUTLINE_BODY_CAP
                           + 0.3 * min(d["jaccard"][1], BODY_CONCLUSION_CAP) / BODY_CONCLUSION_CAP)
        return done()

    def feedback(self, example: Example, outputs: list[str]) -> list[str]:
        r = self.reward(example, outputs)
        d = r.details
        lines = [f"Score {r.total:.2f} / {MAX_REWARD:.1f}.", "Length: " + ", ".join(
            f"{role} {n} words (needs {lo}-{hi})" for role, n, (lo, hi) in zip(self.parts_roles, d["tokens"],
                                                                                 TOKEN_BOUNDS.values()))
                 + (": ok." if r.levels["length"] else ": out of range, nothing else was scored.")]
        if "ratios" in d:
            lines.append(f"The body is {d['ratios'][0]:.1f}x the outline (best {BODY_OVER_OUTLINE.best[0]}-"
                         f"{BODY_OVER_OUTLINE.best[1]}) and {d['ratios'][1]:.1f}x the conclusion (best "
                         f"{BODY_OVER_CONCLUSION.best[0]}-{BODY_OVER_CONCLUSION.best[1]}), in characters.")
        if "unique_ratio" in d:
            lines.append(f"Distinct words body/outline: {d['unique_ratio']:.2f} (best >= {UNIQUE_BAND.best[0]}).")
        if "jaccard" in d:
            lines.append(f"Style: {len(d['transition_categories'])} kinds of transition words; word overlap "
                         f"outline-body {d['jaccard'][0]:.3f} (full from {OUTLINE_BODY_CAP}), body-conclusion "
                         f"{d['jaccard'][1]:.3f} (full from {BODY_CONCLUSION_CAP}).")
        common = "\n".join(lines)
        if self.num_agents == 1:
            return [common]
        return [f"{common}\nYou write the {role} ({n} words)." for role, n in zip(self.parts_roles, d["tokens"])]
