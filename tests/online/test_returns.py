"""Reward assembly (collab_app/online/returns.py): every mode and its edge cases, as pure functions."""
from __future__ import annotations

import math

import pytest

from collab_app.online.returns import (RATING_MAX, RATING_MIN, ReturnRule, check_rating_value, group_returns,
                                group_state, human_score, joint_return, latest_per_rater, scale_rating)

MAX = 4.0


def test_scale_endpoints_and_midpoint():
    assert scale_rating(RATING_MIN, MAX) == 0.0
    assert scale_rating(RATING_MAX, MAX) == MAX
    assert scale_rating(3, MAX) == pytest.approx(2.0)
    assert scale_rating(5, 3.0) == 3.0   # writing tasks: max 3.0


def test_human_score_no_ratings_is_none():
    assert human_score([], MAX) is None


def test_human_score_several_raters_mean():
    # a: 5 -> 4.0, b: 1 -> 0.0, c: 3 -> 2.0 ; mean of values 3 -> 2.0
    assert human_score([("a", 5), ("b", 1), ("c", 3)], MAX) == pytest.approx(2.0)


def test_rerating_by_same_rater_latest_counts():
    ratings = [("a", 1), ("b", 5), ("a", 5)]
    assert latest_per_rater(ratings) == {"a": 5, "b": 5}
    assert human_score(ratings, MAX) == MAX     # a's 1 was replaced, not averaged in
    assert human_score([("a", 5), ("a", 1)], MAX) == 0.0


@pytest.mark.parametrize("mode", ["auto", "human", "human_first", "weighted"])
def test_nothing_at_all_is_never_ready(mode):
    r = ReturnRule(mode=mode)
    assert joint_return(r, None, None, waited=False) is None
    assert joint_return(r, None, None, waited=True) is None


def test_auto_mode_ignores_ratings():
    r = ReturnRule(mode="auto")
    assert joint_return(r, 1.5, 4.0, waited=False) == (1.5, "auto")
    assert joint_return(r, None, 4.0, waited=True) is None   # human-only group: auto cannot train it


def test_human_mode_waits_for_ratings_forever():
    r = ReturnRule(mode="human", human_timeout_s=10)
    assert joint_return(r, 3.0, None, waited=True) is None   # never falls back to auto
    assert joint_return(r, 3.0, 1.0, waited=False) == (1.0, "human")


def test_human_first_prefers_human_then_falls_back_after_timeout():
    r = ReturnRule(mode="human_first", human_timeout_s=60)
    assert joint_return(r, 3.0, 1.0, waited=False) == (1.0, "human")
    assert joint_return(r, 3.0, None, waited=False) is None          # still waiting for a person
    assert joint_return(r, 3.0, None, waited=True) == (3.0, "auto")  # timeout: automatic fallback
    assert joint_return(r, None, None, waited=True) is None          # human-only: nothing to fall back on


def test_human_first_zero_timeout_is_plain_rule():
    r = ReturnRule(mode="human_first", human_timeout_s=0)
    assert group_returns(r, [1.0, 2.0], [[], [("a", 5)]], MAX, age_s=0.0) == ([1.0, 4.0], ["auto", "human"])


def test_weighted():
    r = ReturnRule(mode="weighted", human_weight=0.25, human_timeout_s=60)
    assert joint_return(r, 2.0, 4.0, waited=False) == (pytest.approx(0.25 * 4 + 0.75 * 2), "weighted")
    assert joint_return(r, None, 4.0, waited=False) == (4.0, "human")   # human-only task
    assert joint_return(r, 2.0, None, waited=False) is None
    assert joint_return(r, 2.0, None, waited=True) == (2.0, "auto")
    w1 = ReturnRule(mode="weighted", human_weight=1.0)
    assert joint_return(w1, 2.0, 4.0, waited=False)[0] == 4.0


def test_group_returns_needs_every_joint_sample():
    r = ReturnRule(mode="human", human_timeout_s=100)
    autos = [1.0, 2.0, 3.0]
    partial = [[("a", 5)], [("a", 1)], []]
    assert group_returns(r, autos, partial, MAX, age_s=5) is None
    assert group_state(r, autos, partial, MAX, age_s=5) == "waiting"
    # after the timeout a group trains on the joint samples that have a return, when >= 2 do
    assert group_state(r, autos, partial, MAX, age_s=100) == "ready"
    assert group_returns(r, autos, partial, MAX, age_s=100) == ([4.0, 0.0, None], ["human", "human", "none"])
    assert group_state(r, autos, [[("a", 5)], [], []], MAX, age_s=100) == "expired"
    full = [[("a", 5)], [("a", 1), ("b", 2)], [("b", 3)]]
    rets, srcs = group_returns(r, autos, full, MAX, age_s=5)
    assert rets == pytest.approx([4.0, scale_rating(1.5, MAX), 2.0]) and srcs == ["human"] * 3
    assert group_state(r, autos, full, MAX, age_s=1e9) == "ready"


def test_human_only_group_expires_under_human_first_but_auto_group_falls_back():
    r = ReturnRule(mode="human_first", human_timeout_s=30)
    assert group_state(r, [None, None], [[], []], MAX, age_s=31) == "expired"
    assert group_state(r, [None, None], [[("a", 2)], []], MAX, age_s=31) == "expired"
    assert group_state(r, [1.0, 0.5], [[], []], MAX, age_s=31) == "ready"
    assert group_state(r, [1.0, 0.5], [[], []], MAX, age_s=29) == "waiting"


def test_infinite_timeout_never_expires():
    r = ReturnRule(mode="human", human_timeout_s=math.inf)
    assert group_state(r, [1.0], [[]], MAX, age_s=1e12) == "waiting"


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        group_returns(ReturnRule(), [1.0, 2.0], [[]], MAX, age_s=0)


@pytest.mark.parametrize("kw", [dict(mode="best"), dict(human_weight=1.5), dict(human_weight=-0.1),
                                dict(human_weight=True), dict(human_timeout_s=-1),
                                dict(human_timeout_s=float("nan")), dict(human_timeout_s="10")])
def test_rule_validation(kw):
    with pytest.raises(ValueError):
        ReturnRule(**kw)


@pytest.mark.parametrize("bad", [9, -1, 0, 0.99, 5.01, float("nan"), float("inf"), "abc", "3", None, True, [3]])
def test_rating_value_validation(bad):
    with pytest.raises(ValueError, match="rating value"):
        check_rating_value(bad)


def test_rating_value_accepts_numbers_in_scale():
    assert check_rating_value(1) == 1.0 and check_rating_value(5) == 5.0 and check_rating_value(3.5) == 3.5
    np = pytest.importorskip("numpy")
    assert check_rating_value(np.int64(4)) == 4.0


# --------------------------------------------------------------------------- feedback forms

from collab_app.online.returns import (FeedbackError, may_train_shared, pick_best_ratings,  # noqa: E402
                                       rank_to_rating, ranking_ratings)


def test_rank_mapping_is_even_from_5_to_1():
    assert [rank_to_rating(r, 2) for r in (1, 2)] == [5.0, 1.0]
    assert [rank_to_rating(r, 4) for r in (1, 2, 3, 4)] == pytest.approx([5, 11 / 3, 7 / 3, 1])
    # candidate k's rank -> its rating, in candidate order
    assert ranking_ratings([3, 1, 2], 3) == [1.0, 5.0, 3.0]


@pytest.mark.parametrize("ranks, fragment", [
    ([1, 1, 2], "several candidates and rank 3 to none"),   # duplicate
    ([1, 2], "each of the 3 candidates"),                    # missing
    ([1, 2, 4], "ranks go from 1"),                          # out of range
    ([0, 1, 2], "ranks go from 1"),
    ([1, 2, 2.5], "whole number"), ([1, 2, True], "whole number"), ("123", "list of 3"),
])
def test_bad_rankings(ranks, fragment):
    with pytest.raises(FeedbackError, match=fragment):
        ranking_ratings(ranks, 3)


def test_pick_best_gives_best_5_others_1_and_mean_advantage():
    vals = pick_best_ratings(2, 4)
    assert vals == [1.0, 1.0, 5.0, 1.0]
    mean = sum(vals) / 4
    assert vals[2] - mean == pytest.approx(4 * 3 / 4) and vals[0] - mean == pytest.approx(-4 / 4)
    for bad in (4, -1, 1.5):
        with pytest.raises(FeedbackError):
            pick_best_ratings(bad, 4)


def test_forms_feed_human_score_like_stars():
    # a ranking by "a" then stars by "a" on the same candidate: the latest counts, whatever its form
    ranked = ranking_ratings([2, 1], 2)
    assert human_score([("a", ranked[0])], MAX) == 0.0
    assert human_score([("a", ranked[0]), ("a", 4)], MAX) == pytest.approx(3.0)


def test_custom_coding_trains_shared_team_only_when_allowed():
    assert may_train_shared("humaneval", None) and may_train_shared("tldr", {"allowed": False})
    assert not may_train_shared("custom-coding", None)
    assert not may_train_shared("custom-coding", {"allowed": False})
    assert may_train_shared("custom-coding", {"allowed": True, "by": "admin"})
