"""The run plots (collab_app/web/plots.py): eval points placed at the training minutes before them."""
from __future__ import annotations

import pytest

from collab_app.web.plots import eval_minutes, minutes_figure, summary_figure

RECORDS = [
    {"kind": "eval", "step": 0, "return_mean": 1.0},
    {"kind": "train", "step": 1, "return_mean": 0.5, "time/rollout_s": 30.0, "time/update_s": 25.0, "time/save_s": 5.0},
    {"kind": "train", "step": 2, "return_mean": 0.7, "time/rollout_s": 60.0, "time/reward_s": 0.0, "level/tests": 0.1},
    {"kind": "eval", "step": 2, "return_mean": 1.5, "seconds": 99.0, "level/tests": 0.2},
]


def test_eval_minutes_count_training_time_only():
    # 60 s + 60 s of train-step time; the eval's own 99 s is not training
    assert eval_minutes(RECORDS) == [(0.0, 1.0), (pytest.approx(2.0), 1.5)]


def test_figures_draw(tmp_path):
    fig = minutes_figure({"ours": eval_minutes(RECORDS), "theirs": [(0.0, 1.0), (2.0, 1.1)]}, "t", target=2.0)
    fig.savefig(tmp_path / "m.png")
    summary_figure(RECORDS).savefig(tmp_path / "s.png")
    assert (tmp_path / "m.png").stat().st_size > 5_000 and (tmp_path / "s.png").stat().st_size > 5_000
