"""docs/results/derive.py: every headline figure of the issue-13 section of the dated record
(docs/results/archive/2026-11.md) and the earlier runs' train-batch figures there, re-derived from
the raw JSON/JSONL in docs/results."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "results")
SCRIPT = os.path.join(RESULTS, "derive.py")
RECORD = os.path.join(RESULTS, "archive", "2026-11.md")   # the month whose sections derive.py checks


@pytest.fixture(scope="module")
def derive():
    spec = importlib.util.spec_from_file_location("results_derive", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def record():
    with open(RECORD) as f:
        return f.read()


def test_every_figure_in_the_text_matches_the_files():
    out = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every figure matches the files" in out.stdout


@pytest.mark.parametrize("right, wrong", [
    ("22 of 48 steps' batches", "26 of 48 steps' batches"),        # steps with a flat prompt, not prompts
    ("(0.062 = 4 of 32 answers", "(0.062 = 2 of 32 answers"),      # the eval JSON's cooperating answers
    ("zero-variance groups 5% -> 15%", "zero-variance groups 0% -> 25%"),  # 10-step means, not single steps
    ("| ours, step 30 | 18.6 | 1.818 |", "| ours, step 30 | 18.6 | 1.819 |"),
    ("+0.264** | +0.142 .. +0.386 | 17 / 12 / 3", "+0.264** | +0.142 .. +0.386 | 17 / 13 / 2"),
])
def test_a_figure_that_disagrees_with_the_files_is_named(derive, record, right, wrong):
    assert right in record
    rows = derive.compare(record.replace(right, wrong))
    bad = [(phrase, said, derived) for phrase, said, derived in rows if said != derived]
    assert len(bad) == 1, bad
    assert bad[0][1] is not None and bad[0][1] != bad[0][2]


def test_a_phrase_gone_from_the_text_is_a_mismatch_not_a_pass(derive, record):
    rows = derive.compare(record.replace("fires on 11 of 48 training steps", "fires on some training steps"))
    assert [said for _, said, _ in rows if said is None] == [None]
