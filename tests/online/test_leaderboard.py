"""The arena leaderboard (collab_app/online/leaderboard.py): Bradley–Terry ratings with bootstrap
intervals, how ties count, the next pair to ask, and the bench's figures (Kendall's tau, votes
needed to separate two states)."""
from __future__ import annotations

import math
import random
import time
from collections import Counter

import pytest

from collab_app.online.leaderboard import (
    CHOICES, TIE, Standing, Vote, choose_pair, kendall_tau, overlap, per_voter, separated,
    standings, votes_to_separate,
)


def by_state(board):
    return {x.state: x for x in board}


def hand(state, rating, low, high, votes=10):
    return Standing(state, rating, low, high, votes=votes, wins=0, losses=0, ties=0)


def noisy_arena(strengths, n, seed, refresh=15, rounds=40):
    """Votes from a voter who prefers a over b with probability sigmoid(s_a - s_b) (the BT model),
    pairs from choose_pair on a board refreshed every `refresh` votes."""
    states = list(strengths)
    rng = random.Random(seed)
    votes, board = [], None
    for i in range(n):
        a, b = choose_pair(states, board, rng)
        p = 1.0 / (1.0 + math.exp(strengths[b] - strengths[a]))
        votes.append(Vote(a, b, "a" if rng.random() < p else "b", voter=f"p{rng.randrange(3)}"))
        if i % refresh == refresh - 1:
            board = standings(votes, states=states, rounds=rounds, seed=seed)
    return states, votes


# --- the bench's figures -------------------------------------------------------------------

def test_a_voter_who_always_prefers_b_separates_them_within_40_votes_but_not_after_two():
    votes = [Vote("A", "B", "b") if i % 2 else Vote("B", "A", "a") for i in range(40)]
    n = votes_to_separate(votes, "A", "B")
    assert n is not None and 2 < n <= 40
    board = by_state(standings(votes[:n]))
    assert board["B"].low > board["A"].high
    # a couple of unanimous votes is not enough: the intervals still overlap
    two = by_state(standings(votes[:2]))
    assert not separated(two["A"], two["B"])


def test_without_the_prior_two_unanimous_votes_give_zero_width_intervals():
    """Why the prior exists: the plain bootstrap of identical votes has no spread."""
    two = by_state(standings([Vote("A", "B", "b")] * 2, prior=0))
    assert two["B"].low == two["B"].high and separated(two["A"], two["B"])
    with_prior = by_state(standings([Vote("A", "B", "b")] * 2))
    assert abs(with_prior["B"].rating - 1000) < abs(two["B"].rating - 1000)


def test_noisy_voter_with_a_hidden_order_is_ranked_right_after_150_votes():
    strengths = {f"v{i}": 0.5 * i for i in range(5)}   # neighbours: the better wins 62 %
    states, votes = noisy_arena(strengths, n=150, seed=0)
    board = standings(votes, states=states)
    assert kendall_tau(states, board) >= 0.8
    assert sum(x.votes for x in board) == 2 * 150


def test_votes_to_separate_is_none_when_the_votes_never_separate():
    votes = [Vote("A", "B", "a"), Vote("A", "B", "b")] * 10
    assert votes_to_separate(votes, "A", "B", rounds=50) is None


def test_votes_to_separate_rejects_a_state_in_no_vote():
    votes = [Vote("A", "B", "a")] * 3
    with pytest.raises(ValueError, match="appear in no vote"):
        votes_to_separate(votes, "A", "C")
    with pytest.raises(ValueError, match="two different states"):
        votes_to_separate(votes, "A", "A")


def test_kendall_tau_follows_the_board():
    board = [hand("c", 1100, 1050, 1150), hand("b", 1000, 950, 1050), hand("a", 900, 850, 950)]
    assert kendall_tau(["a", "b", "c"], board) == pytest.approx(1.0)
    assert kendall_tau(["c", "b", "a"], board) == pytest.approx(-1.0)
    assert kendall_tau(["b", "a", "c"], board) == pytest.approx(1 / 3)
    assert kendall_tau(["a", "b"], [hand("a", 1000, 0, 2000), hand("b", 1000, 0, 2000)]) == 0.0
    with pytest.raises(ValueError, match="not on the board"):
        kendall_tau(["a", "z"], board)


def test_per_voter_counts_most_first():
    votes = [Vote("A", "B", "a", voter="x")] + [Vote("A", "B", "b", voter="y")] * 3 + [Vote("A", "B", TIE)]
    assert list(per_voter(votes).items()) == [("y", 3), ("x", 1), ("", 1)]
    assert per_voter([]) == {}


# --- the fit -------------------------------------------------------------------------------

def test_a_tie_counts_half_a_win():
    win_tie = by_state(standings([Vote("A", "B", "a"), Vote("A", "B", TIE)]))
    two_wins = by_state(standings([Vote("A", "B", "a"), Vote("A", "B", "a")]))
    assert win_tie["A"].rating > win_tie["B"].rating
    assert win_tie["A"].rating - win_tie["B"].rating < two_wins["A"].rating - two_wins["B"].rating
    a = win_tie["A"]
    assert (a.votes, a.wins, a.losses, a.ties) == (2, 1, 0, 1)


def test_a_tie_is_exactly_half_a_win_without_the_prior():
    """One win + one tie = 3 : 1 in half-wins, so theta_A - theta_B = ln 3 (alpha is tiny)."""
    board = by_state(standings([Vote("A", "B", "a"), Vote("A", "B", TIE)], prior=0, alpha=1e-6))
    gap = board["A"].rating - board["B"].rating
    assert gap == pytest.approx(400 * math.log(3) / math.log(10), rel=1e-3)


def test_symmetric_votes_give_equal_ratings():
    split = by_state(standings([Vote("A", "B", "a"), Vote("A", "B", "b")] * 3, rounds=20))
    assert split["A"].rating == pytest.approx(split["B"].rating) == pytest.approx(1000)
    cycle = standings([Vote("A", "B", "a"), Vote("B", "C", "a"), Vote("C", "A", "a")], rounds=20)
    assert [x.rating for x in cycle] == pytest.approx([1000, 1000, 1000])
    ties = standings([Vote("A", "B", TIE)] * 5, rounds=20)
    assert [x.rating for x in ties] == pytest.approx([1000, 1000])


def test_ratings_are_sorted_best_first_and_mean_centred():
    votes = [Vote("A", "B", "b"), Vote("B", "C", "b"), Vote("A", "C", "b")] * 4
    board = standings(votes)
    assert [x.state for x in board] == ["C", "B", "A"]
    assert sum(x.rating for x in board) / 3 == pytest.approx(1000)


def test_intervals_contain_the_rating():
    rng = random.Random(3)
    for trial in range(5):
        votes = [Vote(*rng.sample("ABCD", 2), rng.choice(CHOICES)) for _ in range(rng.randrange(1, 40))]
        for x in standings(votes, rounds=30, seed=trial):
            assert x.low <= x.rating <= x.high
    for x in standings([Vote("A", "B", "a")] * 30, rounds=30, prior=0):   # all-win, no prior
        assert x.low <= x.rating <= x.high


def test_a_lower_level_gives_narrower_intervals():
    votes = [Vote("A", "B", "a")] * 6 + [Vote("A", "B", "b")] * 4
    wide, narrow = by_state(standings(votes)), by_state(standings(votes, level=0.5))
    assert narrow["A"].high - narrow["A"].low < wide["A"].high - wide["A"].low


def test_the_same_seed_gives_the_same_board():
    votes = [Vote("A", "B", "a"), Vote("B", "C", "b"), Vote("A", "C", TIE), Vote("C", "A", "a")] * 3
    first, again, other = (standings(votes, rounds=50, seed=s) for s in (7, 7, 8))
    assert first == again
    assert first != other                                          # the intervals differ
    assert [x.rating for x in first] == [x.rating for x in other]  # the point fit does not


def test_no_votes_and_unvoted_states_are_unknown():
    assert standings([]) == []
    board = standings([], states=["base", "step 1"])
    assert [(x.rating, x.low, x.high, x.votes) for x in board] == [(1000, 600, 1000 + 400, 0)] * 2
    assert standings([], states=["base"])[0].rating == 1000
    votes = [Vote("A", "B", "a")] * 20
    board = by_state(standings(votes, states=["A", "B", "new"]))
    new = board["new"]
    assert new.rating == 1000 and new.votes == 0
    assert new.low <= min(board["A"].low, board["B"].low, 600)
    assert new.high >= max(board["A"].high, board["B"].high, 1400)


def test_a_disconnected_comparison_graph_still_fits():
    votes = [Vote("A", "B", "a")] * 5 + [Vote("C", "D", "b")] * 5
    board = by_state(standings(votes, prior=0))
    assert all(math.isfinite(x.rating) and math.isfinite(x.low) and math.isfinite(x.high)
               for x in board.values())
    assert board["A"].rating > board["B"].rating and board["D"].rating > board["C"].rating


def test_standings_is_fast_enough():
    rng = random.Random(0)
    votes = [Vote(*rng.sample(["s0", "s1", "s2", "s3", "s4"], 2), rng.choice(CHOICES)) for _ in range(300)]
    standings(votes, rounds=20)   # choix / scipy imported outside the timing
    start = time.perf_counter()
    standings(votes, rounds=200)
    assert time.perf_counter() - start < 3.0   # ~0.4 s on a 2-core machine


# --- bad inputs ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (("A", "A", "a"), "two different states"),
    (("A", "B", "x"), "winner must be one of"),
    (("", "B", "a"), "non-empty state key"),
    (("A", None, "a"), "non-empty state key"),
])
def test_a_bad_vote_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        Vote(*args)


def test_a_vote_naming_a_state_outside_states_is_refused():
    with pytest.raises(ValueError, match=r"not in `states`.*add them"):
        standings([Vote("A", "B", "a"), Vote("A", "Z", "b")], states=["A", "B"])


@pytest.mark.parametrize("kwargs, message", [
    ({"rounds": 0}, "rounds must be"), ({"alpha": 0.0}, "alpha must be"),
    ({"level": 1.0}, "level must be"), ({"prior": -1}, "prior must be"),
    ({"states": ["A", "B", "A"]}, "distinct"),
])
def test_bad_standings_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        standings([Vote("A", "B", "a")], **kwargs)


def test_choose_pair_needs_two_distinct_states():
    with pytest.raises(ValueError, match="at least 2 states"):
        choose_pair(["base"], None, random.Random(0))
    with pytest.raises(ValueError, match="distinct"):
        choose_pair(["base", "base"], None, random.Random(0))


# --- the next pair -------------------------------------------------------------------------

def test_choose_pair_asks_about_the_newest_state_with_few_votes_first():
    rng = random.Random(0)
    # no board yet: the newest state with its older neighbour
    for _ in range(20):
        assert set(choose_pair(["base", "step 1", "step 2"], None, rng)) == {"step 1", "step 2"}
    assert set(choose_pair(["base", "step 1"], None, rng)) == {"base", "step 1"}
    # with a board: the newest state short of votes, with the state rated nearest it
    board = [hand("base", 900, 850, 950, votes=30), hand("step 1", 1080, 1000, 1150, votes=2),
             hand("step 2", 1110, 1060, 1160, votes=30), hand("step 3", 1000, 600, 1400, votes=0)]
    states = ["base", "step 1", "step 2", "step 3"]
    picks = Counter(frozenset(choose_pair(states, board, rng)) for _ in range(50))
    assert picks == {frozenset({"step 3", "step 1"}): 50}   # |1000-1080| beats |1000-900|
    board[3] = hand("step 3", 1050, 1000, 1100, votes=6)     # step 3 has enough: step 1 next
    assert set(choose_pair(states, board, rng)) == {"step 1", "step 3"}   # 30 either way: the newer


def test_choose_pair_treats_a_state_missing_from_the_board_as_new():
    board = [hand("base", 1000, 900, 1100, votes=40), hand("step 1", 1000, 900, 1100, votes=40)]
    pair = choose_pair(["base", "step 1", "step 2"], board, random.Random(1))
    assert "step 2" in pair


def test_choose_pair_prefers_overlapping_pairs_but_still_asks_separated_ones():
    board = [hand("base", 800, 750, 850), hand("step 1", 1000, 950, 1060), hand("step 2", 1010, 960, 1070)]
    rng = random.Random(0)
    draws = [choose_pair(["base", "step 1", "step 2"], board, rng) for _ in range(600)]
    pairs = Counter(frozenset(p) for p in draws)
    unsettled = pairs[frozenset({"step 1", "step 2"})]
    assert unsettled > 0.8 * len(draws)
    assert 0 < len(draws) - unsettled < 0.2 * len(draws)   # separated pairs now and then
    sides = Counter(p[0] for p in draws if set(p) == {"step 1", "step 2"})
    assert sides["step 1"] > 0.35 * unsettled and sides["step 2"] > 0.35 * unsettled   # random a/b


def test_choose_pair_prefers_neighbours_in_rating():
    # every interval overlaps every other the same; the non-neighbours (a, c) count half
    board = [hand("a", 990, 900, 1100), hand("b", 1000, 900, 1100), hand("c", 1010, 900, 1100)]
    rng = random.Random(0)
    pairs = Counter(frozenset(choose_pair(["a", "b", "c"], board, rng)) for _ in range(900))
    assert pairs[frozenset({"a", "c"})] < 0.7 * min(pairs[frozenset({"a", "b"})], pairs[frozenset({"b", "c"})])


def test_choose_pair_is_deterministic_for_a_seeded_rng():
    board = standings([Vote("A", "B", "a"), Vote("B", "C", TIE), Vote("C", "D", "b")] * 3)
    first = [choose_pair("ABCD", board, random.Random(5), min_votes=2) for _ in range(5)]
    again = [choose_pair("ABCD", board, random.Random(5), min_votes=2) for _ in range(5)]
    assert first == again


# --- overlap / separated -------------------------------------------------------------------

def test_overlap_and_separated_on_hand_made_intervals():
    x = hand("x", 5, 0, 10)
    assert overlap(x, hand("y", 12, 5, 15)) == pytest.approx(5 / 15)
    assert overlap(x, hand("y", 5, 0, 10)) == 1.0
    assert overlap(x, hand("y", 3, 2, 4)) == pytest.approx(2 / 10)
    assert overlap(x, hand("y", 30, 20, 40)) == 0.0
    assert overlap(hand("p", 1, 1, 1), hand("q", 1, 1, 1)) == 1.0
    assert separated(x, hand("y", 30, 20, 40)) and separated(hand("y", 30, 20, 40), x)
    assert not separated(x, hand("y", 12, 5, 15))
    assert not separated(x, hand("y", 15, 10, 20))   # touching ends still overlap
