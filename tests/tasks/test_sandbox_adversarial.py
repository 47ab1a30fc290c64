"""Adversarial suite for tasks/sandbox.py: hostile candidates AND hostile test snippets
(tests/helpers/sandbox_attacks.py: read host files, /proc, the environment; write outside; network;
fork, memory, disk and output floods; kill the caller; leftover processes; remount, unmount,
nested-namespace and chroot escapes; /proc/<pid>/mem), run in every isolation mode this
machine offers:

- "namespaces", "userns", "plain" (root without namespaces) in this process, forced through
  the private `sandbox._run(mode, ...)` (no environment variable lowers isolation);
- "space": a Space-like container (tests/helpers/spacelike.py: uid 65534, no user namespaces) where
  the app gets "plain" by itself, through the public run_tests(untrusted=True) with
  COLLAB_SANDBOX_ALLOW_WEAK=1.

Each (mode, attack) test asserts the concrete outcome: "contained", or for the weak modes the
documented exposure (docs/SANDBOX.md). All attacks of a mode run at once in
threads (the sandbox's own concurrency cap applies), the modes side by side.
`python tests/tasks/test_sandbox_adversarial.py` prints the table.
"""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (also when run as a script)
from helpers import sandbox_attacks as A  # noqa: E402
from helpers.spacelike import available, run_space_like  # noqa: E402

from tasks import sandbox  # noqa: E402

HOST_MODES = [m for m in ("namespaces", "userns", "plain") if m in sandbox._modes()]
NAMES = [a.name for a in A.ATTACKS]
LAST = "kill(-1, SIGKILL)"  # in "space" this kills the app: it runs last, on a bare Ctx
SPACE_WHY = available()

SPACE_SCRIPT = r'''
import json, os
os.environ["COLLAB_SANDBOX_ALLOW_WEAK"] = "1"
from tasks import sandbox
from helpers import sandbox_attacks as A
def run(code, tests, limits):
    return sandbox.run_tests(code, tests, limits, untrusted=True)
print("ISO " + json.dumps(sandbox.isolation()), flush=True)
with A.targets("space") as ctx:
    rows = A.run_all(ctx, run, [a.name for a in A.ATTACKS if a.name != %r])
print("ROWS " + json.dumps(rows), flush=True)
print("LAST", flush=True)
print("ROWS " + json.dumps([A.run_attack(A.BY_NAME[%r], A.bare("space"), run)]), flush=True)
''' % (LAST, LAST)


def host_mode_rows(mode: str) -> dict[str, dict]:
    m = sandbox._modes()[mode]
    check = sandbox._run(m, "", ["assert True"], A.FAST, "")
    if not check.harness_ok:
        return {"_unavailable": {"detail": f"{mode} does not work here: {check.setup_error} {check.stderr[-300:]}"}}
    with A.targets(mode) as ctx:
        return {r["attack"]: r for r in A.run_all(ctx, lambda c, t, lim: sandbox._run(m, c, t, lim, ""), workers=3)}


def space_mode_rows() -> tuple[dict, dict[str, dict]]:
    p = run_space_like(SPACE_SCRIPT, timeout=300)
    lines = p.stdout.splitlines()
    iso = next((json.loads(ln[4:]) for ln in lines if ln.startswith("ISO ")), None)
    assert iso is not None, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    rows = {r["attack"]: r for ln in lines if ln.startswith("ROWS ") for r in json.loads(ln[5:])}
    if LAST not in rows and "LAST" in lines:  # the app itself was killed by its sandboxed code
        a = A.BY_NAME[LAST]
        rows[LAST] = {"attack": LAST, "group": a.group, "where": a.where, "mode": "space", "proxy": False,
                      "note": a.note, "expected": a.expect["space"],
                      "outcome": A.X if p.returncode == 128 + 9 else "error",
                      "detail": f"the app was killed (exit {p.returncode})"}
    assert set(rows) == set(NAMES), (sorted(set(NAMES) - set(rows)), p.stderr[-3000:])
    return iso, rows


@pytest.fixture(scope="module")
def host_rows():
    with ThreadPoolExecutor(len(HOST_MODES)) as pool:
        return dict(zip(HOST_MODES, pool.map(host_mode_rows, HOST_MODES)))


@pytest.fixture(scope="module")
def space():
    if SPACE_WHY:
        pytest.skip(f"no Space-like container here: {SPACE_WHY}")
    return space_mode_rows()


def check(row: dict):
    assert row["outcome"] != "error", row
    assert row["outcome"] == row["expected"], row


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", HOST_MODES)
def test_attack_on_this_host(mode, name, host_rows):
    rows = host_rows[mode]
    if "_unavailable" in rows:
        pytest.skip(rows["_unavailable"]["detail"])
    check(rows[name])


@pytest.mark.parametrize("name", NAMES)
def test_attack_in_a_space_like_container(name, space):
    check(space[1][name])


def test_the_space_like_container_gets_plain_and_no_user_namespaces(space):
    iso = space[0]
    assert iso["mode"] == "plain" and not iso["strong"] and not iso["network_blocked"]
    assert iso["untrusted_allowed"]  # the script set COLLAB_SANDBOX_ALLOW_WEAK=1
    assert any(n.startswith("userns:") for n in iso["probe_notes"]), iso["probe_notes"]


FAIL_CLOSED = r'''
import json, os, subprocess
from tasks import sandbox as s
out = {"uid": os.getuid(), "iso": s.isolation(),
       "unshare": subprocess.run(["unshare", "--user", "true"], capture_output=True, text=True).returncode}
F = "def f(x):\n    return x + 1\n"
try:
    s.run_tests(F, ["assert f(1) == 2"], untrusted=True)
    out["untrusted"] = "ran"
except s.WeakSandboxError as e:
    out["untrusted"] = "WeakSandboxError: " + str(e)
from tasks.coding import CustomCodingTask
task = CustomCodingTask("def g(x):\n    \"x + 1\"\n", "assert candidate(1) == 2")
try:
    task.reward(task.example, ["def aux(x):\n    return x + 1\n", "def g(x):\n    return aux(x)\n"])
    out["custom"] = "ran"
except ValueError as e:
    out["custom"] = type(e).__name__
out["trusted"] = s.run_tests(F, ["assert f(1) == 2"]).all_passed  # model code vs our tests: still runs
os.environ["COLLAB_SANDBOX_ALLOW_WEAK"] = "1"
r = s.run_tests("import os\n" + F, ["assert f(1) == 2", "assert os.getuid() == 65534"], untrusted=True)
out["allowed"] = {"passed": r.all_passed, "iso": s.isolation()}
print(json.dumps(out))
'''


@pytest.mark.skipif(bool(SPACE_WHY), reason=f"no Space-like container here: {SPACE_WHY}")
def test_a_space_like_host_fails_closed_until_weak_isolation_is_allowed_explicitly():
    p = run_space_like(FAIL_CLOSED, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["uid"] == 65534 and out["unshare"] != 0  # non-root, no user namespaces
    iso = out["iso"]
    assert iso["mode"] == "plain" and iso["strong"] is False and iso["untrusted_allowed"] is False
    assert "WEAK" in iso["summary"] and "COLLAB_SANDBOX_ALLOW_WEAK=1" in iso["summary"]
    assert out["untrusted"].startswith("WeakSandboxError: refusing to run code or tests typed by a person")
    assert "COLLAB_SANDBOX_ALLOW_WEAK=1" in out["untrusted"] and "root" in out["untrusted"]
    assert out["custom"] == "WeakSandboxError" and out["trusted"] is True
    allowed = out["allowed"]
    assert allowed["passed"] and allowed["iso"]["mode"] == "plain" and allowed["iso"]["untrusted_allowed"]


if __name__ == "__main__":
    with ThreadPoolExecutor(len(HOST_MODES)) as pool:
        per_mode = dict(zip(HOST_MODES, pool.map(host_mode_rows, HOST_MODES)))
    rows = [r for rs in per_mode.values() for r in rs.values() if "attack" in r]
    if not SPACE_WHY:
        rows += list(space_mode_rows()[1].values())
    print(A.table(rows))
    bad = [r for r in rows if r["outcome"] != r["expected"]]
    print("\n".join(f"MISMATCH {r['mode']} {r['attack']}: {r['outcome']} ({r['detail']})" for r in bad) or "all as expected")
