"""The cooperation level's run-time rule (tasks/coding.py's module doc) on the cases where an
answer could game it or where real cooperation could be under-credited: calls whose results
cancel out, a thin wrapper behind a type conversion, results kept by reference and changed in
place, results combined with max().

Each case scores a real answer through the sandbox (~0.3 s each).
"""
from __future__ import annotations

import pytest

from tasks.coding import CustomCodingTask

# custom coding problems of this module's own must run here, whatever the sandbox level (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("people_code_runs_here")

# Totals without cooperation: structure 1.0 + syntax 0.5 + tests 1.0.
NO_COOPERATION = 2.5


def _score(prompt, tests, aux, main):
    t = CustomCodingTask(prompt, tests)
    return t.reward(t.example, [aux, main])


# ------------------------------------------------------------------- cancelling calls

DOUBLE = ('def double(n):\n    """2 * n."""\n', "assert double(2) == 4\nassert double(0) == 0\nassert double(-3) == -6")
SCALE = ('def tenth(x):\n    """x / 10."""\n',
         "assert abs(tenth(1) - 0.1) < 1e-9\nassert abs(tenth(3) - 0.3) < 1e-9")


@pytest.mark.parametrize("problem,aux,gamed,honest", [
    (DOUBLE, "def aux(n):\n    return n * n",
     "def double(n):\n    return n + n + aux(n) - aux(n)", "def double(n):\n    return n + n"),
    # floats: (s + p) - p is s only up to rounding; a rounding-sized change is not a dependence
    (SCALE, "def aux(x):\n    return x * x / 7",
     "def tenth(x):\n    return 0.1 * x + aux(x) - aux(x)", "def tenth(x):\n    return 0.1 * x"),
], ids=["int", "float"])
def test_results_that_cancel_out_earn_what_not_calling_aux_earns(problem, aux, gamed, honest):
    """Two calls that return the same value are perturbed together, as if aux were a different
    function: `s + aux(x) - aux(x)` then never depends on aux. It earns exactly what the same
    solution without any aux call earns: 2.5 (cooperation 0), not the full 4.0."""
    g, h = _score(*problem, aux, gamed), _score(*problem, aux, honest)
    assert h.levels["cooperation"] == 0.0 and h.total == NO_COOPERATION and not h.details["calls_aux"]
    assert g.levels["tests"] == 1.0 and g.details["calls_aux"], g.details
    assert g.levels["cooperation"] == 0.0 and g.total == h.total == NO_COOPERATION, g.details
    assert not g.details["aux_reaches_return"]


def test_a_cancelling_pair_beside_a_thin_wrapper_cannot_buy_the_bonus():
    """`aux(n) + aux(n + 1) - aux(n + 1)` is `return aux(n)` plus a pair that cancels out: the
    pair's calls are ignored (-0.5) and what is left is a thin wrapper (0.5)."""
    r = _score(*DOUBLE, "def aux(n):\n    return n * 2", "def double(n):\n    return aux(n) + aux(n + 1) - aux(n + 1)")
    assert r.details["aux_reaches_return"] and r.details["thin_wrapper"] and r.details["ignores_aux"], r.details
    assert r.levels["cooperation"] == 0.0
    assert len(r.details["ignored_sites"]) == 2


# ------------------------------------------------------------- thin wrapper up to a type

@pytest.mark.parametrize("prompt,tests,aux,main", [
    ('def avg(a, b):\n    """The mean as a float."""\n', "assert avg(1, 3) == 2.0\nassert avg(2, 2) == 2.0",
     "def aux(a, b):\n    return (a + b) // 2", "def avg(a, b):\n    return float(aux(a, b))"),
    ('def avg(a, b):\n    """The mean, rounded down."""\n', "assert avg(1, 3) == 2\nassert avg(2, 4) == 3",
     "def aux(a, b):\n    return (a + b) / 2", "def avg(a, b):\n    return int(aux(a, b))"),
    ('def avg(a, b):\n    """The mean as a float."""\n', "assert avg(1, 3) == 2.0\nassert avg(2, 2) == 2.0",
     "def aux(a, b):\n    return (a + b) // 2", "def avg(a, b):\n    return aux(a, b) + 0.0"),
    ('def evens(xs):\n    """The even numbers of xs, as a list."""\n', "assert evens((1, 2, 4)) == [2, 4]\nassert evens(()) == []",
     "def aux(xs):\n    return tuple(x for x in xs if x % 2 == 0)", "def evens(xs):\n    return list(aux(xs))"),
    ('def evens(xs):\n    """The even numbers of xs, as a tuple."""\n', "assert evens([1, 2, 4]) == (2, 4)",
     "def aux(xs):\n    return [x for x in xs if x % 2 == 0]", "def evens(xs):\n    return tuple(aux(xs))"),
    ('def count(xs):\n    """len(xs) as text."""\n', "assert count([1, 2]) == '2'\nassert count([]) == '0'",
     "def aux(xs):\n    return len(xs)", "def count(xs):\n    return str(aux(xs))"),
], ids=["float", "int", "plus-0.0", "list", "tuple", "str"])
def test_a_converted_result_is_still_a_thin_wrapper(prompt, tests, aux, main):
    """main returning aux's result through float()/int()/list()/tuple()/str(), or as an equal
    number of another type, adds nothing: the wrapper's 0.5, not 1.5."""
    r = _score(prompt, tests, aux, main)
    assert r.levels["tests"] == 1.0, r.details
    assert r.details["thin_wrapper"] and r.levels["cooperation"] == 0.5, r.details


# ------------------------------------------------------- results kept by reference, max()

def test_a_result_changed_in_place_is_a_real_use():
    """main keeps aux's list and appends to it: the list main returns is the object aux returned,
    but not the value aux returned -- main did part of the work (1.5)."""
    r = _score('def sorted_zero(xs):\n    """xs sorted, then a 0 at the end."""\n',
               "assert sorted_zero([3, 1]) == [1, 3, 0]\nassert sorted_zero([]) == [0]",
               "def aux(xs):\n    return sorted(xs)", "def sorted_zero(xs):\n    r = aux(xs)\n    r.append(0)\n    return r")
    assert r.levels["tests"] == 1.0 and r.details["aux_reaches_return"], r.details
    assert not r.details["thin_wrapper"] and r.levels["cooperation"] == 1.5, r.details


def test_results_combined_with_max_are_a_real_use():
    """max() of two different aux results: main chooses between them (1.5). max() of the same call
    twice chooses nothing: still the wrapper's 0.5."""
    prompt = 'def longer(a, b):\n    """The length of the longer of two strings."""\n'
    tests = "assert longer('ab', 'cde') == 3\nassert longer('abcd', 'x') == 4\nassert longer('', '') == 0"
    aux = "def aux(s):\n    return len(s)"
    r = _score(prompt, tests, aux, "def longer(a, b):\n    return max(aux(a), aux(b))")
    assert r.levels["tests"] == 1.0 and not r.details["ignores_aux"], r.details
    assert not r.details["thin_wrapper"] and r.levels["cooperation"] == 1.5, r.details
    same = _score('def size(a, b):\n    """len(a)."""\n', "assert size('ab', 'c') == 2\nassert size('', 'x') == 0",
                  aux, "def size(a, b):\n    return max(aux(a), aux(a))")
    assert same.details["thin_wrapper"] and same.levels["cooperation"] == 0.5, same.details


def test_identical_generator_expressions_are_two_call_sites():
    """Two copies of `sum(aux(v) for v in xs)` in main are two sites (same function name, line
    within it and offset): the one whose result is dropped is ignored (1.0), and its verdict
    does not overwrite the used one's."""
    r = _score('def squares(xs):\n    """The sum of the squares."""\n',
               "assert squares([1, 2]) == 5\nassert squares([3, 3, 1]) == 19",
               "def aux(v):\n    return v * v",
               "def squares(xs):\n    r = sum(aux(v) for v in xs)\n    sum(aux(v) for v in xs)\n    return r + 0")
    assert r.details["aux_reaches_return"] and r.details["ignores_aux"], r.details
    assert r.levels["cooperation"] == 1.0 and len(r.details["ignored_sites"]) == 1
