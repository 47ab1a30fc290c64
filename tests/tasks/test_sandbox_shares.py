"""The sandbox's gate and memory bound (issue 82, M3 and M4; tasks/sandbox.py `_Gate`, `_bounded`):

- M3: a visitor's runs count against their client network's share of the concurrent slots
  (`on_behalf_of(network)` / run_tests(network=)): one network's tests that sleep never hold every
  slot, so another network's check runs beside them; and such a run waits at most max_wait() for a
  slot, then comes back as "the sandbox failed to start (busy: ...)" (tasks/coding.py turns that
  into SandboxFailure, not the candidate's fault) instead of hanging. Runs without a network
  (the app's own, the trainer's) wait as before.
- M4: without a per-run cgroup nothing bounded a run's memory in all but RLIMIT_NPROC x
  RLIMIT_AS (32 x 1 GB): both are now lowered until the product fits Limits.total_memory_mb,
  checked inside a real strong-mode run; where even the process limit does not hold (kernel uid
  0 in "userns"), code a person typed is refused and isolation() says the memory is not bounded.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

from tasks import sandbox
from tasks.sandbox import Limits, run_tests

FAST = Limits(timeout_s=20, cpu_s=5)
NO_CGROUP = sandbox._Cgroups(None, (), "test: no cgroup")
SLEEP = "import time\ntime.sleep({s})\n"


@pytest.fixture
def gate():
    """The process-wide gate at a known size and wait, restored afterwards."""
    yield sandbox
    sandbox.set_max_concurrent(None)
    sandbox.set_max_wait(None)


# ------------------------------------------------------------------ M3: the gate, unit

def test_one_key_holds_at_most_its_share_and_waits_with_a_timeout():
    g = sandbox._Gate()
    g.set(4)
    g.wait_s = 0.3
    assert g.share() == 2
    g.acquire("net:a")
    g.acquire("net:a")
    t0 = time.monotonic()
    with pytest.raises(sandbox._Busy, match=r"busy: no sandbox slot came free within 0.3 s .*yours hold 2"):
        g.acquire("net:a")                       # a third for the same network: over its share
    assert 0.25 <= time.monotonic() - t0 < 2
    g.acquire("net:b")                           # another network gets a slot at once
    g.acquire(None)                              # the app's own run too (the cap: 4)
    t0 = time.monotonic()
    with pytest.raises(sandbox._Busy):
        g.acquire("net:c")                       # everything taken: a visitor waits 0.3 s, no longer
    assert time.monotonic() - t0 < 2
    g.release("net:a")
    g.acquire("net:c")                           # a freed slot goes to a network under its share
    for key in ("net:a", "net:b", "net:c", None):
        g.release(key)
    assert g._active == 0 and g._held == {}


def test_a_run_without_a_network_waits_as_long_as_it_takes():
    g = sandbox._Gate()
    g.set(1)
    g.wait_s = 0.1
    g.acquire("net:a")
    got = threading.Event()
    t = threading.Thread(target=lambda: (g.acquire(None), got.set()))
    t.start()
    assert not got.wait(0.5)                     # past wait_s: the app's own run still waits
    g.release("net:a")
    assert got.wait(5)
    t.join()
    g.release(None)


def test_share_of_a_gate_of_one_is_the_whole_gate():
    g = sandbox._Gate()
    g.set(1)
    assert g.share() == 1
    g.set(5)
    assert g.share() == 2


def test_max_wait_is_checked(gate):
    for bad in (0, -1, True, "5"):
        with pytest.raises(ValueError):
            sandbox.set_max_wait(bad)
    sandbox.set_max_wait(2.5)
    assert sandbox.max_wait() == 2.5
    sandbox.set_max_wait(None)
    assert sandbox.max_wait() == sandbox.WAIT_S


# ------------------------------------------------------------------ M3: real runs

def test_one_networks_sleeping_tests_cannot_take_every_slot(gate):
    """Two slots: network A starts three checks whose tests sleep 2 s; network B's quick check
    runs beside them at once, and A's own run one at a time (its share of two slots is one)."""
    sandbox.set_max_concurrent(2)
    spans: dict[str, list] = {"a": [], "b": []}

    def run(net, src):
        t0 = time.monotonic()
        r = run_tests("", [src], FAST, network=f"net:{net}")
        spans[net].append((t0, time.monotonic(), r))

    sleepers = [threading.Thread(target=run, args=("a", SLEEP.format(s=2))) for _ in range(3)]
    for t in sleepers:
        t.start()
    time.sleep(0.5)                              # A's first check holds a slot, its others wait
    run("b", "assert 1 + 1 == 2")
    b0, b1, rb = spans["b"][0]
    assert rb.all_passed and b1 - b0 < 1.8, (b1 - b0, rb.setup_error)   # not behind A's sleepers
    for t in sleepers:
        t.join()
    a = [(s, e) for s, e, r in spans["a"]]
    assert all(r.all_passed for *_, r in spans["a"])
    assert max(e for _, e in a) - min(s for s, _ in a) >= 5.5, a   # A's three 2 s checks, one after another


def test_a_visitors_wait_beyond_the_timeout_comes_back_busy(gate):
    """One slot held by a network's sleeping test: another network's check comes back within the
    wait, saying the sandbox was busy (the coding task's SandboxFailure), not hanging."""
    from tasks.coding import SandboxFailure

    sandbox.set_max_concurrent(1)
    sandbox.set_max_wait(1.0)
    holder = threading.Thread(target=run_tests, args=("", [SLEEP.format(s=4)], FAST), kwargs={"network": "net:a"})
    holder.start()
    time.sleep(0.5)
    try:
        t0 = time.monotonic()
        with sandbox.on_behalf_of("net:b"):                      # the way core._score passes it
            r = run_tests("def f():\n    return 1\n", ["assert f() == 1"], FAST)
        took = time.monotonic() - t0
        assert 0.9 <= took < 2.5, took
        assert not r.harness_ok and r.passed == 0 and r.killed_by is None
        assert r.setup_error.startswith("the sandbox failed to start (busy: no sandbox slot came free within 1 s")
        assert r.tests[0].error.startswith("did not run: setup failed")
        # the coding task says the sandbox failed, not the candidate
        from tasks.coding import HumanEvalTask
        he = HumanEvalTask()
        ex = he.examples("eval")[0]
        with sandbox.on_behalf_of("net:b"), pytest.raises(SandboxFailure, match="busy"):
            he.reward(ex, ["def aux(x):\n    return x\n", "def has_close_elements(n, t):\n    return False\n"])
    finally:
        holder.join()


def test_run_many_passes_the_network_to_its_workers(gate, monkeypatch):
    seen = []
    real = sandbox._Gate.acquire

    def acquire(self, key=None):
        seen.append(key)
        return real(self, key)

    monkeypatch.setattr(sandbox._Gate, "acquire", acquire)
    with sandbox.on_behalf_of("net:x"):
        rs = sandbox.run_many([("", ["assert True"])] * 2, FAST, max_workers=2)
    assert all(r.all_passed for r in rs) and seen == ["net:x", "net:x"]
    seen.clear()
    sandbox.run_many([("", ["assert True"])], FAST, network="net:y")
    run_tests("", ["assert True"], FAST)
    assert seen == ["net:y", None]


# ------------------------------------------------------------------ M4: memory bounded without a cgroup

def test_bounded_limits_fit_the_total_without_a_cgroup():
    d = sandbox._bounded(Limits(), NO_CGROUP)
    assert d.max_procs * d.memory_mb <= Limits().total_memory_mb
    assert (d.max_procs, d.memory_mb) == (8, 256)          # 8 processes kept, each 256 MB
    for lim in (Limits(memory_mb=160, total_memory_mb=256), Limits(memory_mb=2048, total_memory_mb=256),
                Limits(max_procs=8), Limits(total_memory_mb=64), Limits(memory_mb=512, total_memory_mb=8192)):
        b = sandbox._bounded(lim, NO_CGROUP)
        assert b.max_procs * b.memory_mb <= lim.total_memory_mb, (lim, b)
        assert b.max_procs <= lim.max_procs and b.memory_mb <= lim.memory_mb and b.max_procs >= 1
    assert sandbox._bounded(Limits(memory_mb=512, total_memory_mb=8192), NO_CGROUP).memory_mb == 512
    assert sandbox._bounded(Limits(max_procs=4, memory_mb=256), NO_CGROUP) == Limits(max_procs=4, memory_mb=256)
    with_cgroup = sandbox._Cgroups("/sys/fs/cgroup/x", ("memory", "pids"), "")
    assert sandbox._bounded(Limits(), with_cgroup) == Limits()          # memory.max bounds it there


def _strong_mode():
    for name in ("namespaces", "userns"):
        m = sandbox._modes().get(name)
        holds = m and (m.separate_uid or os.geteuid() != 0)    # RLIMIT_NPROC applies (not kernel uid 0)
        if holds and sandbox._run(m, "", ["assert True"], FAST, "", cgroups=NO_CGROUP).harness_ok:
            return m
    pytest.skip("no strong mode whose process limit holds on this machine")


def test_a_strong_run_without_a_cgroup_gets_processes_times_memory_within_the_total():
    m = _strong_mode()
    lim = Limits(timeout_s=20, memory_mb=512, total_memory_mb=1024)     # 32 x 512 MB asked for
    probe = ("import resource\nAS = resource.getrlimit(resource.RLIMIT_AS)[0]\n"
             "NPROC = resource.getrlimit(resource.RLIMIT_NPROC)[0]\n")
    r = sandbox._run(m, probe, [f"assert AS * NPROC <= {1024 * 1024**2}, (AS >> 20, NPROC)",
                                "x = bytearray(300 * 1024**2)"], lim, "", cgroups=NO_CGROUP)
    assert r.tests[0].passed, r.tests[0].error
    assert r.killed_by == "memory" and "memory limit (128 MB)" in r.tests[1].error   # 1024 / 8 processes


def test_isolation_says_how_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(sandbox, "_cg_cache", NO_CGROUP)
    strong = sandbox._Mode("namespaces", (), True, True, True)
    with monkeypatch.context() as mp:
        mp.setattr(sandbox, "_forced", strong)
        iso = sandbox.isolation()
    assert iso["memory"] == {"bounded_by": "rlimits", "per_process_mb": 256, "processes": 8, "total_mb": 2048}
    assert "8 processes x 256 MB = 2048 MB" in iso["summary"] and iso["untrusted_allowed"]


def test_strong_mode_whose_memory_nothing_bounds_refuses_peoples_code(monkeypatch):
    """"userns" for an app running as root, no cgroup: RLIMIT_NPROC does not apply to kernel uid 0,
    so processes x address space has no bound: a person's code is refused (model code still runs)."""
    monkeypatch.delenv(sandbox.ALLOW_WEAK_ENV, raising=False)
    monkeypatch.setattr(sandbox, "_cg_cache", NO_CGROUP)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    userns = sandbox._Mode("userns", ("unshare", "--user", "--map-root-user"), True, True, False, True)
    monkeypatch.setattr(sandbox, "_forced", userns)
    iso = sandbox.isolation()
    assert iso["strong"] and iso["memory"]["bounded_by"] is None and not iso["untrusted_allowed"]
    assert "memory NOT bounded" in iso["summary"] and sandbox.CGROUP_ENV in iso["summary"]
    with pytest.raises(sandbox.WeakSandboxError, match="nothing bounds a run's memory"):
        run_tests("def f():\n    return 1\n", ["assert f() == 1"], FAST, untrusted=True)
    monkeypatch.setenv(sandbox.ALLOW_WEAK_ENV, "1")
    assert sandbox.isolation()["untrusted_allowed"]
