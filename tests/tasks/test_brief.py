"""The three-agent brief task (tasks/brief.py): each gated level against hand-computed values, the
single agent's parity with the team, the prompts and feedback per role, and a plausible answer
of every part within the smallest default max_new_tokens (counted with the embedded model's
tokenizer) earning nearly full marks."""
from __future__ import annotations

import dataclasses

import pytest

from tasks import load_task
from tasks.brief import BODY_CONCLUSION_CAP, OUTLINE_BODY_CAP, BriefTask
from tasks.writing import SPLIT_MARKER, transition_categories, transition_scale

EX = {"id": "brief/x", "text": "Some text."}

OUTLINE = ("- Lincoln honors the soldiers who died at Gettysburg\n- The nation was founded on liberty and "
           "equality\n- The living must finish the soldiers' unfinished work")
BODY = ("Lincoln recalls that the nation was founded on liberty and the equality of all people, and says that "
        "the civil war tests whether such a nation can endure. However, he argues that the soldiers who died at "
        "Gettysburg have already consecrated the ground far beyond any words. Therefore the living must commit "
        "themselves to their unfinished work, so that freedom is reborn and government of the people survives.")
CONCLUSION = ("In the end, Lincoln asks the living to finish the soldiers' work so that the nation and its "
              "freedom endure.")


def make(n_tokens: int, n_chars: int, prefix: str) -> str:
    """n_tokens distinct words, exactly n_chars characters (the last word is padded)."""
    s = " ".join(f"{prefix}{i}" for i in range(n_tokens))
    assert len(s) <= n_chars, (len(s), n_chars)
    return s + "z" * (n_chars - len(s))


def test_a_good_brief_earns_every_level():
    r = BriefTask().reward(EX, [OUTLINE, BODY, CONCLUSION])
    d = r.details
    assert r.levels["length"] == 0.5 and r.levels["length_ratio"] == 1.0 and r.levels["unique_words"] == 0.5
    assert d["jaccard"][0] >= OUTLINE_BODY_CAP and d["jaccard"][1] >= BODY_CONCLUSION_CAP   # both overlaps full
    cats = transition_categories(f"{BODY}\n{CONCLUSION}")
    assert r.levels["style"] == pytest.approx(0.4 * transition_scale(len(cats)) + 0.6)
    assert r.total == pytest.approx(2.0 + r.levels["style"]) and d["stopped_at"] is None


@pytest.mark.parametrize("part, tokens", [(0, 7), (1, 31), (2, 5), (2, 65), (0, 129)])
def test_each_part_out_of_its_length_stops_everything(part, tokens):
    outs = [make(10, 200, "a"), make(40, 600, "b"), make(10, 100, "c")]
    outs[part] = make(tokens, 2000, "q")
    r = BriefTask().reward(EX, outs)
    assert r.total == 0.0 and r.details["stopped_at"] == "length"


@pytest.mark.parametrize("body_chars, conclusion_chars, want", [
    (600, 100, 1.0),              # body/outline 3.0, body/conclusion 6.0: both best
    (200, 100, 0.25 + 0.5),       # 1.0 is 0.2 into 0.8..1.2 -> 0.5 x 0.5; 2.0 best
    (600, 500, 0.5 + 0.0),        # body/conclusion 1.2: the outer edge, passes at 0
    (150, 100, None),             # body/outline 0.75 < 0.8: STOP
    (1700, 100, None),            # body/conclusion 17 > 16: STOP
])
def test_length_ratio_bands(body_chars, conclusion_chars, want):
    outs = [make(10, 200, "a"), make(40, body_chars, "b"), make(10, conclusion_chars, "c")]
    r = BriefTask().reward(EX, outs)
    assert r.levels["length"] == 0.5
    if want is None:
        assert r.details["stopped_at"] == "length_ratio" and r.total == 0.5
    else:
        # distinct words 40 / 10 -> 0.5; no shared word, no transition word -> style 0
        assert r.levels["length_ratio"] == pytest.approx(want) and r.total == pytest.approx(0.5 + want + 0.5)


@pytest.mark.parametrize("distinct, want", [(10, None), (22, 0.25), (30, 0.5)])
def test_unique_words_body_over_outline(distinct, want):
    outline = make(20, 200, "a")                                          # 20 distinct words
    body = " ".join(f"b{i % distinct}" for i in range(90))               # `distinct` words, ~300 characters
    r = BriefTask().reward(EX, [outline, body, make(10, 100, "c")])
    assert r.levels["length_ratio"] == 1.0
    if want is None:   # 10 / 20 = 0.5 < 0.9
        assert r.details["stopped_at"] == "unique_words" and r.levels["unique_words"] == 0.0
    else:              # 22 / 20 = 1.1: 0.2 into 0.9..1.3 -> 0.5 x 0.5
        assert r.levels["unique_words"] == pytest.approx(want)


def test_style_counts_each_overlap_up_to_its_cap():
    outline = " ".join(f"x{i}" for i in range(10))
    body = " ".join([f"x{i}" for i in range(5)] + [f"b{i}" for i in range(27)])   # 5 shared of 37 distinct
    conclusion = " ".join(f"c{i}" for i in range(6))
    r = BriefTask().reward(EX, [outline, body, conclusion])
    assert r.details["stopped_at"] is None and r.details["transition_categories"] == []
    assert r.details["jaccard"] == (pytest.approx(5 / 37), 0.0)
    assert r.levels["style"] == pytest.approx(0.3 * (5 / 37) / OUTLINE_BODY_CAP)
    echo = " ".join(f"b{i}" for i in range(6))                                      # 6 of the body's 27: J = 6/32
    r2 = BriefTask().reward(EX, [outline, body, echo])
    assert r2.details["jaccard"][1] == pytest.approx(6 / 32) and 6 / 32 > BODY_CONCLUSION_CAP
    assert r2.levels["style"] == pytest.approx(r.levels["style"] + 0.3)


def test_single_agent_writes_three_parts_for_the_same_reward():
    team, one = BriefTask(), BriefTask(num_agents=1)
    assert team.roles == ("outline", "body", "conclusion") and one.roles == ("brief-writer",)
    joined = f"{OUTLINE}\n{SPLIT_MARKER}\n{BODY}\n{SPLIT_MARKER}\n{CONCLUSION}"
    assert one.reward(EX, [joined]) == team.reward(EX, [OUTLINE, BODY, CONCLUSION])
    assert one.reward(EX, [OUTLINE]).details["stopped_at"] == "length"   # parts 2 and 3 missing
    with pytest.raises(ValueError, match="num_agents must be 3"):
        BriefTask(num_agents=2)
    with pytest.raises(TypeError):
        team.reward(EX, [OUTLINE, BODY])


def test_prompts_and_feedback_per_role():
    task = load_task("brief")
    ex = task.examples("eval")[0]
    assert ex["id"].startswith("brief/") and {e["id"] for e in task.examples("train")}.isdisjoint(
        e["id"] for e in task.examples("eval"))
    prompts = task.agent_prompts(ex, [])
    assert [("outline" in p, "paragraph" in p, "conclusion" in p) for p in prompts] == [
        (True, False, False), (False, True, False), (False, False, True)]
    seq = task.agent_prompts(ex, [], earlier=("<o-part>", "<b-part>"))   # sequential: agent j sees agents < j
    assert [("<o-part>" in p, "<b-part>" in p) for p in seq] == [(False, False), (True, False), (True, True)]
    fb = task.feedback(ex, [OUTLINE, BODY, CONCLUSION])
    assert [f.splitlines()[-1].split()[3] for f in fb] == ["outline", "body", "conclusion"]
    assert task.combine(ex, [OUTLINE, BODY, CONCLUSION]) == f"{OUTLINE}\n\n{BODY}\n\n{CONCLUSION}"
    assert BriefTask.from_text("  A pasted text.  ")["id"].startswith("brief/pasted-")


def test_a_plausible_brief_fits_the_default_budget(model_path):
    from transformers import AutoTokenizer

    from collab_app.commands.evaluate import EvalConfig
    from collab_app.web.serve import ServeConfig
    from trainer.config import MAGRPOConfig

    budget = min(next(f.default for f in dataclasses.fields(c) if f.name == "max_new_tokens")
                 for c in (MAGRPOConfig, ServeConfig, EvalConfig))
    tok = AutoTokenizer.from_pretrained(model_path)
    for text in (OUTLINE, BODY, CONCLUSION):   # + 1: the end-of-turn token
        assert len(tok(text, add_special_tokens=False)["input_ids"]) + 1 <= budget
    assert BriefTask().reward(load_task("brief").examples("eval")[0], [OUTLINE, BODY, CONCLUSION]).total > 2.5
