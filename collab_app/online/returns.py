"""Reward assembly: one return per joint sample from automatic levels and human ratings.

The rule is a small flat dataclass (`ReturnRule`) so the trainer service and the CLI can expose
it as flags (trainer/configcli.py). Everything here is a pure function of plain values (no
store, no clock) so every rule and edge case is unit-tested directly.

Human ratings: a person gives a joint sample 1-5 (`RATING_MIN`..`RATING_MAX`); a rater's latest
rating counts, the human score is the mean over raters, mapped linearly from 1..5 onto the task's
[0, max_reward] range, so it is on the automatic reward's scale.

Modes (h = human score, a = automatic total):
  - "auto":        R = a. Ratings are ignored.
  - "human":       R = h. Waits for every joint sample of the group to be rated.
  - "human_first": R = h where rated, else a after `human_timeout_s`.
  - "weighted":    R = w*h + (1-w)*a when both exist; h alone on human-only tasks; a alone after
                   `human_timeout_s`. The default (w = 0.5): a person's preference moves the team
                   while the task's checks keep what the task asks for in every return (under
                   "human_first" the team trades the task away: docs/results/README.md).
A group that cannot get a return at all without a person is expired after `human_timeout_s`.

Feedback forms (`RATING_KINDS`): "stars" as given; "rank" r of G -> 5 - 4 (r - 1) / (G - 1);
"pick_best": the chosen one 5, every other 1. Each becomes one 1..5 rating per candidate, so the
rules above are unchanged. Who may rate is enforced by collab_app/web/core.py; a person's own
coding problem trains the shared team only while the admin flag `CUSTOM_TRAINING_KEY` allows it
(`may_train_shared`). Why each rule, and what is left out: docs/ARCHITECTURE.md "Returns in
detail".
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

from tasks import PRIVATE_TASKS  # noqa: F401  (re-exported: a person's own problems; the tasks say which)

RATING_MIN = 1
RATING_MAX = 5
MODES = ("human_first", "auto", "human", "weighted")
RATING_KINDS = ("stars", "rank", "pick_best")
"""feedback forms a rating row can come from (module doc: how each maps to 1..5)."""
CUSTOM_TRAINING_KEY = "custom_training"
"""app_state key: {"allowed": bool, "by": str, "at": unix time}. Groups of `PRIVATE_TASKS` train
the shared team only while "allowed" is true (an admin sets it in the app's Training tab)."""


@dataclass(frozen=True)
class ReturnRule:
    mode: Literal["human_first", "auto", "human", "weighted"] = "weighted"
    """how automatic rewards and human ratings combine: human_first | auto | human | weighted."""
    human_weight: float = 0.5
    """weighted mode: w in w*human + (1-w)*auto (0..1; 0.5 = a rating and the task's checks count equally)."""
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


def deciding_rater(ratings: Sequence[Sequence[tuple[str, float]]], sources: Sequence[str]) -> str | None:
    """A group's rater, for the trainer's cap on one rater's share of a step: among
    the joint samples whose return a rating decides (source "human" or "weighted"), the rater
    whose latest rating is in force on the most of them; a tie goes to the rater met first
    (joint samples in order, each one's ratings oldest first). None when no rating decides any return (automatic
    returns only, or mode "auto")."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    seq = 0
    for per_joint, source in zip(ratings, sources):
        for rater, _ in per_joint:
            first.setdefault(rater, seq)
            seq += 1
        if source in ("human", "weighted"):
            for rater in latest_per_rater(per_joint):
                counts[rater] = counts.get(rater, 0) + 1
    if not counts:
        return None
    return min(counts, key=lambda r: (-counts[r], first[r]))


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
                  age_s: float) -> tuple[list[float | None], list[str]] | None:
    """Returns and sources of every joint sample of a group, or None when the group is not
    ready under `rule`. `ratings[k]` are joint sample k's (rater, value) pairs, oldest first;
    `age_s` is the group's age.

    Before `rule.human_timeout_s` a group is ready when every joint sample has a return. After
    it, a group whose joints have returns for at least MIN_RETURNS of them is ready on those:
    the others (a candidate whose automatic check failed and that nobody rated) get return None
    and source "none", and the trainer leaves them out (the store drops them from the group it
    hands over), so one failed check does not expire the person's ratings of the rest."""
    if len(auto_totals) != len(ratings):
        raise ValueError("auto_totals and ratings must have one entry per joint sample")
    waited = age_s >= rule.human_timeout_s
    out = [joint_return(rule, a, human_score(r, max_reward), waited) for a, r in zip(auto_totals, ratings)]
    have = sum(x is not None for x in out)
    if have < len(out) and not (waited and have >= MIN_RETURNS):
        return None
    return [None if x is None else x[0] for x in out], ["none" if x is None else x[1] for x in out]


MIN_RETURNS = 2
"""joint samples with a return a group needs, after the timeout, to train on those alone: a
group-relative advantage compares a return with its siblings'."""


def group_state(rule: ReturnRule, auto_totals: Sequence[float | None],
                ratings: Sequence[Sequence[tuple[str, float]]], max_reward: float,
                age_s: float) -> str:
    """"ready" (enough joint samples have a return: `group_returns`), "waiting" (not yet, may
    still become ready) or "expired" (past `human_timeout_s` and still not ready: no automatic
    fallback can fill it)."""
    if group_returns(rule, auto_totals, ratings, max_reward, age_s) is not None:
        return "ready"
    return "expired" if age_s >= rule.human_timeout_s else "waiting"


class FeedbackError(ValueError):
    """A ranking / pick that does not fit the group; the message says what to fix."""


def _whole(x, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x != int(x):
        raise FeedbackError(f"{what} must be a whole number, got {x!r:.40}")
    return int(x)


def rank_to_rating(rank: int, num_generations: int) -> float:
    """Rank r of G (1 = best) -> 5 - 4 (r - 1) / (G - 1) on the 1..5 scale (module doc)."""
    G = _whole(num_generations, "the number of candidates")
    r = _whole(rank, "a rank")
    if G < 2:
        raise FeedbackError("ranking needs at least 2 candidates")
    if not 1 <= r <= G:
        raise FeedbackError(f"rank {r} is out of range: ranks go from 1 (best) to {G}")
    return RATING_MAX - (RATING_MAX - RATING_MIN) * (r - 1) / (G - 1)


def ranking_ratings(ranks: Sequence, num_generations: int) -> list[float]:
    """`ranks[k]` = the rank (1 = best) of candidate k; must be a permutation of 1..G. Returns
    one 1..5 rating per candidate. Duplicates, missing candidates, out-of-range ranks -> FeedbackError."""
    G = _whole(num_generations, "the number of candidates")
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise FeedbackError(f"a ranking is a list of {G} ranks (1 = best), one per candidate")
    if len(ranks) != G:
        raise FeedbackError(f"a ranking needs a rank for each of the {G} candidates, got {len(ranks)}")
    rs = [_whole(r, f"the rank of candidate {k + 1}") for k, r in enumerate(ranks)]
    for k, r in enumerate(rs):
        if not 1 <= r <= G:
            raise FeedbackError(f"candidate {k + 1} has rank {r}: ranks go from 1 (best) to {G}")
    dup = sorted({r for r in rs if rs.count(r) > 1})
    if dup:
        missing = sorted(set(range(1, G + 1)) - set(rs))
        raise FeedbackError(f"rank {', '.join(map(str, dup))} given to several candidates and rank "
                            f"{', '.join(map(str, missing))} to none: give each candidate its own rank 1..{G}")
    return [rank_to_rating(r, G) for r in rs]


def pick_best_ratings(best: int, num_generations: int) -> list[float]:
    """Candidate `best` (0-based) picked as the best of G: it gets 5, every other one 1."""
    G = _whole(num_generations, "the number of candidates")
    b = _whole(best, "the best candidate")
    if G < 2:
        raise FeedbackError("picking the best needs at least 2 candidates")
    if not 0 <= b < G:
        raise FeedbackError(f"candidate {b + 1} does not exist: pick one of 1..{G}")
    return [float(RATING_MAX) if k == b else float(RATING_MIN) for k in range(G)]


def may_train_shared(task: str, custom_training: dict | None) -> bool:
    """Whether a group of `task` may train the shared team, given the app_state value stored
    under `CUSTOM_TRAINING_KEY` (None when never set: not allowed)."""
    return task not in PRIVATE_TASKS or bool((custom_training or {}).get("allowed"))
