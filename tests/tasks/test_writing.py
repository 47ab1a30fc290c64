"""Writing tasks: every band at, just below and just above its thresholds, each gate, style
metrics, single-agent splitting, pasted text, shipped examples, prompts and feedback."""
from __future__ import annotations

import pytest

from tasks.base import Turn
from tasks.writing import (SPLIT_MARKER, ExpansionTask, TLDRTask, jaccard, split_single,
                           transition_categories, transition_scale)

EPS = 1e-4
EX = TLDRTask.from_text("Any text at all; the writing reward only looks at the two outputs.")


def make(n_tokens: int, n_chars: int, prefix: str) -> str:
    """n_tokens distinct words, exactly n_chars characters (the last word is padded)."""
    s = " ".join(f"{prefix}{i}" for i in range(n_tokens))
    assert len(s) <= n_chars, (len(s), n_chars)
    return s + "z" * (n_chars - len(s))


# ------------------------------------------------------------------------------ the bands

@pytest.mark.parametrize("r,score,passes", [
    (1.1 - EPS, 0.0, False), (1.1, 0.0, True), (1.1 + EPS, EPS / 0.5, True), (1.35, 0.5, True),
    (1.6 - EPS, 1 - EPS / 0.5, True), (1.6, 1.0, True), (1.6 + EPS, 1.0, True),
    (3.2 - EPS, 1.0, True), (3.2, 1.0, True), (3.2 + EPS, 1 - EPS / 1.8, True),
    (5.0 - EPS, EPS / 1.8, True), (5.0, 0.0, True), (5.0 + EPS, 0.0, False), (0.5, 0.0, False),
])
def test_tldr_length_ratio_band(r, score, passes):
    s, ok = TLDRTask.ratio_band.score(r)
    assert s == pytest.approx(score, abs=1e-9) and ok is passes


@pytest.mark.parametrize("r,score,passes", [
    (1.3 - EPS, 0.0, False), (1.3, 0.0, True), (1.3 + EPS, 0.5 * EPS / 0.7, True),
    (2.0 - EPS, 0.5 * (1 - EPS / 0.7), True), (2.0, 0.5, True), (2.0 + EPS, 0.5, True), (40.0, 0.5, True),
])
def test_tldr_unique_words_band(r, score, passes):
    s, ok = TLDRTask.unique_band.score(r)
    assert s == pytest.approx(score, abs=1e-9) and ok is passes


@pytest.mark.parametrize("r,score,passes", [
    (0.8 - EPS, 0.0, False), (0.8, 0.0, True), (0.8 + EPS, EPS / 0.2, True),
    (1.0 - EPS, 1 - EPS / 0.2, True), (1.0, 1.0, True), (1.3, 1.0, True),
    (1.3 + EPS, 1 - EPS / 0.2, True), (1.5 - EPS, EPS / 0.2, True), (1.5, 0.0, True), (1.5 + EPS, 0.0, False),
])
def test_expansion_length_ratio_band(r, score, passes):
    s, ok = ExpansionTask.ratio_band.score(r)
    assert s == pytest.approx(score, abs=1e-9) and ok is passes


@pytest.mark.parametrize("r,score,passes", [
    (0.5 - EPS, 0.0, False), (0.5, 0.0, True), (0.5 + EPS, 0.5 * EPS / 0.2, True),
    (0.7 - EPS, 0.5 * (1 - EPS / 0.2), True), (0.7, 0.5, True), (1.3, 0.5, True),
    (1.3 + EPS, 0.5 * (1 - EPS / 0.4), True), (1.7 - EPS, 0.5 * EPS / 0.4, True), (1.7, 0.0, True),
    (1.7 + EPS, 0.0, False),
])
def test_expansion_unique_words_band(r, score, passes):
    s, ok = ExpansionTask.unique_band.score(r)
    assert s == pytest.approx(score, abs=1e-9) and ok is passes


# ------------------------------------------------------------------- levels, end to end

def test_tldr_length_gate_bounds():
    t = TLDRTask()
    assert t.reward(EX, [make(8, 50, "a"), make(16, 80, "b")]).levels["length"] == 0.5
    r = t.reward(EX, [make(7, 50, "a"), make(16, 80, "b")])
    assert r.total == 0 and r.details["stopped_at"] == "length"
    long1 = make(256, 2000, "a")
    assert t.reward(EX, [long1, make(256, 3200, "b")]).levels["length"] == 0.5
    r = t.reward(EX, [long1, make(257, 3200, "b")])
    assert r.total == 0 and r.details["stopped_at"] == "length"


def test_tldr_exact_levels_and_ratio_gate():
    t = TLDRTask()
    c1 = make(8, 50, "a")
    r = t.reward(EX, [c1, make(16, 80, "b")])  # ratio 1.6, unique 2.0, no transitions, no overlap
    assert r.levels == {"length": 0.5, "length_ratio": 1.0, "unique_words": 0.5, "style": 0.0}
    r = t.reward(EX, [c1, make(16, 79, "b")])  # ratio 1.58
    assert r.levels["length_ratio"] == pytest.approx(0.96)
    r = t.reward(EX, [c1, make(12, 55, "b")])  # ratio exactly 1.1: 0 points, but the gate passes
    assert r.levels["length_ratio"] == 0.0 and r.details["stopped_at"] is None
    assert r.levels["unique_words"] == pytest.approx(0.5 * 0.2 / 0.7)  # 12/8 = 1.5
    r = t.reward(EX, [c1, make(11, 46, "b") + " however"])  # 54/50 = 1.08 + transition: stops before style
    assert r.details["stopped_at"] == "length_ratio"
    assert r.levels == {"length": 0.5, "length_ratio": 0.0, "unique_words": 0.0, "style": 0.0}


def test_tldr_unique_gate_and_style():
    t = TLDRTask()
    c1 = make(8, 50, "a")
    r = t.reward(EX, [c1, "however " + make(9, 72, "b")])  # 10/8 = 1.25 < 1.3: stop
    assert r.details["stopped_at"] == "unique_words" and r.levels["style"] == 0.0
    c2 = "however a0 " + make(16, 90, "b")  # 18 distinct words; shares only "a0" with c1
    r = t.reward(EX, [c1, c2])
    # transitions: "however" is in 2 categories -> 0.4 + 0.05; overlap 1/25 = 0.04 > cap 0.03
    assert sorted(r.details["transition_categories"]) == ["concession", "contrast"]
    assert r.details["jaccard"] == pytest.approx(1 / 25)
    assert r.levels["style"] == pytest.approx(0.4 * 0.45 + 0.6)
    # TLDR counts transitions in the detail only: one in the summary alone gives nothing
    r = t.reward(EX, ["however " + make(7, 50, "a"), make(17, 90, "b")])
    assert r.details["transition_categories"] == [] and r.levels["style"] == 0.0


def test_expansion_levels_and_transitions_in_both_parts():
    t = ExpansionTask()
    c1, c2 = make(130, 1000, "a"), make(130, 1150, "b")  # ratio 1.15, unique 1.0
    r = t.reward(EX, [c1, c2])
    assert r.levels == {"length": 0.5, "length_ratio": 1.0, "unique_words": 0.5, "style": 0.0}
    r = t.reward(EX, ["however " + make(129, 991, "a"), c2])
    assert "contrast" in r.details["transition_categories"]
    assert r.levels["style"] == pytest.approx(0.4 * 0.45)
    assert t.reward(EX, [make(31, 1000, "a"), c2]).details["stopped_at"] == "length"
    assert t.reward(EX, [make(32, 1000, "a"), c2]).levels["length"] == 0.5
    assert t.reward(EX, [make(256, 2000, "a"), make(256, 2300, "b")]).levels["length"] == 0.5
    assert t.reward(EX, [make(257, 2000, "a"), make(256, 2300, "b")]).details["stopped_at"] == "length"
    r = t.reward(EX, [c1, make(130, 1501, "b")])  # ratio 1.501 > 1.5
    assert r.details["stopped_at"] == "length_ratio"
    r = t.reward(EX, [c1, make(220, 1150, "b") + " b1"])  # unique 220/130 = 1.69: partial
    assert r.levels["unique_words"] == pytest.approx(0.5 * (1 - (220 / 130 - 1.3) / 0.4))


# ------------------------------------------------------------------------------- metrics

def test_transition_words_match_whole_words_only():
    assert transition_categories("The cat was asleep on the basis.") == []  # no "as"/"so" inside words
    assert transition_categories("In   addition, it rained.") == ["elaboration"]
    assert set(transition_categories("So it ended.")) == {"cause_effect"}
    assert transition_scale(0) == 0 and transition_scale(1) == 0.4
    assert transition_scale(12) == pytest.approx(0.95)


def test_jaccard_ignores_stopwords():
    assert jaccard("the cat", "a cat") == 1.0
    assert jaccard("the", "a") == 1.0  # both empty after stopwords
    assert jaccard("red cat", "blue dog") == 0.0


# ------------------------------------------------------------------------- single agent

def test_split_single():
    assert split_single(f"short one\n{SPLIT_MARKER}\nlong two") == ("short one", "long two")
    assert split_single("para one.\n\npara two.\n\npara three.") == ("para one.", "para two.\n\npara three.")
    assert split_single("just one paragraph") == ("just one paragraph", "")


def test_single_agent_same_reward():
    c1, c2 = make(8, 50, "a"), "however a0 " + make(16, 90, "b")
    two, one = TLDRTask(), TLDRTask(num_agents=1)
    assert one.roles == ("tldr-writer",) and two.roles == ("summary", "detail")
    assert one.reward(EX, [f"{c1}\n{SPLIT_MARKER}\n{c2}"]) == two.reward(EX, [c1, c2])
    assert one.reward(EX, [c1]).details["stopped_at"] == "length"
    assert SPLIT_MARKER in one.agent_prompts(EX, [])[0]
    assert len(one.feedback(EX, [c1])) == 1


# ---------------------------------------------------------------- data, prompts, feedback

def test_from_text_and_examples():
    ex = TLDRTask.from_text("  Some pasted text.  ")
    assert ex["text"] == "Some pasted text." and ex["id"].startswith("tldr/pasted-")
    assert ex["id"] == TLDRTask.from_text("Some pasted text.")["id"]
    with pytest.raises(ValueError, match="empty"):
        TLDRTask.from_text("   ")
    for cls, n_train, n_eval in [(TLDRTask, 15, 5), (ExpansionTask, 9, 3)]:
        tr, ev = cls().examples("train"), cls().examples("eval")
        assert (len(tr), len(ev)) == (n_train, n_eval)
        assert not {e["id"] for e in tr} & {e["id"] for e in ev}
        assert all(e["text"].strip() and e["title"] for e in tr + ev)
    with pytest.raises(ValueError, match="split"):
        TLDRTask().examples("validation")


def test_prompts_sequential_and_history():
    t = ExpansionTask()
    ex = t.examples("eval")[0]
    p = t.agent_prompts(ex, [])
    assert all(ex["text"] in x for x in p) and "background" in p[0] and "method" in p[1]
    seq = t.agent_prompts(ex, [], earlier=("PART-ONE",))
    assert "PART-ONE" in seq[1] and "PART-ONE" not in seq[0]
    hist = t.agent_prompts(ex, [Turn(("OUT-1", "OUT-2"), ("FB-1", "FB-2"))])
    assert "OUT-1" in hist[0] and "FB-2" in hist[1] and "FB-1" not in hist[1]


def test_feedback_texts():
    t = TLDRTask()
    c1, c2 = make(8, 50, "a"), make(16, 79, "b")
    fb = t.feedback(EX, [c1, c2])
    assert len(fb) == 2
    assert "Score 1.96 / 3.0." in fb[0] and "summary part 8 words, detail part 16 words" in fb[0]
    assert "Length ratio detail/summary: 1.58" in fb[0] and "should be longer" in fb[0]
    assert "You write the summary part" in fb[0] and "You write the detail part" in fb[1]
    gated = t.feedback(EX, ["too short", c2])
    assert "out of range, nothing else was scored" in gated[0] and "Length ratio" not in gated[0]
    assert t.combine(EX, [" a ", "b "]) == "a\n\nb"
