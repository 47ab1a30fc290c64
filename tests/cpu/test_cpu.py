"""The machine room (collab_app/cpu/): the CPU split between serving and the trainer child, the
lending of cores between them, and pinned children."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

from collab_app.cpu.cores import CpuSplit, plan

from collab_app.cpu.pin import pinned_command

# the split, the lending and the confining need two cores of their own: not a pinned worker's share
pytestmark = pytest.mark.whole_machine


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


@pytest.mark.parametrize("given, child_gets", [(None, "300000"),              # ours: libgomp's default back
                                               ("5000", "5000")])             # the user's: kept
def test_pinned_trainer_child_gets_no_long_openmp_spin(given, child_gets):
    """A serving process's entry sets a long GOMP_SPINCOUNT for the engine's thread
    (cpu/process.py); the pinned trainer child (regions from its main thread, cores lent to the
    engine between steps) goes back to libgomp's default unless the user chose a value."""
    from collab_app.cpu import process

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    probe = "import os; print(os.environ['GOMP_SPINCOUNT'])"
    code = ("from collab_app import paths; from collab_app.cpu import process; process.prepare(paths.compile_cache_dir())\n"
            f"import collab_app.cpu.pin as c, sys; c.pin_and_exec([{sorted(os.sched_getaffinity(0))[-1]}], [sys.executable, '-c', {probe!r}])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout.strip()
    assert out == child_gets
    assert process.GOMP_SPINCOUNT != process.LIBGOMP_DEFAULT_SPINCOUNT


def test_child_trainer_command_is_pinned():
    from collab_app.web.serve import ChildTrainer

    plain = ChildTrainer(["--db", "sqlite://"])
    pinned = ChildTrainer(["--db", "sqlite://"], cores=(1,))
    assert pinned.cmd[-len(plain.cmd):] == plain.cmd
    assert pinned.cmd[:-len(plain.cmd)] == [sys.executable, "-m", "collab_app.cpu.pin", "1", "--"]


def test_plan_after_apply_sees_the_whole_box():
    """A second plan() (e.g. training_load inside a process already confined) must not see only
    the engine's cores, else the trainer would land on them."""
    import collab_app.cpu.cores as cs

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


# ----------------------------------------------------------------------------- CPU budget: affinity within the cgroup quota

def _cgroups(tmp_path, proc_lines: str, files: dict[str, str]):
    """A fake cgroup tree under tmp_path/root and a fake /proc/self/cgroup; returns (root, proc)."""
    root = tmp_path / "root"
    root.mkdir(parents=True)
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_lines)
    return str(root), str(proc)


@pytest.fixture
def fake_box(tmp_path, monkeypatch):
    """fake_box(cores, proc_lines, files): this process sees `cores` as its affinity and the
    fake cgroup tree as its own (collab_app/cpu/cores.py reads them; nothing of the real box is changed)."""
    import collab_app.cpu.cores as cs

    def make(cores, proc_lines="0::/\n", files=None):
        root, proc = _cgroups(tmp_path, proc_lines, files or {})
        monkeypatch.setattr(cs, "CGROUP_ROOT", root)
        monkeypatch.setattr(cs, "PROC_CGROUP", proc)
        monkeypatch.setattr(cs, "_BEFORE_SPLIT", None)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
        return root
    return make


def test_v2_quota_is_the_tightest_along_the_cgroup_path(tmp_path):
    from collab_app.cpu.cores import cgroup_cpu_limit

    root, proc = _cgroups(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "cgroup.controllers": "cpu memory pids",
        "kubepods/cpu.max": "max 100000",
        "kubepods/pod1/cpu.max": "150000 100000",      # the pod: 1.5 CPUs binds the container too
        "kubepods/pod1/ctr/cpu.max": "400000 100000",
    })
    cpus, where = cgroup_cpu_limit(root, proc)
    assert cpus == 1.5 and where == os.path.join(root, "kubepods", "pod1", "cpu.max")


@pytest.mark.parametrize("files", [
    {"cgroup.controllers": "cpu", "a/cpu.max": "max 100000"},     # 'max' = no quota
    {"cgroup.controllers": "cpu", "a/cpu.max": "garbage"},
    {"cgroup.controllers": "cpu"},                               # no cpu.max anywhere
    {},                                                          # nothing mounted
])
def test_no_v2_quota(tmp_path, files):
    from collab_app.cpu.cores import cgroup_cpu_limit

    root, proc = _cgroups(tmp_path, "0::/a\n", files)
    assert cgroup_cpu_limit(root, proc) is None


def test_missing_proc_cgroup_means_no_quota(tmp_path):
    from collab_app.cpu.cores import cgroup_cpu_limit

    assert cgroup_cpu_limit(str(tmp_path), str(tmp_path / "absent")) is None


def test_v1_quota_and_a_container_without_cgroup_namespace(tmp_path):
    """v1: cpu.cfs_quota_us / cpu.cfs_period_us (-1 = none). A container without a cgroup
    namespace sees the host's path in /proc/self/cgroup but its own cgroup at the mount root."""
    from collab_app.cpu.cores import cgroup_cpu_limit

    root, proc = _cgroups(tmp_path, "12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "200000", "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(root, proc) == (2.0, os.path.join(root, "cpu,cpuacct", "cpu.cfs_quota_us"))
    root2, proc2 = _cgroups(tmp_path / "unlimited", "4:cpu:/x\n", {
        "cpu/x/cpu.cfs_quota_us": "-1", "cpu/x/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(root2, proc2) is None


def test_hybrid_layout_takes_the_tighter_of_v1_and_v2(tmp_path):
    from collab_app.cpu.cores import cgroup_cpu_limit

    root, proc = _cgroups(tmp_path, "1:cpu:/s\n0::/s\n", {
        "cpu/s/cpu.cfs_quota_us": "300000", "cpu/s/cpu.cfs_period_us": "100000",
        "unified/s/cpu.max": "50000 100000"})
    assert cgroup_cpu_limit(root, proc)[0] == 0.5


@pytest.mark.parametrize("quota, budget", [(None, 8), ("200000 100000", 2), ("150000 100000", 2),
                                           ("50000 100000", 1), ("1600000 100000", 8)])
def test_cpu_budget_is_affinity_within_the_quota_rounded_up(fake_box, quota, budget):
    from collab_app.cpu.cores import cpu_budget

    fake_box(range(8), "0::/c\n", {"cgroup.controllers": "cpu", **({"c/cpu.max": quota} if quota else {})})
    assert cpu_budget() == budget


def test_split_under_a_quota_pins_to_the_first_budget_cores(fake_box):
    """16 cores of affinity, a quota of 2 CPUs: one core each, the first two, not 8 + 8."""
    fake_box(range(4, 20), "0::/c\n", {"cgroup.controllers": "cpu", "c/cpu.max": "200000 100000"})
    assert plan(0, on_gpu=False) == CpuSplit(engine=(4,), trainer=(5,))


def test_sandbox_cap_follows_the_quota(fake_box, monkeypatch):
    """Through the hook every entry point sets (cli.prepare_process, serve.prepare_serving_process)."""
    from collab_app.cpu.cores import cpu_budget
    from tasks import sandbox

    fake_box(range(16), "0::/c\n", {"cgroup.controllers": "cpu", "c/cpu.max": "200000 100000"})
    monkeypatch.delenv(sandbox.MAX_CONCURRENT_ENV, raising=False)
    sandbox.set_cpu_budget(cpu_budget)
    sandbox.set_max_concurrent(None)
    try:
        assert sandbox.max_concurrent() == 2
    finally:
        sandbox.set_cpu_budget(None)
        sandbox.set_max_concurrent(None)


@pytest.fixture
def restore_serving():
    """Undo apply_to_serving: affinity, thread variables, torch threads, the remembered cores."""
    import torch

    import collab_app.cpu.cores as cs

    before, setaffinity = os.sched_getaffinity(0), os.sched_setaffinity   # the test may patch them away
    threads = torch.get_num_threads()
    saved = {v: os.environ.get(v) for v in (*cs.THREAD_VARS, "VLLM_CPU_OMP_THREADS_BIND")}
    yield
    setaffinity(0, before)
    cs._BEFORE_SPLIT = None
    torch.set_num_threads(threads)
    for v, val in saved.items():
        os.environ.pop(v, None) if val is None else os.environ.__setitem__(v, val)


def test_macos_without_affinity_api_splits_thread_counts_only(monkeypatch, restore_serving):
    """No os.sched_getaffinity / sched_setaffinity (macOS): os.cpu_count() cores, thread counts
    set, nothing pinned, vLLM told not to bind."""
    import collab_app.cpu.cores as cs

    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.delattr(os, "sched_setaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(cs, "PROC_CGROUP", "/nonexistent/proc/self/cgroup")   # no cgroups on macOS
    assert cs.cpu_budget() == 4
    split = cs.plan(0, on_gpu=False)
    assert split == CpuSplit(engine=(0, 1), trainer=(2, 3))
    cs.apply_to_serving(split)
    assert os.environ["OMP_NUM_THREADS"] == "2" and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert cs.plan(0, on_gpu=False) == split


def test_pin_without_affinity_api_still_execs_with_thread_counts():
    code = ("import os, sys; del os.sched_setaffinity, os.sched_getaffinity; "
            "from collab_app.cpu.pin import main; "
            "main(['0,1', '--', sys.executable, '-c', 'import os; print(os.environ[\"OMP_NUM_THREADS\"])'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr


def test_affinity_errors_are_logged_not_raised(monkeypatch, caplog, restore_serving):
    import collab_app.cpu.cores as cs

    def refuse(*_):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    with caplog.at_level("WARNING", logger=cs.__name__):
        cs.apply_to_serving(CpuSplit(engine=(0,), trainer=(1,)))
    assert "could not pin this process to cores 0" in caplog.text and "--engine-cores -1" in caplog.text
    assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.setattr(os, "sched_getaffinity", refuse)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    monkeypatch.setattr(cs, "PROC_CGROUP", "/nonexistent/proc/self/cgroup")
    caplog.clear()
    with caplog.at_level("WARNING", logger=cs.__name__):
        assert cs.cpu_budget() == 3
    assert "cannot read this process's CPU affinity" in caplog.text


# ----------------------------------------------------------------------------- a real cpu-limited cgroup

def _real_cpu_cgroup(name: str):
    """(dir to create, quota file writer) for a CPU-limited cgroup on this machine, or a reason
    why there is none. Only ever creates a child cgroup of a hierarchy root; enables nothing."""
    if os.geteuid() != 0:
        return None, "needs root to create a cgroup"
    mounts = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fstype, _, opts = right.split(" ")[:3]
                mounts.setdefault(fstype, []).append((left.split(" ")[4], opts.strip().split(",")))
    except OSError as e:
        return None, f"cannot read mountinfo ({e})"
    for mnt, _ in mounts.get("cgroup2", []):
        try:
            with open(os.path.join(mnt, "cgroup.subtree_control")) as f:
                ok = "cpu" in f.read().split()
        except OSError:
            ok = False
        if ok and os.access(mnt, os.W_OK):
            return (os.path.join(mnt, name), lambda d: open(os.path.join(d, "cpu.max"), "w").write("100000 100000")), ""
    for mnt, opts in mounts.get("cgroup", []):
        if "cpu" in opts and os.access(mnt, os.W_OK):
            return (os.path.join(mnt, name),
                    lambda d: open(os.path.join(d, "cpu.cfs_quota_us"), "w").write(
                        open(os.path.join(d, "cpu.cfs_period_us")).read().strip())), ""
    return None, "no writable cgroup v2 root with the cpu controller enabled, nor a writable v1 cpu hierarchy"


def test_split_in_a_real_cpu_limited_cgroup():
    """A child moved into a cgroup with a quota of one CPU (cpu.max, or cfs_quota_us on v1) sees a
    budget of 1: no split, one core; the same child outside it sees every core of its affinity."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 usable cores for a quota below the affinity")
    made, why = _real_cpu_cgroup(f"collab-test-{os.getpid()}")
    if made is None:
        pytest.skip(why)
    path, set_one_cpu = made
    probe = ("import json, os, sys\n"
             "if sys.argv[1]: open(os.path.join(sys.argv[1], 'cgroup.procs'), 'w').write(str(os.getpid()))\n"
             "from collab_app.cpu import cores as c\n"
             "s = c.plan(0, on_gpu=False)\n"
             "print(json.dumps([c.cpu_budget(), c.usable_cores(), s and [s.engine, s.trainer]]))\n")
    os.mkdir(path)
    try:
        set_one_cpu(path)
        inside = subprocess.run([sys.executable, "-c", probe, path], capture_output=True, text=True, timeout=120)
        outside = subprocess.run([sys.executable, "-c", probe, ""], capture_output=True, text=True, timeout=120)
    finally:
        for _ in range(100):   # the exited child may linger as a zombie for a moment
            try:
                os.rmdir(path)
                break
            except OSError:
                import time
                time.sleep(0.05)
    import json
    assert inside.returncode == 0, inside.stderr
    assert json.loads(inside.stdout) == [1, cores[:1], None]
    assert json.loads(outside.stdout)[:2] == [len(cores), cores]


# ----------------------------------------------------------------------------- the core lease


def test_the_trainer_waits_for_the_engine_to_give_its_cores_back(tmp_path):
    """CoreLease: the engine borrows without waiting; a trainer that wants its cores marks that,
    and gets them once the engine gives them back (at its next decode step); the engine cannot
    borrow while the trainer works or waits, and can again once it is done."""
    import threading

    from collab_app.cpu.lending import CoreLease

    path = str(tmp_path / "cores.lock")
    engine, trainer = CoreLease(path), CoreLease(path)
    assert engine.try_borrow() and not engine.wanted()
    inside, leave = threading.Event(), threading.Event()

    def step():
        with trainer.held(wait_s=120):                    # not held() (5 s): no stall of this test may
            inside.set()                                  # let the trainer go ahead without the lock
            leave.wait(60)

    t = threading.Thread(target=step)
    t.start()
    deadline = time.monotonic() + 60
    while not engine.wanted() and time.monotonic() < deadline:
        inside.wait(0.02)
    assert engine.wanted() and not inside.is_set()       # marked, but blocked on the engine's lock
    engine.give_back()
    assert inside.wait(5)                                 # the trainer has its cores
    assert not engine.try_borrow()                        # ... and keeps them for the whole step
    leave.set()
    t.join(5)
    assert not engine.wanted() and engine.try_borrow()   # done: the engine may borrow again
    engine.give_back()


def test_a_stalled_engine_delays_the_trainer_by_wait_s_at_most(tmp_path):
    """An engine that holds the lock without decoding (its stream's reader stalled) is not
    spinning on the cores: after wait_s the trainer works anyway, and the want file tells the
    engine to give the cores back at its next step."""
    import time

    from collab_app.cpu.lending import CoreLease

    path = str(tmp_path / "cores.lock")
    engine = CoreLease(path)
    assert engine.try_borrow()
    t0 = time.monotonic()
    with CoreLease(path).held(wait_s=0.3):
        assert 0.3 <= time.monotonic() - t0 < 3 and engine.wanted()
    engine.give_back()


@contextlib.contextmanager
def _a_step_in_progress(tmp_path, work_s: float):
    """A trainer thread in a unit of work (yield_share 0.5, without the pause credit: the tests of
    the share's budget; the credit's own test is below) that works `work_s`, then offers to pause
    once; yields (the engine's lease, an Event set after the pause, [seconds paused])."""
    import threading

    from collab_app.cpu.lending import CoreLease

    path = str(tmp_path / "cores.lock")
    engine, trainer = CoreLease(path), CoreLease(path, yield_share=0.5, pause_credit=False)
    inside, after, leave, paused = threading.Event(), threading.Event(), threading.Event(), []

    def step():
        with trainer.held(wait_s=60):
            inside.set()
            time.sleep(work_s)
            paused.append(trainer.pause())
            after.set()
            leave.wait(60)

    t = threading.Thread(target=step)
    t.start()
    try:
        assert inside.wait(30) and not engine.try_borrow()   # the step holds its cores
        yield engine, after, paused
    finally:
        engine.give_back()
        leave.set()
        t.join(10)


def _poll(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_a_step_pauses_for_a_waiting_round_until_its_call_ends(tmp_path):
    """A round that decodes without the trainer's cores says so (the wait file); at its next piece
    the trainer in a step lets the engine borrow them, and takes them back when the engine's call
    ends (gives the lock back), well inside its budget (yield_share 0.5: as long as it worked, 2 s
    here, so a stalled test thread does not spend it)."""
    with _a_step_in_progress(tmp_path, 2.0) as (engine, after, paused):
        engine.waiting(True)                                  # a round decodes on the engine's cores alone
        _poll(engine.try_borrow)                              # the step reached a piece's end and let go
        assert not engine.wanted()
        engine.waiting(False)                                 # decoding wide now (SpareCores does both)
        time.sleep(0.3)
        assert not after.is_set()                             # the step waits for the call to end ...
        engine.give_back()                                    # ... which it does
        assert after.wait(5)
        assert 0.3 <= paused[0] < 2.0
        assert engine.wanted() and not engine.try_borrow()   # the step has its cores again


def test_a_step_pauses_no_longer_than_its_budget(tmp_path):
    """An engine that keeps borrowing (rounds back to back) gets the cores for at most the step's
    budget (1.5 s: what the step worked): then the want file is back, and the engine gives them
    back at its next decode step."""
    with _a_step_in_progress(tmp_path, 1.5) as (engine, after, paused):
        engine.waiting(True)
        _poll(engine.try_borrow)
        engine.waiting(False)
        _poll(engine.wanted)                      # the budget is spent
        engine.give_back()                        # the engine's next decode step
        assert after.wait(5)
        assert 1.5 <= paused[0] < 4.0


@pytest.mark.parametrize("share, round_waits", [(0.5, False), (0.0, True)])
def test_no_pause_without_a_waiting_round_or_a_budget(tmp_path, share, round_waits):
    from collab_app.cpu.lending import CoreLease

    path = str(tmp_path / "cores.lock")
    engine, trainer = CoreLease(path), CoreLease(path, yield_share=share)
    engine.waiting(round_waits)
    assert trainer.pause() == 0.0                 # outside a unit of work: nothing to let go
    with trainer.held():
        time.sleep(0.2)
        assert trainer.pause() == 0.0
        assert engine.wanted() and not engine.try_borrow()


def test_a_step_pauses_only_as_long_as_the_trainer_idled_before_it(tmp_path, monkeypatch):
    """The pause credit (ServiceConfig.pause_credit, on by default): a step pauses for a waiting
    round only as long as the trainer was idle between its units of work, banked up to
    PAUSE_CREDIT_CAP_S. The first unit has nothing banked; units back to back (ratings piling up)
    do not pause; a pause spends the bank. Here the engine never borrows, so each pause lasts its
    whole budget."""
    from collab_app.cpu import lending
    from collab_app.cpu.lending import CoreLease

    path = str(tmp_path / "cores.lock")
    engine, trainer = CoreLease(path), CoreLease(path, yield_share=0.5)
    engine.waiting(True)                            # a round waits for the trainer's cores throughout
    with trainer.held():
        time.sleep(0.3)
        assert trainer.pause() == 0.0                # nothing banked before the first unit
    time.sleep(0.6)                                  # idle: banked
    with trainer.held():
        t0 = time.monotonic()
        time.sleep(1.0)                              # worked >= 1 s: the share allows as long
        bank = trainer.credit_s
        assert bank >= 0.6                           # what idled (more if this thread stalled)
        budget = min(bank, time.monotonic() - t0)    # the share's budget binds only after a stall
        paused = trainer.pause()
        assert budget - 0.1 <= paused <= budget + 0.3
        left = trainer.credit_s
        assert left == pytest.approx(max(0.0, bank - paused), abs=0.01)   # spent
        assert trainer.pause() == 0.0                # nothing left for a second pause
    with trainer.held():                             # back to back: nothing new banked
        assert trainer.credit_s - left < 0.05
        time.sleep(0.3)
        assert trainer.pause() <= left + 0.05
    monkeypatch.setattr(lending, "PAUSE_CREDIT_CAP_S", 0.2)
    time.sleep(0.5)
    with trainer.held():
        assert trainer.credit_s == pytest.approx(0.2)    # banked up to the cap
    no_credit = CoreLease(path, yield_share=0.5, pause_credit=False)   # --no-pause-credit: the share alone
    with no_credit.held():
        time.sleep(0.3)
        assert no_credit.pause() >= 0.25
    engine.waiting(False)


def test_a_wait_file_left_by_a_killed_engine_is_cleared_at_the_trainers_start(tmp_path):
    from collab_app.cpu.lending import CoreLease

    path = str(tmp_path / "cores.lock")
    engines = [CoreLease(path), CoreLease(path)]
    for engine in engines:
        engine.waiting(True)                      # serve was killed mid-round (a team on two bases)
    trainer = CoreLease(path)
    assert trainer.round_waits()
    trainer.clear_stale()
    assert not trainer.round_waits() and not any(os.path.exists(e.wait) for e in engines)


def test_one_engines_call_ending_does_not_hide_anothers_waiting_round(tmp_path):
    """A team on two bases has an engine per base, each with its own lease handle; their calls may
    overlap (two people's rounds). When one call ends, the other still waits for the cores, and a
    step in progress still pauses for it."""
    from collab_app.cpu.lending import CoreLease

    path = str(tmp_path / "cores.lock")
    first, second, trainer = CoreLease(path), CoreLease(path), CoreLease(path, yield_share=0.5)
    assert first.wait != second.wait
    first.waiting(True)
    second.waiting(True)
    second.waiting(False)                         # the second base's call ended
    assert trainer.round_waits()                  # the first's round still waits
    first.waiting(False)
    assert not trainer.round_waits()
    with _a_step_in_progress(tmp_path, 2.0) as (engine, after, paused):
        first.waiting(True)                       # the first base's engine waits for a round
        _poll(first.try_borrow)                   # the step let go for the first engine's round
        first.waiting(False)
        first.give_back()
        assert after.wait(5) and paused[0] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to lend one")
def test_spare_cores_widen_the_decoding_thread_and_narrow_it_when_the_trainer_wants_them(tmp_path):
    import threading

    import torch

    from collab_app.cpu.lending import CoreLease, SpareCores

    a, b = sorted(os.sched_getaffinity(0))[:2]
    split = CpuSplit(engine=(a,), trainer=(b,))
    path = str(tmp_path / "cores.lock")
    seen = {}

    def decode():   # a thread of its own, like the engine's: only its affinity and threads change
        os.sched_setaffinity(0, split.engine)
        torch.set_num_threads(1)
        spare = SpareCores(CoreLease(path), split)
        spare.before_step()
        seen["wide"] = (sorted(os.sched_getaffinity(0)), torch.get_num_threads(), spare.widened)
        with open(path + ".want", "w"):   # the trainer wants its core
            pass
        seen["wide waits"] = os.path.exists(spare.lease.wait)
        spare.before_step()
        seen["narrow"] = (sorted(os.sched_getaffinity(0)), torch.get_num_threads(), spare.widened)
        seen["narrow waits"] = os.path.exists(spare.lease.wait)   # a trainer in a step may pause for it
        os.unlink(path + ".want")
        spare.before_step()
        seen["widened again waits"] = os.path.exists(spare.lease.wait)
        spare.end()
        seen["end"] = (sorted(os.sched_getaffinity(0)), torch.get_num_threads(), spare.widened)
        seen["end waits"] = os.path.exists(spare.lease.wait)

    main_before = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())
    t = threading.Thread(target=decode)
    t.start()
    t.join(10)
    assert seen["wide"] == ([a, b], 2, 1)
    assert seen["narrow"] == ([a], 1, 1)
    assert seen["end"] == ([a], 1, 2)
    assert [seen[k] for k in ("wide waits", "narrow waits", "widened again waits", "end waits")] == \
        [False, True, False, False]
    assert (sorted(os.sched_getaffinity(0)), torch.get_num_threads()) == main_before   # this thread untouched
    probe = CoreLease(path)
    assert probe.try_borrow()   # the engine's end() gave the lock back
    probe.give_back()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not hasattr(os, "sched_setscheduler"),
                    reason="needs two cores to lend one, and Linux's scheduling policies")
def test_threads_started_wide_run_idle_while_the_engine_is_narrow(tmp_path):
    """The pool threads a widened decoding thread starts keep the wide mask and spin on after its
    last region (~1.2 s with collab_app's GOMP_SPINCOUNT); narrowed, they get SCHED_IDLE, so the
    trainer's core is the trainer's; widened again, SCHED_OTHER (as root; unprivileged Linux
    refuses that and they stay idle). The decoding thread itself, threads older than the
    lending, and a process that is not confined to the engine's cores are left alone."""
    import threading

    import torch

    from collab_app.cpu.lending import CoreLease, SpareCores

    a, b = sorted(os.sched_getaffinity(0))[:2]
    split = CpuSplit(engine=(a,), trainer=(b,))
    path = str(tmp_path / "cores.lock")
    seen, stop, ids = {}, threading.Event(), []
    older = threading.Thread(target=stop.wait, args=(60,))   # started before the lending, wide mask
    older.start()

    def decode():
        os.sched_setaffinity(0, split.engine)
        torch.set_num_threads(1)
        spare = SpareCores(CoreLease(path), split)
        spare.before_step()                                         # wide
        pool = threading.Thread(target=lambda: (ids.append(threading.get_native_id()), stop.wait(60)))
        pool.start()                                                # inherits the wide mask
        while not ids:
            time.sleep(0.01)
        with open(path + ".want", "w"):
            pass
        spare.before_step()                                         # narrow: the trainer wants its core
        seen["narrow"] = (os.sched_getscheduler(ids[0]), os.sched_getscheduler(0),
                          os.sched_getscheduler(older.native_id))
        os.unlink(path + ".want")
        spare.before_step()                                         # wide again
        seen["wide"] = os.sched_getscheduler(ids[0])
        spare.end()
        seen["end"] = os.sched_getscheduler(ids[0])

    main_mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, split.engine)   # confined, as serve's split confines the serving process
    try:
        t = threading.Thread(target=decode)
        t.start()
        t.join(20)
    finally:
        os.sched_setaffinity(0, main_mask)
        stop.set()
        older.join(5)
    assert seen["narrow"] == (os.SCHED_IDLE, os.SCHED_OTHER, os.SCHED_OTHER)
    assert seen["wide"] == (os.SCHED_OTHER if os.geteuid() == 0 else os.SCHED_IDLE)
    assert seen["end"] == os.SCHED_IDLE

    # a process that is not confined (this one now): nothing is touched
    done = {}

    def unconfined():
        spare = SpareCores(CoreLease(str(tmp_path / "other.lock")), split)
        spare.before_step()
        th = threading.Thread(target=lambda: (done.setdefault("tid", threading.get_native_id()), time.sleep(1)))
        th.start()
        while "tid" not in done:
            time.sleep(0.01)
        spare.end()
        done["policy"] = os.sched_getscheduler(done["tid"])
        th.join()

    t = threading.Thread(target=unconfined)
    t.start()
    t.join(20)
    assert done["policy"] == os.SCHED_OTHER


def test_transformers_engine_decodes_on_borrowed_cores_only_while_the_trainer_is_idle(tmp_path, hf_engine):
    """The engine's hook runs between decode steps: with the trainer idle every step borrows;
    with the trainer in a step none does, and the round still completes on the engine's cores."""
    from collab_app.engines.engine_types import Request, Sampling
    from collab_app.cpu.lending import CoreLease, SpareCores

    cores = sorted(os.sched_getaffinity(0))
    split = CpuSplit(engine=tuple(cores[:1]), trainer=tuple(cores[1:2] or cores[:1]))
    path = str(tmp_path / "cores.lock")
    hf_engine.register_agent("lease")
    sampling = Sampling(max_new_tokens=6, temperature=0.0)
    hf_engine.spare_cores = spare = SpareCores(CoreLease(path), split)
    try:
        free = hf_engine.generate([Request("lease", "Say hi.")], 1, sampling)
        probe = CoreLease(path)
        assert spare.widened >= 2 and not spare.wide and probe.try_borrow()   # end() gave it back
        probe.give_back()
        before = spare.widened
        with CoreLease(path).held():
            busy = hf_engine.generate([Request("lease", "Say hi.")], 1, sampling)
        assert spare.widened == before
        assert busy[0][0].token_ids == free[0][0].token_ids
    finally:
        hf_engine.spare_cores = None


def test_the_trainer_service_holds_its_cores_for_a_step_only(tmp_path, monkeypatch):
    """`collab trainer --core-lease F` (serve passes it): a step runs holding the lease, polling
    does not."""
    from collab_app.cpu.lending import CoreLease
    from collab_app.online.service import ServiceConfig, TrainerService

    path = str(tmp_path / "cores.lock")
    svc = TrainerService.__new__(TrainerService)
    svc.cfg = ServiceConfig(core_lease=path)
    held = []

    def probe():
        lease = CoreLease(path)
        free = lease.try_borrow()
        lease.give_back()
        return not free

    with svc._cores():
        held.append(probe())
    held.append(probe())
    assert held == [True, False]
    lease = svc._core_lease()   # one lease: the trainer's pause needs the unit its _cores() opened
    assert lease is svc._core_lease() and lease.yield_share == 0.5 and lease.pause_credit
    svc.cfg, svc._lease = ServiceConfig(core_lease=path, pause_credit=False), None   # --no-pause-credit
    assert svc._core_lease().pause_credit is False
    svc.cfg, svc._lease = ServiceConfig(core_lease=path), lease
    with svc._cores():
        assert lease._unit is not None
    svc.cfg = ServiceConfig()
    with svc._cores():   # no lease: nothing held
        assert not probe()
    assert svc._core_lease() is None


def test_a_want_file_left_by_a_killed_trainer_is_cleared_at_the_next_start(tmp_path):
    from collab_app.cpu.lending import CoreLease

    path = str(tmp_path / "cores.lock")
    with open(path + ".want", "w"):   # the trainer was killed -9 mid-step: its flock is gone, the file is not
        pass
    engine = CoreLease(path)
    assert not engine.try_borrow()
    CoreLease(path).clear_stale()     # TrainerService.run() does this at start
    assert engine.try_borrow()
    engine.give_back()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="needs two cores to confine to one")
def test_serving_loads_torch_before_it_confines_itself():
    """libgomp counts the CPUs of the affinity it finds when torch loads it; loaded after the
    confinement, a decoding thread widened onto the trainer's lent cores would be held to a
    100-spin wait (docs/ENGINES.md "OpenMP from the engine's thread")."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    code = ("import sys, os, collab_app.cpu.cores as c\n"
            "orig = c.confine\n"
            "def spy(cores):\n    print('torch' in sys.modules, flush=True)\n    return orig(cores)\n"
            "c.confine = spy\n"
            f"c.apply_to_serving(c.CpuSplit(engine=({cores[0]},), trainer=({cores[1]},)))\n"
            "import torch; print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "True" and out[1] == f"[{cores[0]}] 1"


# ----------------------------------------------------------------------------- the engine's cores lent to the trainer


def _engine_takes_part(path: str) -> None:
    """What lend_trainer_cores does where every engine part announces its calls."""
    with open(path + ".engine", "a"):
        pass
    os.utime(path + ".engine", (0, 0))


@contextlib.contextmanager
def _own_core(core: int, threads: int = 1):
    """This thread on `core` with `threads` torch threads; both restored after."""
    import torch

    before = (os.sched_getaffinity(0), torch.get_num_threads())
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before[0])
        torch.set_num_threads(before[1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to lend one")
def test_a_step_widens_onto_the_idle_engines_cores_and_gives_them_back_when_a_call_starts(tmp_path, monkeypatch):
    """At a pause point with no generate call for ENGINE_SETTLE_S, the trainer's thread widens
    onto the engine's cores (affinity and torch threads); a call announces itself and waits on the
    engine lock until the trainer's next pause point narrows it; after the call the trainer waits
    the settle time before widening again; the unit's end narrows it."""
    import torch

    from collab_app.cpu import lending
    from collab_app.cpu.lending import CoreLease

    monkeypatch.setattr(lending, "ENGINE_SETTLE_S", 0.3)
    a, b = sorted(os.sched_getaffinity(0))[:2]
    path = str(tmp_path / "cores.lock")
    _engine_takes_part(path)
    engine, trainer = CoreLease(path), CoreLease(path, yield_share=0.5, engine_cores=(a,))
    cores = lambda: (sorted(os.sched_getaffinity(0)), torch.get_num_threads())   # noqa: E731
    seen = {}
    with _own_core(b):
        _a_unit_beside_a_call(engine, trainer, cores, seen)
        seen["unit over"] = cores()
    assert seen["idle engine"] == ([a, b], 2)
    assert seen["call waits"] and 0.2 <= seen["waited"] < lending.ENGINE_WAIT_S
    assert seen["call started"] == seen["during the call"] == seen["just after"] == ([b], 1)
    assert seen["settled"] == ([a, b], 2) and seen["unit over"] == ([b], 1)
    assert trainer.wide_s >= 0.2 and not os.path.exists(engine.call)   # the first wide span held the call 0.2 s


def _a_unit_beside_a_call(engine, trainer, cores, seen):
    import threading

    with trainer.held(wait_s=60):
        trainer.pause()
        seen["idle engine"] = cores()
        started = threading.Event()

        def call():
            started.set()
            engine.begin_call()       # waits for the trainer's next pause point
        t = threading.Thread(target=call)
        t.start()
        started.wait(5)
        _poll(lambda: os.path.exists(engine.call))
        time.sleep(0.2)
        seen["call waits"] = t.is_alive()
        trainer.pause()               # a pause point: the call file is there
        seen["call started"] = cores()
        t.join(5)
        seen["waited"] = engine.call_wait_s
        trainer.pause()
        seen["during the call"] = cores()
        engine.end_call()
        trainer.pause()
        seen["just after"] = cores()  # the engine's workers may still spin: settle first
        time.sleep(0.4)
        trainer.pause()
        seen["settled"] = cores()


def test_no_widening_where_the_engine_does_not_announce_its_calls(tmp_path):
    """Without the engine's lock file (an engine part decoding in another process, or serve's
    --no-lend-engine-cores) the trainer never widens, and a call announces nothing."""
    import torch

    from collab_app.cpu.lending import CoreLease

    path = str(tmp_path / "cores.lock")
    engine, trainer = CoreLease(path), CoreLease(path, yield_share=0.5, engine_cores=(0,))
    threads = torch.get_num_threads()
    with trainer.held(wait_s=5):
        trainer.pause()
        assert trainer._wide is None and torch.get_num_threads() == threads
    engine.begin_call()
    assert not os.path.exists(engine.call) and engine._call_fd is None
    engine.end_call()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to lend one")
def test_a_call_waits_for_a_wide_trainer_at_most_engine_wait_s(tmp_path, monkeypatch):
    """A trainer that stays wide without reaching a pause point (it runs no OpenMP region then)
    holds a call back ENGINE_WAIT_S at most; the call then decodes, and the trainer narrows at its
    next pause point."""
    from collab_app.cpu import lending
    from collab_app.cpu.lending import CoreLease

    monkeypatch.setattr(lending, "ENGINE_WAIT_S", 0.3)
    a, b = sorted(os.sched_getaffinity(0))[:2]
    path = str(tmp_path / "cores.lock")
    _engine_takes_part(path)
    engine, trainer = CoreLease(path), CoreLease(path, yield_share=0.5, engine_cores=(a,))
    with _own_core(b), trainer.held(wait_s=5):
        trainer.pause()
        assert trainer._wide is not None
        t0 = time.monotonic()
        engine.begin_call()
        assert 0.3 <= time.monotonic() - t0 < 3 and engine.call_wait_s >= 0.3
        trainer.pause()
        assert trainer._wide is None
        engine.end_call()


def test_lend_trainer_cores_announces_the_engine_only_when_every_part_decodes_here(tmp_path):
    from types import SimpleNamespace

    from collab_app.cpu.lending import lend_trainer_cores

    split = CpuSplit(engine=(0,), trainer=(1,))
    here, elsewhere = SimpleNamespace(spare_cores=None), SimpleNamespace(spare_cores=None, in_process=False)
    cases = [(here, True, True), (here, False, False),
             (SimpleNamespace(engines={"a": here, "b": elsewhere}), True, False)]
    for k, (engine, lend, announced) in enumerate(cases):
        path = str(tmp_path / f"cores{k}.lock")
        lend_trainer_cores(engine, split, path, lend_engine_cores=lend)
        assert os.path.exists(path + ".engine") == announced, (k, lend)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to confine to one")
def test_a_child_loaded_on_both_sides_cores_confines_itself_after_torch():
    """`pin CORES --load-on WIDE`: the child starts on WIDE (libgomp counts them when torch loads)
    and confine_after_torch() puts it on CORES with matching torch threads; without --load-on it
    is pinned before it starts, as before, and confine_after_torch does nothing."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    probe = ("import os, json, sys; first = sorted(os.sched_getaffinity(0)); "
             "from collab_app.cpu.pin import confine_after_torch; confine_after_torch(); "
             "import torch; print(json.dumps([first, sorted(os.sched_getaffinity(0)), torch.get_num_threads(), "
             "'torch' in sys.modules, os.environ.get('COLLAB_CONFINE_AFTER_TORCH')]))")
    wide = subprocess.run(pinned_command([b], [sys.executable, "-c", probe], load_on=[a, b]),
                          capture_output=True, text=True, check=True).stdout
    plain = subprocess.run(pinned_command([b], [sys.executable, "-c", probe]), capture_output=True, text=True,
                           check=True).stdout
    assert json.loads(wide) == [[a, b], [b], 1, True, None]
    assert json.loads(plain) == [[b], [b], 1, True, None]
    assert pinned_command([b], ["x"], load_on=[b]) == pinned_command([b], ["x"])   # nothing wider: plain pin


def test_serve_lends_the_engines_cores_to_its_child_unless_told_not_to(tmp_path):
    from collab_app.online.service import ServiceConfig
    from collab_app.web.serve import ChildTrainer

    child = ChildTrainer(["--db", "sqlite://"], cores=(1,), load_on=(0, 1))
    assert child.cmd[:7] == [sys.executable, "-m", "collab_app.cpu.pin", "1", "--load-on", "0,1", "--"]
    with pytest.raises(ValueError, match="needs core_lease"):
        ServiceConfig(borrow_engine_cores="0")
    with pytest.raises(ValueError, match="core numbers"):
        ServiceConfig(core_lease=str(tmp_path / "l"), borrow_engine_cores="all")
    assert ServiceConfig(core_lease=str(tmp_path / "l"), borrow_engine_cores="0,2").borrow_engine_cores == "0,2"


def test_widening_without_an_affinity_api_adds_threads_and_a_refused_mask_keeps_its_own(tmp_path, monkeypatch, caplog):
    """macOS (no affinity API): the split is thread counts only, so widening adds the engine's
    core count to the trainer's threads. Where the OS refuses the wide mask (a cpuset without the
    engine's cores) the step trains on its own cores, says so once, and stops trying."""
    import torch

    from collab_app.cpu.lending import CoreLease

    threads = torch.get_num_threads()
    path = str(tmp_path / "cores.lock")
    _engine_takes_part(path)
    try:
        with monkeypatch.context() as m:
            m.delattr(os, "sched_getaffinity")
            m.delattr(os, "sched_setaffinity")
            trainer = CoreLease(path, yield_share=0.5, engine_cores=(0, 1))
            with trainer.held(wait_s=5):
                trainer.pause()
                assert torch.get_num_threads() == threads + 2
            assert torch.get_num_threads() == threads
        def refuse(pid, cores):
            raise OSError(22, "Invalid argument")
        monkeypatch.setattr(os, "sched_setaffinity", refuse)
        trainer = CoreLease(path, yield_share=0.5, engine_cores=(0,))
        with trainer.held(wait_s=5):
            trainer.pause()
            trainer.pause()
            assert trainer._wide is None and trainer.engine_cores == () and torch.get_num_threads() == threads
        assert caplog.text.count("cannot widen the trainer") == 1
    finally:
        torch.set_num_threads(threads)
