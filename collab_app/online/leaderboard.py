"""The blind arena's leaderboard: people's a / b / tie votes between two team states (adapter
versions, e.g. "base", "step 3", "step 7") become Bradley–Terry ratings with bootstrap intervals,
the next pair to ask, and the figures the benchmark reports (Kendall's tau, votes needed).

Pure functions of plain values (no store, no clock, no torch), so every rule is unit-tested
directly; the caller reads the votes and shows the pair.

Fit (`standings`): choix's I-LSR Bradley–Terry fit (`choix.ilsr_pairwise_dense`, the count-matrix
form of `ilsr_pairwise`: the same estimate, one matrix per fit instead of a Python loop over
votes) with a small `alpha` regularisation, so a state that won every vote still gets a finite
strength and a comparison graph in several pieces still fits. A decisive vote counts as two wins
for the winner, a tie as one win each way (the Chatbot Arena convention: a tie is half a win).
theta (log-strength) is mean-centred over the states that have votes and shown on an Elo-like
scale, rating = 1000 + 400 * theta / ln(10) (a 400-point gap: the better one wins 10 to 1).
Intervals: percentile bootstrap over votes (the votes resampled with replacement `rounds` times,
each resample refit), widened where needed so that they always contain the point rating.

Prior (`prior`, default 2): every state with votes also has `prior` virtual wins and as many
virtual losses against a fixed average reference; they are in the fit and resampled with the real
votes. Why: the plain bootstrap of n identical votes has zero width (every resample is the same
votes), so two unanimous votes would already "separate" two states; with the prior a unanimous
run separates after about 4-6 votes (about what a sign test asks), and a state with a handful of
votes is pulled towards 1000 instead of jumping hundreds of points on one vote. With tens of votes
per state its effect is small. `prior=0` gives the plain fit.
A state without votes is unknown: rating 1000, interval spanning every other state's and at
least 1000 ± 400.

Next pair (`choose_pair`), `states` in age order (oldest first):
  1. New states first: if a state has fewer than `min_votes` votes, the newest such state is
     paired with the state whose rating is nearest its own (ties towards the newer state; with no
     board yet, its older neighbour in age, or the next one for the oldest).
  2. Otherwise the pairs whose order is still unsettled: a pair's score is the overlap of the two
     intervals (intersection / union), halved when the two are not neighbours in rating (the
     order of neighbours is what the board shows). The pair is drawn from the 3 best scores with
     probability proportional to score + 0.05, so a separated pair is still asked now and then.
  The two come back in random order (the caller shows them as a / b).
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

TIE = "tie"
CHOICES = ("a", "b", TIE)

BASE_RATING = 1000.0
ELO_SCALE = 400.0 / math.log(10.0)   # rating points per unit of theta
UNKNOWN_HALF_WIDTH = 400.0           # an unknown state's interval: at least 1000 ± 400
TOP_PAIRS = 3                        # choose_pair draws among this many best-scoring pairs
PAIR_EPSILON = 0.05                  # added to every score in that draw
NOT_ADJACENT = 0.5                   # score factor for a pair that is not neighbours in rating
MAX_ITER = 500                       # I-LSR iterations (alpha > 0 converges well within this)
BOOT_TOL = 1e-5                      # bootstrap refits stop at this L1 change of theta (0.002 points)


@dataclass(frozen=True)
class Vote:
    a: str            # state key shown on one side
    b: str            # the other side's state key (a != b)
    winner: str       # "a" | "b" | "tie"
    voter: str = ""   # who voted (for per-voter counts)

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            key = getattr(self, name)
            if not isinstance(key, str) or not key:
                raise ValueError(f"Vote.{name} must be a non-empty state key (str), got {key!r}")
        if self.a == self.b:
            raise ValueError(f"a vote compares two different states; got {self.a!r} on both sides")
        if self.winner not in CHOICES:
            raise ValueError(f"Vote.winner must be one of {CHOICES}, got {self.winner!r}")
        if not isinstance(self.voter, str):
            raise ValueError(f"Vote.voter must be a str ('' when unknown), got {self.voter!r}")


@dataclass(frozen=True)
class Standing:
    state: str
    rating: float     # 1000 + 400 * theta / ln(10), theta mean-centred over the states with votes
    low: float        # lower bootstrap percentile (2.5th at level 0.95), same scale
    high: float       # upper bootstrap percentile (97.5th at level 0.95)
    votes: int        # votes this state took part in
    wins: int
    losses: int
    ties: int


def standings(votes: Sequence[Vote], states: Sequence[str] | None = None, rounds: int = 200,
              seed: int = 0, alpha: float = 0.01, level: float = 0.95, prior: int = 2) -> list[Standing]:
    """Bradley–Terry fit of all votes (choix) + percentile bootstrap over votes (resample the
    votes with replacement `rounds` times, refit each). `states`: the states to rank (default:
    those in the votes, in order of first appearance); a state given without votes gets rating
    1000 and an interval spanning every other state's and at least 1000 ± 400 (it is unknown).
    A decisive vote counts as two wins for the winner, a tie as one win each way. `prior`: the
    virtual wins (and as many losses) each voted state has against an average reference (module
    docstring; 0 = none). Sorted best first (equal ratings keep the order of `states`).
    Deterministic for a given seed."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1 (bootstrap resamples), got {rounds}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0 (it keeps all-win states and split graphs finite), got {alpha}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95, got {level}")
    if not (isinstance(prior, int) and prior >= 0):
        raise ValueError(f"prior must be an int >= 0 (virtual wins/losses per state), got {prior!r}")
    states = _state_list(votes, states)
    seen = {s for v in votes for s in (v.a, v.b)}
    voted = [s for s in states if s in seen]
    rated: dict[str, tuple[float, float, float]] = {}   # state -> (rating, low, high)
    if voted:
        theta, boot = _fit(votes, voted, rounds, seed, alpha, prior)   # (k,), (rounds, k)
        tail = 100.0 * (1.0 - level) / 2.0
        lows, highs = np.percentile(_to_rating(boot), [tail, 100.0 - tail], axis=0)   # (k,) each
        for i, s in enumerate(voted):
            r = float(_to_rating(theta[i]))
            rated[s] = (r, min(float(lows[i]), r), max(float(highs[i]), r))
    lo = min([BASE_RATING - UNKNOWN_HALF_WIDTH] + [x[1] for x in rated.values()])
    hi = max([BASE_RATING + UNKNOWN_HALF_WIDTH] + [x[2] for x in rated.values()])
    counts = _counts(votes)
    board = []
    for s in states:
        r, low, high = rated.get(s, (BASE_RATING, lo, hi))
        w, l, t = counts.get(s, (0, 0, 0))
        board.append(Standing(s, r, low, high, votes=w + l + t, wins=w, losses=l, ties=t))
    return sorted(board, key=lambda x: -x.rating)   # stable: equal ratings keep `states` order


def overlap(x: Standing, y: Standing) -> float:
    """Length of the intersection of the two intervals over the length of their union
    (0 = disjoint, 1 = the same interval; two identical points count as 1)."""
    inter = min(x.high, y.high) - max(x.low, y.low)
    union = max(x.high, y.high) - min(x.low, y.low)
    if inter < 0:
        return 0.0
    return 1.0 if union <= 0 else inter / union


def separated(x: Standing, y: Standing) -> bool:
    """True when the intervals do not overlap (touching ends count as overlapping)."""
    return x.high < y.low or y.high < x.low


def choose_pair(states: Sequence[str], board: Sequence[Standing] | None, rng: random.Random,
                min_votes: int = 6) -> tuple[str, str]:
    """The next pair to ask; `states` in age order (oldest first). The rule is in the module
    docstring. States missing from `board` count as unknown (no votes, rating 1000)."""
    states = list(states)
    if len(states) < 2:
        raise ValueError(f"choose_pair needs at least 2 states to compare, got {states}")
    if len(set(states)) != len(states):
        raise ValueError(f"states must be distinct, got {states}")
    known = {x.state: x for x in board or ()}
    table = [known.get(s) or _unknown(s) for s in states]   # age order
    new = [i for i, x in enumerate(table) if x.votes < min_votes]
    if new:
        pair = _pair_for_new(new[-1], table, have_board=board is not None)
    else:
        pair = _unsettled_pair(table, rng)
    return pair if rng.random() < 0.5 else (pair[1], pair[0])


def kendall_tau(order: Sequence[str], board: Sequence[Standing]) -> float:
    """Kendall's tau (scipy.stats.kendalltau) between the true order `order` (worst first, e.g.
    versions oldest -> newest when the team learns) and the board's ratings of those states.
    1 = the board orders them exactly as `order`, -1 = reversed; 0 when every rating is equal."""
    from scipy.stats import kendalltau

    order = list(order)
    if len(order) < 2 or len(set(order)) != len(order):
        raise ValueError(f"kendall_tau needs at least 2 distinct states in `order`, got {order}")
    ratings = {x.state: x.rating for x in board}
    missing = [s for s in order if s not in ratings]
    if missing:
        raise ValueError(f"states {missing} are not on the board; rank them with standings(votes, states=...)")
    tau = kendalltau(range(len(order)), [ratings[s] for s in order]).statistic
    return 0.0 if math.isnan(tau) else float(tau)


def votes_to_separate(votes: Sequence[Vote], x: str, y: str, rounds: int = 200, seed: int = 0,
                      start: int = 2) -> int | None:
    """Replay the votes in order: the smallest n (>= start) such that the standings of the first
    n votes separate x and y (intervals disjoint); None if they never do."""
    if x == y:
        raise ValueError(f"votes_to_separate compares two different states; got {x!r} twice")
    seen = {s for v in votes for s in (v.a, v.b)}
    missing = [s for s in (x, y) if s not in seen]
    if missing:
        raise ValueError(f"states {missing} appear in no vote; check the state keys")
    for n in range(max(start, 1), len(votes) + 1):
        board = {s.state: s for s in standings(votes[:n], states=_states_of(votes[:n], x, y),
                                               rounds=rounds, seed=seed)}
        if separated(board[x], board[y]):
            return n
    return None


def per_voter(votes: Sequence[Vote]) -> dict[str, int]:
    """Votes per voter, most first (equal counts: first seen first)."""
    return dict(Counter(v.voter for v in votes).most_common())


# --- internals -----------------------------------------------------------------------------

def _state_list(votes: Sequence[Vote], states: Sequence[str] | None) -> list[str]:
    """The states to rank: `states` checked against the votes, or the votes' own states."""
    for v in votes:
        if not isinstance(v, Vote):
            raise ValueError(f"votes must be Vote objects, got {v!r}")
    if states is None:
        return list(dict.fromkeys(s for v in votes for s in (v.a, v.b)))
    states = list(states)
    if len(set(states)) != len(states):
        raise ValueError(f"states must be distinct, got {states}")
    given = set(states)
    unknown = sorted({s for v in votes for s in (v.a, v.b)} - given)
    if unknown:
        raise ValueError(f"votes name states {unknown} that are not in `states`; add them to "
                         "`states` or leave `states` out (then the votes' states are ranked)")
    return states


def _states_of(votes: Sequence[Vote], *extra: str) -> list[str]:
    """The states in the votes (first seen first), then `extra` ones not among them."""
    return list(dict.fromkeys([s for v in votes for s in (v.a, v.b)] + list(extra)))


def _fit(votes: Sequence[Vote], voted: list[str], rounds: int, seed: int, alpha: float,
         prior: int) -> tuple[np.ndarray, np.ndarray]:
    """theta of the full pool (k,) and of each bootstrap resample of it (rounds, k), mean-centred
    over the k voted states. The pool: the votes plus the prior's virtual votes against the
    reference (index k, dropped from the result)."""
    k = len(voted)
    pool = np.concatenate([_win_matrices(votes, voted), _prior_matrices(k, prior)])  # (N, (k+1)^2)
    n = pool.shape[0]
    theta = _ilsr(pool.sum(axis=0).reshape(k + 1, k + 1), alpha, None, tol=1e-8)
    draws = np.random.default_rng(seed).integers(0, n, size=(rounds, n))   # pool indices
    picked = np.bincount((draws + n * np.arange(rounds)[:, None]).ravel(),
                         minlength=rounds * n).reshape(rounds, n)           # times each item drawn
    comp = (picked @ pool).reshape(rounds, k + 1, k + 1)                    # win counts per round
    boot = np.stack([_ilsr(c, alpha, theta, BOOT_TOL) for c in comp])   # warm start: few iterations
    theta, boot = theta[:k], boot[:, :k]                      # drop the reference
    return theta - theta.mean(), boot - boot.mean(axis=1, keepdims=True)


def _ilsr(comp: np.ndarray, alpha: float, start: np.ndarray | None, tol: float) -> np.ndarray:
    """choix's I-LSR fit of a win-count matrix, comp[i, j] = wins of i over j."""
    import choix

    return choix.ilsr_pairwise_dense(comp, alpha=alpha, initial_params=start, max_iter=MAX_ITER, tol=tol)


def _win_matrices(votes: Sequence[Vote], voted: list[str]) -> np.ndarray:
    """(n, (k+1)^2): row i holds vote i's wins (2 for the winner of a decisive vote, 1 each way
    for a tie) as a flattened (k+1, k+1) matrix; index k is the prior's reference."""
    index = {s: i for i, s in enumerate(voted)}
    m = len(voted) + 1
    out = np.zeros((len(votes), m * m))
    for row, v in enumerate(votes):
        a, b = index[v.a], index[v.b]
        if v.winner == TIE:
            out[row, a * m + b] += 1.0
            out[row, b * m + a] += 1.0
        elif v.winner == "a":
            out[row, a * m + b] += 2.0
        else:
            out[row, b * m + a] += 2.0
    return out


def _prior_matrices(k: int, prior: int) -> np.ndarray:
    """(2 * prior * k, (k+1)^2): per voted state, `prior` virtual wins over the reference
    (index k) and as many losses, each a decisive vote (2 wins)."""
    m = k + 1
    out = np.zeros((2 * prior * k, m * m))
    for i in range(k):
        for p in range(prior):
            row = 2 * (i * prior + p)
            out[row, i * m + k] = 2.0       # i beats the reference
            out[row + 1, k * m + i] = 2.0   # the reference beats i
    return out


def _to_rating(theta):
    return BASE_RATING + ELO_SCALE * theta


def _counts(votes: Sequence[Vote]) -> dict[str, tuple[int, int, int]]:
    """state -> (wins, losses, ties)."""
    out: dict[str, list[int]] = {}
    for v in votes:
        wa, wb = out.setdefault(v.a, [0, 0, 0]), out.setdefault(v.b, [0, 0, 0])
        if v.winner == TIE:
            wa[2] += 1
            wb[2] += 1
        elif v.winner == "a":
            wa[0] += 1
            wb[1] += 1
        else:
            wb[0] += 1
            wa[1] += 1
    return {s: (w, l, t) for s, (w, l, t) in out.items()}


def _unknown(state: str) -> Standing:
    return Standing(state, BASE_RATING, BASE_RATING - UNKNOWN_HALF_WIDTH,
                    BASE_RATING + UNKNOWN_HALF_WIDTH, 0, 0, 0, 0)


def _pair_for_new(i: int, table: list[Standing], have_board: bool) -> tuple[str, str]:
    """State i (too few votes) with the nearest-rated other state, ties towards the newer one;
    without a board its older neighbour in age (the next one for the oldest)."""
    if not have_board:
        j = i - 1 if i > 0 else 1
    else:
        others = [j for j in range(len(table)) if j != i]
        j = min(others, key=lambda j: (abs(table[j].rating - table[i].rating), -j))
    return table[i].state, table[j].state


def _unsettled_pair(table: list[Standing], rng: random.Random) -> tuple[str, str]:
    """A pair drawn from the TOP_PAIRS best by score (overlap, halved when not rating neighbours)
    with probability proportional to score + PAIR_EPSILON."""
    by_rating = sorted(range(len(table)), key=lambda i: -table[i].rating)
    rank = {i: r for r, i in enumerate(by_rating)}
    scored = []
    for i in range(len(table)):
        for j in range(i + 1, len(table)):
            score = overlap(table[i], table[j])
            if abs(rank[i] - rank[j]) != 1:
                score *= NOT_ADJACENT
            scored.append((score, i, j))
    scored.sort(key=lambda t: (-t[0], -t[2], -t[1]))   # best first, ties towards newer states
    top = scored[:TOP_PAIRS]
    score, i, j = rng.choices(top, weights=[t[0] + PAIR_EPSILON for t in top])[0]
    return table[i].state, table[j].state
