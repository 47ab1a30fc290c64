"""Issue 82 M2: candidate code must not be able to forge its own unit-test verdicts.

Each attack below is real candidate code that tries to turn always-failing tests into passes
(or an uncooperative main into a cooperating one), run in every isolation mode this machine
offers ("namespaces", "userns", "plain"), forced through the private `sandbox._run`. On b360529 the
harness ran the tests in the same process as the code, and the attacks marked "forged on
b360529" below came back passed there; since then the verdicts are decided by a judge process
that runs no candidate code (tasks/_sandbox_harness.py, tasks/_sandbox_rpc.py).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tasks import sandbox
from tasks.sandbox import Limits

LIM = Limits(timeout_s=6, cpu_s=4, max_output_bytes=20_000)
F = "def f(x):\n    return x + 1\n"  # honest f: f(1) == 2
FAILING = ["assert f(1) == 3", "assert f(2) == 7", "assert f(3) == 0"]  # never true of this f
N = len(FAILING)

# Reports every test passed through whatever `rep` is (b360529: the runner's `report`), then
# ends the process so that nothing honest follows.
FORGE = f'''
import os, sys
def _forge_with(rep):
    rep("S 1 ")
    for i in range({N}):
        rep(f"T {{i}} 1 ")
    rep("D")
    rep("P")
    os._exit(0)
'''

# Processes of this run only (its session): in "plain" mode /proc also shows the host's.
MINE = """
import os
def _mine():
    out = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and int(p) != os.getpid() and os.getsid(int(p)) == os.getsid(0):
                out.append(int(p))
        except OSError:
            pass
    return out
"""

ATTACKS: dict[str, tuple[str, list[str]]] = {
    # frames of this process up to whoever holds the reporter (forged on b360529)
    "frame walk at import": (FORGE + '''
f0 = sys._getframe()
while f0 is not None:
    rep = f0.f_locals.get("report")
    if callable(rep):
        _forge_with(rep)
    f0 = f0.f_back
''' + F, FAILING),
    # the same from inside f, called by a test (forged on b360529)
    "frame walk from a call": (FORGE + '''
def f(x):
    f0 = sys._getframe()
    while f0 is not None:
        rep = f0.f_locals.get("report")
        if callable(rep):
            _forge_with(rep)
        f0 = f0.f_back
    return x + 1
''', FAILING),
    # every object the collector knows: the reporter closure, the MAC object behind it (forged on b360529)
    "gc.get_objects / get_referrers": (FORGE + '''
import gc
for o in gc.get_objects():
    if type(o).__name__ == "function" and o.__name__ == "report":
        _forge_with(o)
    if type(o).__name__ == "builtin_function_or_method" and getattr(o, "__name__", "") == "copy":
        for r in gc.get_referrers(o):
            if type(r).__name__ == "cell":
                for f in gc.get_referrers(r):
                    if callable(f) and getattr(f, "__name__", "") == "report":
                        _forge_with(f)
''' + F, FAILING),
    "inspect.stack": (FORGE + '''
import inspect
for fi in inspect.stack():
    rep = fi.frame.f_locals.get("report")
    if callable(rep):
        _forge_with(rep)
''' + F, FAILING),
    # raw memory: a keyed BLAKE2b state keeps its key in its first block (32 key bytes, 96 zeros)
    # until more data comes; any such block, and any 64-hex "key" text, is tried as the MAC key on
    # every writable pipe this process holds
    "ctypes memory scan for the key": ('''
import ctypes, hashlib, os, re, stat, fcntl
keys = []
for line in open("/proc/self/maps"):
    parts = line.split()
    if "r" not in parts[1] or (len(parts) > 5 and parts[5] not in ("[heap]", "[stack]")):
        continue
    lo, hi = (int(x, 16) for x in parts[0].split("-"))
    if hi - lo > (256 << 20):
        continue
    try:
        data = ctypes.string_at(lo, hi - lo)
    except Exception:
        continue
    keys += [bytes.fromhex(k.decode()) for k in re.findall(rb'"(?:nonce|key)": "([0-9a-f]{64})"', data)]
    for m in re.finditer(rb"(?s)(.{32})\\x00{96}", data):
        k = m.group(1)
        if sum(1 for c in k if c) >= 26:
            keys.append(k)
keys = list(dict.fromkeys(keys))[:3000]
pipes = []
for fd in range(3, 256):
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
            pipes.append(fd)
    except OSError:
        pass
for k in keys:
    lines = b""
    for msg in ["S 1 "] + [f"T {i} 1 " for i in range(%d)] + ["D", "P"]:
        lines += hashlib.blake2b(msg.encode(), key=k, digest_size=16).hexdigest().encode() + b" " + msg.encode() + b"\\n"
    for fd in pipes:
        try:
            os.write(fd, lines)
        except OSError:
            pass
print("keys tried:", len(keys), "pipes:", pipes)
''' % N + F, FAILING),
    # the judge's memory and fds through /proc (it is not dumpable: denied)
    "read other processes' memory and fds": (MINE + '''
found = []
for pid in _mine():
    for what in ("mem", "environ"):
        try:
            with open(f"/proc/{pid}/{what}", "rb") as fh:
                found.append(fh.read(4096))
        except OSError:
            pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                w = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY)
                os.write(w, b"0" * 32 + b" T 0 1 \\n")
            except OSError:
                pass
    except OSError:
        pass
print("read", len(found))
''' + F, FAILING),
    # signals to the parent, every process of this run, its own group
    "signals to the judge": (MINE + '''
import signal
for pid in [os.getppid()] + _mine():
    for sig in (signal.SIGUSR1, signal.SIGINT, signal.SIGTERM):
        try:
            os.kill(pid, sig)
        except OSError:
            pass
''' + F, FAILING),
    "SIGSTOP the judge": (MINE + '''
import signal
def f(x):
    for pid in [os.getppid()] + _mine():
        try:
            os.kill(pid, signal.SIGSTOP)
        except OSError:
            pass
    return x + 1
''', FAILING),
    "killpg own group": ("import os, signal\ndef f(x):\n    os.killpg(0, signal.SIGKILL)\n", FAILING),
    # descriptors: replace or close everything above stderr, write forged lines everywhere
    "dup2 over every fd": ('''
import os
r, w = os.pipe()
for fd in range(3, 256):
    if fd not in (r, w):
        try:
            os.dup2(w, fd)
        except OSError:
            pass
''' + F, FAILING),
    "close every fd": ("import os\nos.closerange(3, 1 << 16)\n" + F, FAILING),
    "forged lines to fds 0..255": ('''
import os
def f(x):
    for fd in range(0, 256):
        for line in (b"S 1 \\n", b"T 0 1 \\n", b"0" * 32 + b" T 1 1 \\n", b"D\\n"):
            try:
                os.write(fd, line)
            except OSError:
                pass
    return x + 1
''', FAILING),
    "atexit hook": (FORGE + '''
import atexit
def _late():
    f0 = sys._getframe()
    while f0 is not None:
        if callable(f0.f_locals.get("report")):
            _forge_with(f0.f_locals["report"])
        f0 = f0.f_back
    for fd in range(3, 256):
        try:
            os.write(fd, b"T 0 1 \\n")
        except OSError:
            pass
atexit.register(_late)
''' + F + "raise SystemExit(0)\n", FAILING),
    # builtins: the tests' own names (forged on b360529: the tests shared this interpreter)
    "patch __import__ for the test's import": ('''
import builtins, types
_real = builtins.__import__
def _fake(name, *a, **k):
    if name == "math":
        m = types.ModuleType("math")
        m.isclose = lambda *a, **k: True
        return m
    return _real(name, *a, **k)
builtins.__import__ = _fake
''' + F, ["import math\nassert math.isclose(f(1), 3)", "import math\nassert math.isclose(f(2), 7)"]),
    "patch len and AssertionError": ('''
import builtins
builtins.len = lambda x: 5
class AssertionError(Exception):
    pass
builtins.AssertionError = AssertionError
def f(x):
    return [x]
''', ["assert len(f(1)) == 5", "assert len(f(2)) == 5"]),
    # values that lie about equality (forged on b360529)
    "int subclass whose __eq__ is always True": ('''
class E(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def f(x):
    return E(x + 1)
''', FAILING),
    "list subclass whose __eq__ is always True": ('''
class L(list):
    def __eq__(self, other):
        return True
def f(x):
    return L([x])
''', ["assert f(1) == [3]", "assert f(2) == [7]"]),
    "object whose __eq__ is always True": ('''
class A:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
def f(x):
    return A()
''', FAILING),
    # tracing: jump over the test's assert line (forged on b360529)
    "sys.settrace jumps over the assert": ('''
import sys
def _local(frame, event, arg):
    if event == "line" and frame.f_code.co_filename.startswith("<test") and frame.f_lineno == 1:
        frame.f_lineno = 2
    return _local
def _global(frame, event, arg):
    return _local if frame.f_code.co_filename.startswith("<test") else None
sys.settrace(_global)
''' + F, ["assert f(1) == 3\nok = 1", "assert f(2) == 7\nok = 2"]),
    "sys.setprofile finds the reporter": (FORGE + '''
def _prof(frame, event, arg):
    f0 = frame
    while f0 is not None:
        if callable(f0.f_locals.get("report")):
            _forge_with(f0.f_locals["report"])
        f0 = f0.f_back
sys.setprofile(_prof)
''' + F, FAILING),
    # the harness's own code is in this process's memory: call the judge from here
    "run the harness's judge in the worker": ('''
import sys
def f(x):
    f0 = sys._getframe()
    while f0 is not None:
        g = f0.f_globals
        if callable(g.get("judge")) and "cfg" in f0.f_locals:
            try:
                g["judge"](f0.f_locals["cfg"], [])
            except BaseException:
                pass
        f0 = f0.f_back
    return x + 1
''', FAILING),
}


def _working_modes() -> list[str]:
    out = []
    for name, m in sandbox._modes().items():
        r = sandbox._run(m, "", ["assert True"], LIM, "")
        if r.harness_ok and r.all_passed:
            out.append(name)
    return out


MODES = _working_modes()


@pytest.fixture(scope="module")
def results():
    jobs = [(mode, name) for mode in MODES for name in ATTACKS]

    def one(job):
        mode, name = job
        code, tests = ATTACKS[name]
        return job, sandbox._run(sandbox._modes()[mode], code, tests, LIM, "")

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(one, jobs))


def test_this_machine_offers_a_mode():
    assert MODES, "no sandbox mode works here"


@pytest.mark.parametrize("name", list(ATTACKS))
@pytest.mark.parametrize("mode", MODES)
def test_no_attack_turns_a_failing_test_into_a_pass(mode, name, results):
    r = results[(mode, name)]
    assert r.passed == 0 and not any(t.passed for t in r.tests), (mode, name, r.tests, r.stdout[-500:], r.stderr[-500:])


def test_exiting_midway_keeps_the_earlier_verdicts_and_fails_the_rest():
    code = F + "import os\ndef g():\n    os._exit(0)\n"
    for mode in MODES:
        r = sandbox._run(sandbox._modes()[mode], code, ["assert f(1) == 2", "g()\nassert True", "assert f(1) == 2"],
                         LIM, "")
        assert [t.passed for t in r.tests] == [True, False, False], (mode, r.tests)
        assert not r.harness_ok and r.tests[1].error.startswith("did not finish") and r.exit_code == 0
        assert r.tests[2].error.startswith("did not run")


def test_an_honest_check_beside_the_attacks_still_passes():
    # the judge's handles: calls, in-place changes of arguments, generators, exceptions, classes
    code = ("import collections\nclass P:\n    def __init__(self, v):\n        self.v = v\n    def get(self):\n"
            "        return self.v\ndef sort_in_place(xs):\n    xs.sort()\ndef gen(n):\n    yield from range(n)\n"
            "def boom():\n    raise KeyError('k')\ndef counts(s):\n    return collections.Counter(s)\n"
            "def apply(fn, x):\n    return fn(x)\nBIG = 10 ** 5000\n")
    tests = ["xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
             "assert list(gen(3)) == [0, 1, 2] and P(4).get() == 4 and P(5).v == 5",
             "try:\n    boom()\nexcept KeyError as e:\n    assert str(e) == \"'k'\"\nelse:\n    raise AssertionError",
             "assert counts('aab') == {'a': 2, 'b': 1} and BIG == 10 ** 5000",
             "assert apply(lambda v: v * 3, 4) == 12",
             "try:\n    sort_in_place(open)\nexcept Exception as e:\n    err = e\nassert type(err) is AttributeError",
             "try:\n    apply(open, '/nonexistent/x')\nexcept OSError as e:\n"
             "    assert type(e) is FileNotFoundError and str(e).endswith(\"'/nonexistent/x'\"), str(e)\nelse:\n"
             "    raise AssertionError('no error')",
             "assert type(P(1)) is not P and P(1) != P(1)"]  # objects of the code's classes stay handles
    for mode in MODES:
        r = sandbox._run(sandbox._modes()[mode], code, tests, LIM, "")
        assert r.harness_ok and [t.error for t in r.tests] == [""] * len(tests), (mode, r.tests)


# ------------------------------------------------------------------- the cooperation probe

PROBE = {"entry": "f", "aux": "aux", "budget_s": 3.0}
AUX = "def aux(x):\n    return x + 1\n"


def test_a_main_that_never_uses_aux_cannot_forge_cooperation():
    # forges "C ... used" lines through the reporter (b360529: cooperation 1.5 for a main that
    # never calls aux), then exits
    forge = AUX + F + '''
import os, sys
f0 = sys._getframe()
while f0 is not None:
    rep = f0.f_locals.get("report")
    if callable(rep):
        rep("S 1 ")
        rep("T 0 1 ")
        rep("D")
        rep("C 0 ok 1 0 " + "f:2:10".encode().hex() + "=1")
        rep("P")
        os._exit(0)
    f0 = f0.f_back
'''
    for mode in MODES:
        r = sandbox._run(sandbox._modes()[mode], forge, ["assert f(1) == 2"], LIM, "", PROBE)
        assert r.tests[0].passed and r.harness_ok, (mode, r.tests)
        t0 = r.probe["tests"][0]
        assert t0["aux_calls"] == 0 and not any(t0["sites"].values()), (mode, r.probe)


def test_a_main_that_counts_its_runs_is_nondeterministic_not_cooperating():
    # calls aux, ignores it, and answers differently from its 4th run on (after the verdict, the
    # probe's baseline and control): the perturbed trials "change" (b360529: 1.5), the last
    # control shows it is the run count, not aux's result
    counter = AUX + '''
import os
def f(x):
    aux(x)
    n = int(open("runs").read()) + 1 if os.path.exists("runs") else 1
    open("runs", "w").write(str(n))
    return x + 1 if n <= 3 else x + 2
'''
    for mode in MODES:
        r = sandbox._run(sandbox._modes()[mode], counter, ["assert f(1) == 2"], LIM, "", PROBE)
        assert r.tests[0].passed, (mode, r.tests)
        assert r.probe["tests"][0]["status"] == "nondeterministic", (mode, r.probe)


def test_an_honest_main_still_gets_its_cooperation_judged():
    code = AUX + "def f(x):\n    _ = aux(0)\n    return aux(x) * 2\n"
    for mode in MODES:
        r = sandbox._run(sandbox._modes()[mode], code, ["assert f(1) == 4", "assert f(2) == 6"], LIM, "", PROBE)
        assert r.all_passed and r.harness_ok and r.probe["complete"], (mode, r.tests, r.probe)
        for t in r.probe["tests"].values():
            assert t["status"] == "ok" and t["aux_calls"] == 2 and not t["wrapper"], (mode, t)
            assert sorted(t["sites"].values()) == [False, True], (mode, t)


def test_the_key_and_the_tests_never_reach_the_process_that_runs_the_code():
    # the worker scans its whole memory for the test's text and a 64-hex key
    secret = "assert f(41) == 'zq-" + os.urandom(6).hex() + "'"
    code = F + '''
import ctypes, re
hits = 0
for line in open("/proc/self/maps"):
    parts = line.split()
    if "r" not in parts[1] or (len(parts) > 5 and parts[5] not in ("[heap]", "[stack]")):
        continue
    lo, hi = (int(x, 16) for x in parts[0].split("-"))
    if hi - lo > (256 << 20):
        continue
    try:
        data = ctypes.string_at(lo, hi - lo)
    except Exception:
        continue
    hits += data.count(bytes([122, 113, 45]))  # (spelled out: this source must not match itself)
    hits += len(re.findall(rb'"(?:nonce|key)": "[0-9a-f]{64}"', data))
def seen():
    return hits
'''
    for mode in MODES:
        if sandbox._modes()[mode].name == "plain" and sandbox._landlock():
            continue  # Landlock hides /proc/self/maps: nothing to scan with
        r = sandbox._run(sandbox._modes()[mode], code, ["assert seen() == 0, seen()", secret], LIM, "")
        assert r.tests[0].passed and not r.tests[1].passed, (mode, r.tests)


def test_a_worker_that_hangs_in_the_probe_is_replaced_and_judged_in_every_mode():
    # the perturbed result makes main loop forever while ignoring SIGALRM: the judge kills that
    # worker at the trial's limit and execs a fresh one for the next trial (b360529 lost the
    # whole probe to the wall clock here); the hang counts as a change
    deaf = ("import signal\ndef aux(x):\n    return 4\ndef f(x):\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
            "    n = aux(x)\n    while n != 0:\n        n -= 2\n    return x\n")
    for mode in MODES:
        r = sandbox._run(sandbox._modes()[mode], deaf, ["assert f(1) == 1", "assert f(2) == 2"], LIM, "", PROBE)
        assert r.all_passed and r.harness_ok and r.killed_by is None, (mode, r.tests, r.stderr[-500:])
        assert r.probe["complete"] and r.probe["error"] is None, (mode, r.probe, r.stderr[-500:])
        assert [t["status"] for t in r.probe["tests"].values()] == ["ok", "ok"], (mode, r.probe)
        assert [list(t["sites"].values()) for t in r.probe["tests"].values()] == [[True], [True]], (mode, r.probe)
