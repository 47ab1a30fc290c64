"""The CPU split between serving and the trainer child (collab_app/online/cpushare.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from collab_app.online.cpushare import CpuSplit, pinned_command, plan


def test_plan_splits_cores_without_overlap():
    assert plan(0, cores=[0, 1], on_gpu=False) == CpuSplit(engine=(0,), trainer=(1,))
    s = plan(0, cores=list(range(16)), on_gpu=False)
    assert s.engine == tuple(range(8)) and s.trainer == tuple(range(8, 16))
    s = plan(3, cores=[2, 5, 7, 9], on_gpu=False)
    assert s.engine == (2, 5, 7) and s.trainer == (9,)


@pytest.mark.parametrize("kw", [dict(engine_cores=-1, cores=[0, 1], on_gpu=False),   # asked for none
                                dict(engine_cores=0, cores=[0, 1], on_gpu=True),     # GPU: no change
                                dict(engine_cores=0, cores=[3], on_gpu=False)])      # one core: nothing to split
def test_no_split(kw):
    assert plan(**kw) is None


def test_bad_engine_cores_say_how_to_fix():
    with pytest.raises(ValueError, match="leaves no core for the trainer"):
        plan(2, cores=[0, 1], on_gpu=False)
    with pytest.raises(ValueError, match="-1 .no split., 0 .auto."):
        plan(-2, cores=[0, 1], on_gpu=False)
    from collab_app.web.serve import ServeConfig

    with pytest.raises(ValueError, match="engine_cores"):
        ServeConfig(engine_cores=-3)


def test_pinned_command_runs_on_its_cores_with_matching_threads():
    core = sorted(os.sched_getaffinity(0))[-1]
    probe = "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-63"}   # the serving side's: must not leak
    out = subprocess.run(pinned_command([core], [sys.executable, "-c", probe + "; print(os.environ.get('VLLM_CPU_OMP_THREADS_BIND'))"]),
                         capture_output=True, text=True, check=True, env=env).stdout.split("\n")
    assert out[0] == f"[{core}] 1" and out[1] == "None"


def test_child_trainer_command_is_pinned():
    from collab_app.web.serve import ChildTrainer

    plain = ChildTrainer(["--db", "sqlite://"])
    pinned = ChildTrainer(["--db", "sqlite://"], cores=(1,))
    assert pinned.cmd[-len(plain.cmd):] == plain.cmd
    assert pinned.cmd[:-len(plain.cmd)] == [sys.executable, "-m", "collab_app.online.cpushare", "pin", "1", "--"]


def test_plan_after_apply_sees_the_whole_box():
    """A second plan() (e.g. training_load inside a process already confined) must not see only
    the engine's cores, else the trainer would land on them."""
    import collab_app.online.cpushare as cs

    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs 2 usable cores")
    import torch
    threads = torch.get_num_threads()
    saved = {v: os.environ.get(v) for v in (*cs.THREAD_VARS, "VLLM_CPU_OMP_THREADS_BIND")}
    try:
        split = cs.plan(0, on_gpu=False)
        cs.apply_to_serving(split)
        assert os.sched_getaffinity(0) == set(split.engine)
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, split.engine))
        assert cs.plan(0, on_gpu=False) == split
    finally:
        os.sched_setaffinity(0, before)
        cs._BEFORE_SPLIT = None
        torch.set_num_threads(threads)
        for v, val in saved.items():
            os.environ.pop(v, None) if val is None else os.environ.__setitem__(v, val)


def test_serve_limits_reach_the_app_and_refuse_nonsense():
    """`collab serve --max-rounds-per-minute/--max-ratings-per-minute` (0 = off, e.g. for benches)."""
    from collab_app.web.serve import ServeConfig
    from trainer.configcli import parse_config

    cfg, _ = parse_config(ServeConfig, ["--max-rounds-per-minute", "0", "--max-ratings-per-minute", "5"], description="x")
    assert (cfg.max_rounds_per_minute, cfg.max_ratings_per_minute) == (0, 5)
    with pytest.raises(ValueError, match="0 = no limit"):
        ServeConfig(max_rounds_per_minute=-1)
