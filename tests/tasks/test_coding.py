"""Coding tasks: code extraction on messy model text, test splitting, every reward level and
gate, cooperation cases, feedback, HumanEval reference solutions, CustomCodingTask.

Tests that score through the sandbox cost ~0.2 s each; the rest never start a process.
"""
from __future__ import annotations

import pytest

import tasks.coding as coding
from tasks.base import Turn
from tasks.coding import (CustomCodingTask, HumanEvalTask, SandboxFailure, cooperation, defines_own_aux,
                          extract_code, split_tests)
from tasks.sandbox import Limits, SandboxResult, TestResult

# custom coding problems of this module's own must run here, whatever the sandbox level (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("people_code_runs_here")

# ------------------------------------------------------------------------------ extraction


def test_extract_python_fence_with_prose():
    text = "Sure! Here is the helper:\n```python\ndef aux(x):\n    return x + 1\n```\nIt adds one."
    ex = extract_code(text)
    assert set(ex.functions) == {"aux"}
    assert ex.functions["aux"].source == "def aux(x):\n    return x + 1"
    assert ex.functions["aux"].parses and ex.functions["aux"].returns_value


@pytest.mark.parametrize("fence", ["```py", "```", "```Python3", "``` python"])
def test_extract_other_fences(fence):
    ex = extract_code(f"{fence}\ndef aux(x):\n    return 2 * x\n```")
    assert ex.functions["aux"].source == "def aux(x):\n    return 2 * x"


def test_extract_without_fences_prose_around_code():
    text = ("To solve this we loop.\n\nimport math\ndef f(n):\n    # comment\n    return math.sqrt(n)\n\n"
            "This works because sqrt is fast.\nHope it helps!")
    ex = extract_code(text)
    assert ex.functions["f"].source == "def f(n):\n    # comment\n    return math.sqrt(n)"
    assert ex.functions["f"].parses
    assert ex.imports == ("import math",)


def test_extract_several_blocks_and_non_python_fence_dropped():
    text = ("```python\nimport re\ndef aux(s):\n    return s.strip()\n```\nRun it:\n```bash\n"
            "def not_python():\n    return 1\n```\nand\n```python\ndef main(s):\n    return aux(s)\n```")
    ex = extract_code(text)
    assert set(ex.functions) == {"aux", "main"}
    assert ex.imports == ("import re",)


def test_extract_duplicates_last_good_definition_wins():
    text = ("```python\ndef aux(x):\n    return x\n```\nBetter version:\n```python\ndef aux(x):\n"
            "    return x * 10\n```\nOops, a draft:\n```python\ndef aux(x):\n    pass\n```")
    assert extract_code(text).functions["aux"].source.endswith("return x * 10")
    # among definitions that all return, the last one wins
    two = "def g():\n    return 1\n\ndef g():\n    return 2\n"
    assert extract_code(two).functions["g"].source.endswith("return 2")


def test_extract_indentation_junk_and_unclosed_fence():
    text = "Answer:\n```python\n    def aux(xs):\n        total = 0\n        for x in xs:\n            total += x\n        return total"
    fn = extract_code(text).functions["aux"]
    assert fn.parses and fn.source.startswith("def aux(xs):\n    total = 0")


def test_extract_closing_fence_glued_to_code():
    fn = extract_code("```python\ndef aux(x):\n    return x```\nThat's it.").functions["aux"]
    assert fn.parses and fn.source == "def aux(x):\n    return x"


def test_extract_line_scan_keeps_a_broken_function_as_unparsed():
    text = ("Here you go:\ndef aux(a,\n        b) -> int:\n    return a + b\n\nand main:\n"
            "def main(x):\n    return aux(x, 1\n\nDone.")
    ex = extract_code(text)
    assert ex.functions["aux"].parses and ex.functions["aux"].returns_value
    assert not ex.functions["main"].parses and ex.functions["main"].returns_value


def test_extract_nothing():
    assert extract_code("I don't know how to do this.").functions == {}
    assert extract_code("").functions == {}


# ----------------------------------------------------------------------------- test split


def test_split_check_function_into_asserts_and_loops():
    src = ("import math\nMETADATA = {}\n\ndef check(candidate):\n    '''doc'''\n    assert True\n"
           "    assert candidate(1) == 2\n    xs = [1, 2]\n    for x in xs:\n        assert candidate(x) > x\n"
           "    assert candidate(0) == 1, 'zero'\n")
    setup, tests = split_tests(src)
    assert "import math" in setup and "METADATA" in setup and "check" not in setup
    assert len(tests) == 3
    assert tests[0] == "assert True\nassert candidate(1) == 2"  # `assert True` is context, not a test
    assert tests[1].startswith("xs = [1, 2]\nfor x in xs:")
    assert tests[2] == "assert candidate(0) == 1, 'zero'"


def test_split_plain_asserts():
    setup, tests = split_tests("def helper():\n    return 3\nassert f(1) == 1\nassert f(helper()) == 9\n")
    assert setup == ""
    assert tests == ["def helper():\n    return 3\nassert f(1) == 1", "assert f(helper()) == 9"]


@pytest.mark.parametrize("bad,msg", [("assert f(1) == ", "not valid Python"),
                                     ("x = 1\nprint(x)", "no tests found"),
                                     ("def check(candidate):\n    assert True\n", "no tests found")])
def test_split_bad_tests(bad, msg):
    with pytest.raises(ValueError, match=msg):
        split_tests(bad)


def test_humaneval_split_and_loading():
    t = HumanEvalTask()
    ev, tr = t.examples("eval"), t.examples("train")
    assert [e["id"] for e in ev] == [f"HumanEval/{i}" for i in range(32)]
    assert len(tr) == 132 and tr[0]["id"] == "HumanEval/32"
    assert all(e["tests"] for e in ev + tr)
    # HumanEval/0 has 7 asserts in check(candidate); HumanEval/10's prompt defines a helper
    assert len(ev[0]["tests"]) == 7
    assert "def is_palindrome" in ev[10]["context"] and "def make_palindrome" not in ev[10]["context"]
    with pytest.raises(ValueError, match="split"):
        t.examples("test")


# ---------------------------------------------------------------------------------- levels

HE0 = HumanEvalTask().examples("eval")[0]  # has_close_elements(numbers, threshold), 7 asserts
AUX_GOOD = "```python\ndef aux(a, b):\n    return abs(a - b)\n```"
MAIN_GOOD = """```python
def has_close_elements(numbers, threshold):
    for i, x in enumerate(numbers):
        for j, y in enumerate(numbers):
            if i != j and aux(x, y) < threshold:
                return True
    return False
```"""


@pytest.fixture(scope="module")
def task():
    return HumanEvalTask()


def test_full_marks(task):
    r = task.reward(HE0, [AUX_GOOD, MAIN_GOOD])
    assert r.levels == {"structure": 1.0, "syntax": 0.5, "tests": 1.0, "cooperation": 1.5}
    assert r.total == 4.0 and r.max_total == 4.0
    assert r.details["tests_passed"] == r.details["tests_total"] == 7


def test_structure_gate_no_main_stops(task, monkeypatch):
    monkeypatch.setattr(coding, "run_tests", _no_sandbox)
    r = task.reward(HE0, [AUX_GOOD, "I think you should loop over the numbers."])
    assert r.levels == {"structure": 0.4, "syntax": 0.0, "tests": 0.0, "cooperation": 0.0}
    assert r.details["stopped_at"] == "structure"
    # a main without `return <value>` is not "defined" either (reference: needs a return)
    r = task.reward(HE0, [AUX_GOOD, "def has_close_elements(numbers, threshold):\n    print(numbers)\n"])
    assert r.levels["structure"] == 0.4 and r.total == 0.4


def test_structure_missing_aux_only_loses_its_share(task):
    main_alone = MAIN_GOOD.replace("aux(x, y)", "abs(x - y)")
    r = task.reward(HE0, ["no helper today", main_alone])
    assert r.levels == {"structure": 0.6, "syntax": 0.5, "tests": 1.0, "cooperation": 0.0}


def test_syntax_gate_stops(task, monkeypatch):
    monkeypatch.setattr(coding, "run_tests", _no_sandbox)
    broken = "def has_close_elements(numbers, threshold):\n    if numbers\n        return True\n    return False\n"
    r = task.reward(HE0, [AUX_GOOD, broken])
    assert r.levels == {"structure": 1.0, "syntax": 0.0, "tests": 0.0, "cooperation": 0.0}
    assert r.details["stopped_at"] == "syntax" and "line" in r.details["syntax_error"]


def test_thin_wrapper_gets_no_anti_wrapper_bonus(task):
    aux = "def aux(numbers, threshold):\n    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])"
    wrappers = ["def has_close_elements(numbers, threshold):\n    '''doc'''\n    return aux(numbers, threshold)",
                "def has_close_elements(numbers, threshold):\n    r = aux(numbers, threshold)\n    return r"]
    for main in wrappers:
        r = task.reward(HE0, [aux, main])
        assert r.levels == {"structure": 1.0, "syntax": 0.5, "tests": 1.0, "cooperation": 0.5}, main


def test_ignored_aux_result_is_penalised(task):
    main = MAIN_GOOD.replace("    for i, x", "    aux(0, 0)\n    for i, x")
    r = task.reward(HE0, [AUX_GOOD, main])
    assert r.levels["cooperation"] == 1.0  # +0.5 calls, +1.0 not a wrapper, -0.5 ignored
    assert r.details["ignores_aux"] and not r.details["thin_wrapper"]
    assert r.total == 3.5


def test_no_passing_test_means_no_cooperation_and_partial_tests(task):
    never = MAIN_GOOD.replace("return True\n    return False", "return False\n    return aux(1, 1) > 5")
    r = task.reward(HE0, [AUX_GOOD, never])  # always False: only the 3 "== False" asserts pass
    # `return aux(1, 1) > 5` depends on aux (+0.5 +1.0); the loop's call does not: whatever
    # aux says there, main returns False (-0.5, ignored)
    assert r.levels["tests"] == pytest.approx(3 / 7) and r.levels["cooperation"] == 1.0
    assert r.details["aux_reaches_return"] and r.details["ignored_sites"] == ["line 4 of has_close_elements"]
    nothing = MAIN_GOOD.replace("return True\n    return False", "return 'x'\n    return 'y'")
    r = task.reward(HE0, [AUX_GOOD, nothing])
    assert r.levels["tests"] == 0.0 and r.levels["cooperation"] == 0.0
    assert r.details["first_failure"]["test"].startswith("assert candidate(")


def test_main_with_its_own_aux_earns_nothing(task):
    own = MAIN_GOOD.replace("    for i, x", "    def aux(a, b):\n        return abs(a - b)\n    for i, x")
    r = task.reward(HE0, [AUX_GOOD, own])
    assert r.levels["tests"] == 1.0 and r.levels["cooperation"] == 0.0  # the helper's aux never runs
    assert not r.details["calls_aux"] and r.details["own_aux"]
    assert "defines its own `aux`" in task.feedback(HE0, [AUX_GOOD, own])[1]
    assert defines_own_aux("def f(x):\n    aux = abs\n    return aux(x)")
    assert not defines_own_aux("def f(x):\n    return aux(x)") and not defines_own_aux("not python(")


# ------------------------------------------------------------------- cooperation hacks
# Issue 11: each of these earned the full 1.5 while cooperation was read off main's source.

INDEPENDENT = """
    for i, x in enumerate(numbers):
        for j, y in enumerate(numbers):
            if i != j and abs(x - y) < threshold:
                return True
    return False"""
SIG = "def has_close_elements(numbers, threshold):"


@pytest.mark.parametrize("name,main", [
    ("result assigned and dropped", SIG + "\n    _ = aux(numbers[0], threshold) if numbers else 0" + INDEPENDENT),
    ("call never runs", SIG + "\n    if False:\n        aux(0, 0)" + INDEPENDENT),
    ("result multiplied away", SIG + "\n    r = aux(1.0, 2.0)\n    found = bool(r * 0)" +
     INDEPENDENT.replace("return True", "return True or found")),
    ("both branches return the same", SIG + "\n    if aux(1.0, 2.0) > 0:\n        pass" + INDEPENDENT),
])
def test_cooperation_hacks_earn_nothing(task, name, main):
    r = task.reward(HE0, [AUX_GOOD, main])
    assert r.levels["tests"] == 1.0, (name, r.details)
    assert r.levels["cooperation"] == 0.0, (name, r.details)
    assert r.total == 2.5 and not r.details["aux_reaches_return"]
    assert r.details["calls_aux"] == (name != "call never runs")


def test_renamed_thin_wrapper_earns_only_the_wrappers_half_point(task):
    """`r = aux(x); r = r; return r` is a thin wrapper at run time, like `return aux(x)`: the
    paper's +0.5 for calling aux while a test passes, never the +1.0 for real work in main."""
    aux = ("def aux(numbers, threshold):\n    return any(abs(a - b) < threshold "
           "for i, a in enumerate(numbers) for b in numbers[i + 1:])")
    for body in ["r = aux(numbers, threshold)\n    r = r\n    return r",
                 "r = aux(numbers, threshold)\n    out = r\n    return bool(out)",
                 "return aux(numbers, threshold)"]:
        r = task.reward(HE0, [aux, f"{SIG}\n    {body}"])
        assert r.levels == {"structure": 1.0, "syntax": 0.5, "tests": 1.0, "cooperation": 0.5}, body
        assert r.details["thin_wrapper"] and r.details["aux_reaches_return"]


# ------------------------------------------------------------- cooperation, legitimate uses

def test_aux_computes_a_part_and_main_combines_it():
    t = CustomCodingTask('def hypot(a, b):\n    """Length of the hypotenuse."""\n',
                         "assert hypot(3, 4) == 5.0\nassert hypot(5, 12) == 13.0\nassert hypot(0, 0) == 0.0")
    r = t.reward(t.example, ["def aux(x):\n    return x * x", "def hypot(a, b):\n    return (aux(a) + aux(b)) ** 0.5"])
    assert r.levels["cooperation"] == 1.5 and r.total == 4.0, r.details
    assert r.details["aux_calls"] == 6 and not r.details["ignores_aux"]


def test_aux_called_in_a_loop():
    t = CustomCodingTask('def total_length(words):\n    """Sum of the lengths of the words."""\n',
                         "assert total_length(['ab', 'c']) == 3\nassert total_length([]) == 0\n"
                         "assert total_length(['hello', 'x', 'yz']) == 8")
    main = "def total_length(words):\n    n = 0\n    for w in words:\n        n += aux(w)\n    return n"
    r = t.reward(t.example, ["def aux(w):\n    return len(w)", main])
    # the passing test where aux never runs (the empty list) takes nothing away
    assert r.levels["cooperation"] == 1.5 and r.details["aux_calls"] == 5, r.details


def test_aux_result_transformed_before_return():
    t = CustomCodingTask('def shout(s):\n    """s without surrounding spaces, in upper case, with a !"""\n',
                         "assert shout(' hi ') == 'HI!'\nassert shout('ok') == 'OK!'")
    r = t.reward(t.example, ["def aux(s):\n    return s.strip()", "def shout(s):\n    return aux(s).upper() + '!'"])
    assert r.levels["cooperation"] == 1.5, r.details
    t = CustomCodingTask('def desc(xs):\n    """xs sorted, largest first."""\n',
                         "assert desc([1, 3, 2]) == [3, 2, 1]\nassert desc([5, 4]) == [5, 4]")
    r = t.reward(t.example, ["def aux(xs):\n    return sorted(xs)", "def desc(xs):\n    return aux(xs)[::-1]"])
    assert r.levels["cooperation"] == 1.5, r.details


def test_aux_result_used_only_as_a_condition_still_counts():
    t = CustomCodingTask('def sign(x):\n    """1, 0 or -1."""\n',
                         "assert sign(5) == 1\nassert sign(-2) == -1\nassert sign(0) == 0")
    main = "def sign(x):\n    if aux(x):\n        return 1\n    if x == 0:\n        return 0\n    return -1"
    r = t.reward(t.example, ["def aux(x):\n    return x > 0", main])
    assert r.levels["cooperation"] == 1.5, r.details


def test_cooperation_aggregation():
    """From probe findings to the level: inconclusive tests count for nothing, one ignored call
    site costs 0.5, one non-wrapper test is enough for the +1.0."""
    def ok(calls, wrapper, sites):
        return {"status": "ok", "aux_calls": calls, "wrapper": wrapper, "sites": sites}

    def probe(*ts):
        return {"tests": dict(enumerate(ts)), "complete": True, "error": None}

    assert cooperation(None)[0] == 0.0
    assert cooperation(probe(ok(0, False, {})))[0] == 0.0
    assert cooperation(probe(ok(2, False, {"f:2:10": False})))[0] == 0.0
    assert cooperation(probe(ok(2, False, {"f:2:10": True})))[0] == 1.5
    assert cooperation(probe(ok(2, True, {"f:2:10": True})))[0] == 0.5
    assert cooperation(probe(ok(2, True, {"f:2:10": True}), ok(1, False, {"f:2:10": True})))[0] == 1.5
    score, info = cooperation(probe(ok(2, False, {"f:2:10": True, "f:3:40": False})))
    assert score == 1.0 and info["ignored_sites"] == ["line 3 of f"]
    score, info = cooperation(probe({"status": "nondeterministic", "aux_calls": 2, "wrapper": False, "sites": {}}))
    assert score == 0.0 and info["tests_inconclusive"] == 1


def test_timeout_and_crash_are_the_candidates_fault(task):
    quick = HumanEvalTask(limits=Limits(timeout_s=2, cpu_s=2))
    loop = "def has_close_elements(numbers, threshold):\n    while True:\n        pass\n    return False"
    r = quick.reward(HE0, [AUX_GOOD, loop])
    assert r.levels["tests"] == 0.0 and r.details["killed_by"] in ("timeout", "cpu")
    exits = "import os\ndef has_close_elements(numbers, threshold):\n    os._exit(0)\n    return False"
    r = task.reward(HE0, [AUX_GOOD, exits])
    assert r.levels["tests"] == 0.0 and r.details["harness_ok"] is False


def _no_sandbox(*a, **k):
    raise AssertionError("this case must not reach the sandbox")


def test_sandbox_failure_raises_instead_of_a_silent_zero(task, monkeypatch):
    def broken(code, tests, limits, setup="", probe=None):
        return SandboxResult(
            tests=[TestResult(i, t, False, "did not run") for i, t in enumerate(tests)],
            setup_error="the sandbox failed to start (exit code 70; see stderr)", timed_out=False,
            killed_by=None, exit_code=70, stdout="", stderr="boom", harness_ok=False, duration_s=0.0)
    monkeypatch.setattr(coding, "run_tests", broken)
    with pytest.raises(SandboxFailure, match="not the candidate"):
        HumanEvalTask().reward(HE0, [AUX_GOOD, MAIN_GOOD])


# ------------------------------------------------------------------------------- feedback


def test_feedback_texts(task, monkeypatch):
    wrong = "def has_close_elements(numbers, threshold):\n    return False"
    r = task.reward(HE0, [AUX_GOOD, wrong])
    monkeypatch.setattr(coding, "run_tests", _no_sandbox)  # feedback reuses reward's run
    fb = task.feedback(HE0, [AUX_GOOD, wrong])
    assert len(fb) == 2 and fb[0] != fb[1]
    for text in fb:
        assert f"Score {r.total:.2f}" in text and "Tests: 3/7 passed" in text
        assert "First failing test:\nassert has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True" in text
        assert "AssertionError" in text and "does not call `aux` while a test passes" in text
    assert "`aux`" in fb[0] and "has_close_elements" in fb[1]
    gated = task.feedback(HE0, ["", ""])
    assert "`aux` is missing; `has_close_elements` is missing." in gated[0] and "Stopped" in gated[0]
    assert "You did not write a function named `aux`" in gated[0]
    assert "You did not write `has_close_elements`" in gated[1]


# ------------------------------------------------------------------ reference solutions


@pytest.mark.parametrize("idx", [0, 10, 32])
def test_canonical_solutions_score_as_expected(task, idx):
    t = HumanEvalTask()
    ex = (t.examples("eval") + t.examples("train"))[idx]
    main = ex["prompt"] + ex["canonical_solution"]  # main only: no aux call
    r = t.reward(ex, ["def aux(x):\n    return x", main])
    assert r.levels == {"structure": 1.0, "syntax": 0.5, "tests": 1.0, "cooperation": 0.0}, r.details


def test_single_agent_variant():
    t = HumanEvalTask(num_agents=1)
    assert t.roles == ("coder",)
    one = AUX_GOOD + "\nAnd the main function:\n" + MAIN_GOOD
    assert t.reward(HE0, [one]).total == 4.0
    assert "def aux" in t.combine(HE0, [one]) and len(t.feedback(HE0, [one])) == 1
    with pytest.raises(ValueError):
        HumanEvalTask(num_agents=3)


# ------------------------------------------------------------------------------- prompts


def test_prompts_roles_sequential_and_history(task):
    p = task.agent_prompts(HE0, [])
    # the contract as code: aux takes the entry function's exact parameters; main starts from the call
    assert "def has_close_elements" in p[0] and "def aux(numbers: List[float], threshold: float):" in p[0]
    assert "def has_close_elements(numbers: List[float], threshold: float):\n    result = aux(numbers, threshold)" in p[1]
    assert "Do not define `aux`" in p[1]
    seq = task.agent_prompts(HE0, [], earlier=("def aux(a, b):\n    return a",))
    assert "Your teammate's helper:" in seq[1] and "return a" in seq[1] and seq[0] == p[0]
    hist = task.agent_prompts(HE0, [Turn(("OUT-A", "OUT-B"), ("FB-A", "FB-B"))])
    assert "OUT-A" in hist[0] and "FB-A" in hist[0] and "OUT-B" in hist[1] and "FB-B" in hist[1]
    assert "OUT-B" not in hist[0]


def test_signature_passes_every_kind_of_parameter_on():
    from tasks.coding import _signature

    from tasks.coding import make_example

    ex = make_example("x", 'def f(a, /, b: int = 1, *c, d, **e):\n    """doc"""\n', "assert f(1, d=2) is None")
    assert _signature(ex) == ("(a, /, b: int=1, *c, d, **e)", "a, b, *c, d=d, **e")


def test_combine_keeps_prompt_context_and_imports(task):
    ex10 = task.examples("eval")[10]
    prog = task.combine(ex10, ["import math\ndef aux(s):\n    return s[::-1]", "def make_palindrome(s):\n    return s"])
    assert prog.index("def is_palindrome") < prog.index("import math") < prog.index("def aux") < prog.index("def make_palindrome")


# --------------------------------------------------------------------- CustomCodingTask

PROMPT = 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n'


def test_custom_with_plain_asserts():
    t = CustomCodingTask(PROMPT, "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 5\n")
    assert t.example["entry_point"] == "add" and t.examples("train") == t.examples("eval") == [t.example]
    r = t.reward(t.example, ["def aux(a, b):\n    return a + b", "def add(a, b):\n    s = aux(a, 0)\n    return int(s) + b"])
    assert r.levels == {"structure": 1.0, "syntax": 0.5, "tests": pytest.approx(2 / 3), "cooperation": 1.5}
    # int() of aux's int adds nothing: a thin wrapper at run time
    r = t.reward(t.example, ["def aux(a, b):\n    return a + b", "def add(a, b):\n    s = aux(a, b)\n    return int(s)"])
    assert r.levels["cooperation"] == 0.5 and r.details["thin_wrapper"]


def test_custom_with_check_candidate_and_inferred_entry():
    prompt = "import math\n\ndef helper(x):\n    return x\n\ndef area(r):\n    '''Circle area.'''\n"
    tests = "def check(candidate):\n    assert abs(candidate(1) - math.pi) < 1e-9\n    assert candidate(0) == 0\n"
    t = CustomCodingTask(prompt, tests)
    assert t.example["entry_point"] == "area" and len(t.example["tests"]) == 2
    aux = "def aux(r):\n    return r * r"
    r = t.reward(t.example, [aux, "def area(r):\n    sq = aux(r)\n    return math.pi * sq"])
    assert r.levels["tests"] == 1.0 and r.total == 4.0
    # main combines aux's part in its one `return`: not a thin wrapper (the reference's regex says it is)
    r = t.reward(t.example, [aux, "def area(r):\n    return math.pi * aux(r)"])
    assert r.levels["cooperation"] == 1.5 and not r.details["thin_wrapper"]


@pytest.mark.parametrize("kw,msg", [
    (dict(prompt=PROMPT, tests="assert add(1, 2) = 3"), "tests are not valid Python"),
    (dict(prompt=PROMPT, tests="print('hi')"), "no tests found"),
    (dict(prompt="no code here at all", tests="assert True"), "prompt"),
    (dict(prompt="x = 1\n", tests="assert True"), "defines no function"),
    (dict(prompt=PROMPT, tests="assert add(1, 1) == 2", entry_point="sub"), "not defined in the prompt"),
])
def test_custom_bad_input(kw, msg):
    with pytest.raises(ValueError, match=msg):
        CustomCodingTask(**kw)


def test_custom_bare_signature_prompt():
    t = CustomCodingTask("def double(x):", "assert double(2) == 4")
    assert t.example["entry_point"] == "double"
