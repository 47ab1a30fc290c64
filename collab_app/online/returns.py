"""Reward assembly: one return per joint sample from automatic levels and human ratings.

The rule is a small flat dataclass (`ReturnRule`) so the trainer service and the CLI can expose
it as flags (trainer/configcli.py). Everything here is a pure function of plain values (no
store, no clock) so every rule and edge case is unit-tested directly.

Human ratings: a person gives a joint sample 1-5 (`RATING_MIN`..`RATING_MAX`). Ratings are
append-only in the store; a rater's *latest* rating counts (re-rating replaces their earlier
one), the human score is the mean over raters, mapped linearly from 1..5 onto the task's
[0, max_reward] range (1 -> 0, 5 -> max_reward), so it is on the automatic reward's scale.

Modes (the return R of one joint sample; h = human score, a = automatic total):
  - "auto":        R = a. Ratings are ignored.
  - "human":       R = h. Waits for every joint sample of the group to be rated.
  - "human_first": R = h where rated, else a. Waits up to `human_timeout_s` for ratings, then
                   falls back to a for the unrated ones (0 = never wait: the brief's plain rule).
  - "weighted":    R = w*h + (1-w)*a when both exist; h alone on human-only tasks (no a);
                   a alone for samples still unrated after `human_timeout_s`.

`human_timeout_s` (measured from the group's creation) decides what happens to a group that is
still not ready when it runs out: in "human_first" / "weighted" unrated samples **fall back to
the automatic reward**; a group that cannot get a return at all without a person (mode "human",
or a human-only task with no automatic reward, or a failed automatic check under "auto") is
**expired**: kept in the store with its ratings, never trained on. `math.inf` = wait forever.

Deliberately left out: per-rater calibration (z-scoring each rater), rank-based ratings, and
mixing scales inside a group is allowed (human for some samples, automatic for others) in
"human_first" after the timeout; the group baseline in MAGRPO then absorbs only part of it.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

RATING_MIN = 1
RATING_MAX = 5
MODES = ("human_first", "auto", "human", "weighted")


@dataclass(frozen=True)
class ReturnRule:
    mode: Literal["human_first", "auto", "human", "weighted"] = "human_first"
    """how automatic rewards and human ratings combine: human_first | auto | human | weighted."""
    human_weight: float = 0.5
    """weighted mode: w in w*human + (1-w)*auto (0..1)."""
    human_timeout_s: float = 300.0
    """seconds after a group's creation to wait for ratings; then human_first/weighted fall back
    to the automatic reward and groups that cannot get a return are expired (inf = wait forever)."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"ReturnRule.mode must be one of {MODES}, got {self.mode!r}")
        w = self.human_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
            raise ValueError(f"ReturnRule.human_weight must be a number in [0, 1], got {w!r}")
        t = self.human_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0:
            raise ValueError(f"ReturnRule.human_timeout_s must be >= 0 seconds (inf = wait forever), got {t!r}")


def check_rating_value(value) -> float:
    """A rating value as float, or ValueError saying what is accepted. Strings are refused on
    purpose (the UI parses a person's input; the store takes numbers only)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"rating value must be a number from {RATING_MIN} to {RATING_MAX}, "
                         f"got {type(value).__name__} {value!r:.40}")
    v = float(value)
    if not math.isfinite(v) or not RATING_MIN <= v <= RATING_MAX:
        raise ValueError(f"rating value must be a finite number from {RATING_MIN} to {RATING_MAX}, got {v!r}")
    return v


def scale_rating(value: float, max_reward: float) -> float:
    """1..5 -> 0..max_reward, linearly."""
    return (value - RATING_MIN) / (RATING_MAX - RATING_MIN) * max_reward


def latest_per_rater(ratings: Iterable[tuple[str, float]]) -> dict[str, float]:
    """{rater: value of their latest rating}; `ratings` are (rater, value) oldest first."""
    latest: dict[str, float] = {}
    for rater, value in ratings:
        latest[rater] = value
    return latest


def human_score(ratings: Iterable[tuple[str, float]], max_reward: float) -> float | None:
    """Mean over raters of each rater's latest rating, on the [0, max_reward] scale; None when
    nobody rated."""
    latest = latest_per_rater(ratings)
    if not latest:
        return None
    return scale_rating(sum(latest.values()) / len(latest), max_reward)


def joint_return(rule: ReturnRule, auto_total: float | None, human: float | None,
                 waited: bool) -> tuple[float, str] | None:
    """The return of one joint sample and its source ("auto" | "human" | "weighted"), or None
    while it has none under `rule`. `human` is `human_score(...)`; `waited` is True once the
    group is older than `rule.human_timeout_s`."""
    a, h = auto_total, human
    if rule.mode == "auto":
        return None if a is None else (a, "auto")
    if rule.mode == "human":
        return None if h is None else (h, "human")
    if rule.mode == "human_first":
        if h is not None:
            return h, "human"
    else:  # weighted
        if h is not None and a is not None:
            return rule.human_weight * h + (1 - rule.human_weight) * a, "weighted"
        if h is not None:
            return h, "human"   # human-only task: nothing to weigh against
    return (a, "auto") if a is not None and waited else None


def group_returns(rule: ReturnRule, auto_totals: Sequence[float | None],
                  ratings: Sequence[Sequence[tuple[str, float]]], max_reward: float,
                  age_s: float) -> tuple[list[float], list[str]] | None:
    """Returns and sources of every joint sample of a group, or None when the group is not
    ready under `rule` (some joint sample has no return yet). `ratings[k]` are joint sample k's
    (rater, value) pairs, oldest first; `age_s` is the group's age."""
    if len(auto_totals) != len(ratings):
        raise ValueError("auto_totals and ratings must have one entry per joint sample")
    waited = age_s >= rule.human_timeout_s
    out = [joint_return(rule, a, human_score(r, max_reward), waited) for a, r in zip(auto_totals, ratings)]
    if any(x is None for x in out):
        return None
    return [x[0] for x in out], [x[1] for x in out]   # type: ignore[index]


def group_state(rule: ReturnRule, auto_totals: Sequence[float | None],
                ratings: Sequence[Sequence[tuple[str, float]]], max_reward: float,
                age_s: float) -> str:
    """"ready" (every joint sample has a return), "waiting" (not yet, may still become ready) or
    "expired" (past `human_timeout_s` and still not ready: no automatic fallback can fill it)."""
    if group_returns(rule, auto_totals, ratings, max_reward, age_s) is not None:
        return "ready"
    return "expired" if age_s >= rule.human_timeout_s else "waiting"
