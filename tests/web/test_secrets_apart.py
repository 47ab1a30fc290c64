"""Secrets and code apart (issue 21, item 4; collab_app/secret_env.py, collab_app/web/serve.py,
collab_app/online/service.py):

- COLLAB_SANDBOX_ALLOW_WEAK=1 on a public host stops `collab serve` with exit 2 before anything
  is created, unless COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC=1 accepts it;
- serve and the trainer drop their secrets from os.environ and are non-dumpable; the trainer
  child gets the store URL in its environment, not on its command line; log lines mask the
  database password;
- a process sealed by secret_env cannot be read by another process of the same uid without
  capabilities (/proc/<pid>/environ, /mem), and model code in the sandbox (a direct run and a
  HumanEval check) cannot read the app's environment: in a Space-like container
  (tests/helpers/spacelike.py: uid 65534, no user namespaces, so the sandbox is "plain" and the code has
  the app's uid), with a control in the same container showing the same reads do work on a
  process that is not sealed, and on this host in whatever mode the sandbox picks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from collab_app import secret_env
from helpers.spacelike import available, run_space_like

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADMIN = "Zq8-vR2m_Lp5xWn7Kc4T"                      # passes context.admin_token_problem
API_KEY = "kA7-xQ2m_Rt9pLz4Vn8w"
DB_PASSWORD = "pw-9f3kQ7zL"
DB = f"postgresql://collab:{DB_PASSWORD}@127.0.0.1:1/collab"
SECRET_ENV = {"COLLAB_ADMIN_TOKEN": ADMIN, "COLLAB_API_KEYS": API_KEY, "HF_TOKEN": "hf_fakeFAKEfake123",
              "HUGGING_FACE_HUB_TOKEN": "hf_otherFAKE456", "COLLAB_DB": DB}


def base_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in (*secret_env.SECRET_ENVS, "SPACE_ID", "COLLAB_SANDBOX_ALLOW_WEAK",
                        "COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC", "COLLAB_SESSION_SECRET")}
    env.update(COLLAB_HOME=str(tmp_path / "home"), GRADIO_ANALYTICS_ENABLED="False", **extra)
    return env


# --------------------------------------------------------------------------- ALLOW_WEAK in public

def test_allow_weak_on_a_public_host_stops_the_start_with_exit_2(tmp_path):
    env = base_env(tmp_path, COLLAB_SANDBOX_ALLOW_WEAK="1")
    r = subprocess.run([sys.executable, "-m", "collab_app.web.serve", "--host", "0.0.0.0"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "COLLAB_SANDBOX_ALLOW_WEAK=1 on a public app" in r.stderr and "0.0.0.0" in r.stderr
    assert "COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC=1" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "home").exists()          # stopped before it created anything


@pytest.mark.parametrize("argv, extra, where", [
    (["--share"], {}, "--share"),
    ([], {"SPACE_ID": "someone/collab"}, "SPACE_ID"),
    (["--host", "192.168.1.7"], {}, "192.168.1.7"),
])
def test_every_public_form_is_refused(tmp_path, monkeypatch, capsys, argv, extra, where):
    from collab_app.web.serve import cli_main

    for k in ("COLLAB_ADMIN_TOKEN", "COLLAB_API_KEYS", "COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLLAB_SANDBOX_ALLOW_WEAK", "1")
    for k, v in extra.items():
        monkeypatch.setenv(k, v)
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "on a public app" in err and where in err
    assert not (tmp_path / "home").exists()


def test_allow_weak_passes_on_loopback_or_with_the_second_flag(monkeypatch, caplog):
    from collab_app.web.serve import ServeConfig, check_weak_sandbox

    monkeypatch.delenv("SPACE_ID", raising=False)
    monkeypatch.delenv("COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC", raising=False)
    monkeypatch.setenv("COLLAB_SANDBOX_ALLOW_WEAK", "1")
    check_weak_sandbox(ServeConfig(host="127.0.0.1"))            # one person's machine: allowed
    check_weak_sandbox(ServeConfig(host="localhost"))
    with pytest.raises(ValueError, match="on a public app"):
        check_weak_sandbox(ServeConfig(host="0.0.0.0"))
    monkeypatch.setenv("COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC", "yes")  # only "1" counts, as for ALLOW_WEAK
    with pytest.raises(ValueError):
        check_weak_sandbox(ServeConfig(host="0.0.0.0"))
    monkeypatch.setenv("COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC", "1")
    with caplog.at_level("WARNING"):
        check_weak_sandbox(ServeConfig(host="0.0.0.0"))
    assert "accepted" in caplog.text
    monkeypatch.delenv("COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC")
    monkeypatch.setenv("COLLAB_SANDBOX_ALLOW_WEAK", "true")      # the sandbox ignores it: nothing is weakened
    check_weak_sandbox(ServeConfig(host="0.0.0.0"))


# --------------------------------------------------------------------------- serve and the trainer

SERVE_SCRIPT = r'''
import json, os, sys
import collab_app.web.context as C
import collab_app.web.serve as S
from collab_app import secret_env
seen = {}
class FakeChild:
    def __init__(self, argv, cores=None, env=None, **kw):
        seen["argv"], seen["env"] = argv, env
    def start(self):
        return self
    def stop(self, *a, **k):
        pass
S.ChildTrainer = FakeChild
def stop(**kw):
    seen["environ"] = {k: os.environ.get(k) for k in secret_env.SECRET_ENVS + ("COLLAB_SESSION_SECRET",)}
    seen["dumpable"] = secret_env.dumpable()
    seen["store_url"] = kw["store_url"]
    seen["hf"] = secret_env.hf_token()
    with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
        seen["cmdline"] = f.read().decode("latin-1")
    print("SEEN " + json.dumps(seen), flush=True)
    os._exit(0)
C.build_context = stop
sys.exit(S.cli_main(sys.argv[1:]))
'''


def run_serve(tmp_path, model_path, *argv, **extra_env) -> tuple[dict, str]:
    env = base_env(tmp_path, **SECRET_ENV, COLLAB_SESSION_SECRET="s" * 8 + "Q7-zLp5xWn7Kc4TvR2m_abcdefghij", **extra_env)
    r = subprocess.run([sys.executable, "-c", SERVE_SCRIPT, "--model", model_path, "--engine-cores", "-1", *argv],
                       env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("SEEN ")), None)
    assert r.returncode == 0 and line, (r.returncode, r.stdout[-1000:], r.stderr[-3000:])
    return json.loads(line[5:]), r.stderr


def test_serve_drops_its_secrets_is_not_dumpable_and_keeps_the_db_off_the_command_line(tmp_path, model_path):
    seen, log = run_serve(tmp_path, model_path, "--host", "0.0.0.0", COLLAB_SANDBOX_ALLOW_WEAK="1",
                          COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC="1")
    assert "COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC=1 says that is accepted" in log      # the second flag lets it start
    assert all(v is None for v in seen["environ"].values()), seen["environ"]   # nothing left for children
    assert seen["dumpable"] is False
    assert seen["store_url"] == DB and seen["hf"] == "hf_fakeFAKEfake123"     # read once, still used
    assert seen["env"] == {"COLLAB_DB": DB}                                   # the trainer child's store URL...
    assert DB_PASSWORD not in " ".join(seen["argv"]) and "--db" not in seen["argv"]   # ...never on its argv
    for secret in (ADMIN, API_KEY, DB_PASSWORD, "hf_fake"):
        assert secret not in log and secret not in seen["cmdline"]


def test_serve_masks_the_db_password_in_its_log(tmp_path, model_path):
    seen, log = run_serve(tmp_path, model_path, "--trainer", "external")
    assert "collab trainer --db postgresql://collab:***@127.0.0.1:1/collab" in log, log[-2000:]
    assert DB_PASSWORD not in log


TRAINER_SCRIPT = r'''
import json, os, sys
import collab_app.online.service as S
from collab_app import secret_env
class Fake:
    def __init__(self, cfg):
        print("SEEN " + json.dumps({"db": cfg.db, "dumpable": secret_env.dumpable(), "hf": secret_env.hf_token(),
                                    "environ": [k for k in secret_env.SECRET_ENVS if k in os.environ]}), flush=True)
        self.stop_event = None
    def run(self):
        return 0
S.TrainerService = Fake
sys.exit(S.cli_main(sys.argv[1:]))
'''


def test_the_trainer_reads_the_db_from_its_environment_and_drops_its_secrets(tmp_path):
    url = f"sqlite:///{tmp_path}/c.db"
    env = base_env(tmp_path, **{**SECRET_ENV, "COLLAB_DB": url})
    r = subprocess.run([sys.executable, "-c", TRAINER_SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("SEEN ")), None)
    assert r.returncode == 0 and line, (r.stdout[-1000:], r.stderr[-3000:])
    seen = json.loads(line[5:])
    assert seen == {"db": url, "dumpable": False, "hf": "hf_fakeFAKEfake123", "environ": []}, seen


def test_child_trainer_passes_its_env_to_the_process(monkeypatch):
    import collab_app.web.serve as S

    got = {}

    class P:
        def __init__(self, cmd, env=None, **kw):   # kw: stderr=PIPE (its last lines say why it crashed)
            got["cmd"], got["env"] = cmd, env

        def wait(self):
            import time
            time.sleep(3600)

    monkeypatch.setattr(S.subprocess, "Popen", P)
    child = S.ChildTrainer(S.trainer_argv(S.ServeConfig(), "/a", "/m"), env=S.trainer_env(DB))
    child._watch.daemon = True
    child.start()
    assert got["env"]["COLLAB_DB"] == DB and not any(DB_PASSWORD in a for a in got["cmd"])


def test_mask_url():
    assert secret_env.mask_url(DB) == "postgresql://collab:***@127.0.0.1:1/collab"
    assert secret_env.mask_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    assert DB_PASSWORD not in secret_env.mask_url(f"not a url://u:{DB_PASSWORD}@h/x")


# --------------------------------------------------------------------------- reading the app from outside

READER = r'''
import json, sys
pid, out = sys.argv[1], {}
for name in ("environ", "mem", "cmdline"):
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            out[name] = "READ " + (f.read(1 << 16).decode("latin-1") if name != "mem" else "opened")
    except OSError as e:
        out[name] = f"{type(e).__name__}: {e.strerror}"
print(json.dumps(out))
'''

# Model code: looks through /proc for tokens, as a hostile answer would (it does not know the
# values); reports whether it could see the app's pid at all.
LEAK_FN = r'''
def _leak(app_pid):
    import os
    hits, seen, refused = [], False, 0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        seen = seen or p == str(app_pid)
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            refused += 1
            continue
        hits += [v.decode("latin-1") for v in env if v.startswith((b"COLLAB_ADMIN_TOKEN=", b"HF_TOKEN="))]
    return f"LEAK {hits} SAW_APP {seen} REFUSED {refused}"
'''

SPACE_SCRIPT = r'''
import json, os, subprocess, sys
from collab_app import secret_env
from tasks import sandbox
from tasks import load_task
READER, LEAK_FN = %r, %r
app = os.getpid()

def read(pid):
    r = subprocess.run([sys.executable, "-c", READER, str(pid)], capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout)

def sandboxed():
    r = sandbox.run_tests(LEAK_FN + f"\nprint(_leak({app}))\n", ["assert True"])
    return "\n".join([r.stdout, r.stderr, r.setup_error or ""])

task = load_task("humaneval")
ex = task.examples("eval")[0]
# the coding task keeps the answer's function alone: the search goes inside it
main = (f"def {ex['entry_point']}(*args, **kwargs):\n" + "".join("    " + ln for ln in LEAK_FN.splitlines(True))
        + f"    raise AssertionError(_leak({app}))\n    return 0\n")
def humaneval(when):   # `when` makes each call's answer new: the task caches scores by answer
    outputs = [f"def aux(x):\n    # {when}\n    return x\n", main]
    return json.dumps(task.reward(ex, outputs).details) + "\n" + "\n".join(task.feedback(ex, outputs))

out = {"uid": os.getuid(), "mode": sandbox.isolation()["mode"], "landlock": sandbox.isolation()["landlock"]}
# control: a process of the same uid holding the secrets, not sealed
ctl = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
out["control"] = read(ctl.pid)
ctl.kill()
# a process started with the secrets that seals itself through the helper
helper = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom collab_app.secret_env import seal\nseal()\n"
                           "print('sealed', flush=True)\ntime.sleep(120)"], stdout=subprocess.PIPE, text=True)
assert helper.stdout.readline().strip() == "sealed"
out["sealed_helper"] = read(helper.pid)
helper.kill()
# this process is the app: model code before and after it seals itself
out["before"] = {"self": read(app), "sandbox": sandboxed(), "humaneval": humaneval("before")}
secret_env.seal()
out["after"] = {"self": read(app), "sandbox": sandboxed(), "humaneval": humaneval("after"),
                "environ": [k for k in secret_env.SECRET_ENVS if k in os.environ], "dumpable": secret_env.dumpable()}
print("OUT " + json.dumps(out), flush=True)
''' % (READER, LEAK_FN)

SPACE_WHY = available()
SECRETS = (ADMIN, "hf_fakeFAKEfake123")


def leaked(text: str) -> bool:
    return any(s in text for s in SECRETS)


@pytest.mark.skipif(bool(SPACE_WHY), reason=f"no Space-like container here: {SPACE_WHY}")
def test_in_a_space_like_container_model_code_cannot_read_the_sealed_app():
    p = run_space_like(SPACE_SCRIPT, env=dict(SECRET_ENV), timeout=300)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("OUT ")), None)
    assert p.returncode == 0 and line, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    out = json.loads(line[4:])
    assert out["uid"] == 65534 and out["mode"] == "plain"     # the sandbox's code has the app's uid here
    # control: a same-uid process without capabilities reads an unsealed process's environment
    assert out["control"]["environ"].startswith("READ ") and ADMIN in out["control"]["environ"], out["control"]
    # ... but not one sealed by secret_env (the command line stays readable: nothing secret on it)
    sealed = out["sealed_helper"]
    assert sealed["environ"].startswith("PermissionError") and sealed["mem"].startswith("PermissionError"), sealed
    assert sealed["cmdline"].startswith("READ ") and not leaked(json.dumps(sealed))
    before, after = out["before"], out["after"]
    # before the app seals itself, a same-uid reader gets the token
    assert leaked(before["self"]["environ"]), before
    if out["landlock"]:
        # where the kernel has Landlock the sandbox confines "plain" runs: model code cannot even list
        # /proc, so neither the unsealed nor the sealed app is reachable from it (two walls, not one)
        assert out["landlock"]["files"] and out["landlock"]["abi"] >= 1
        for run in (before["sandbox"], before["humaneval"], after["sandbox"], after["humaneval"]):
            assert "Permission denied: '/proc'" in run and "SAW_APP" not in run, run
        assert not leaked(json.dumps(before["sandbox"])) and not leaked(before["humaneval"]), before
    else:
        # without Landlock: sandboxed model code and a HumanEval check get it too ...
        assert leaked(before["sandbox"]) and leaked(before["humaneval"]), before
        # ... and after sealing nothing, although the app's pid is in plain sight of that code
        assert "SAW_APP True" in after["sandbox"] and "SAW_APP True" in after["humaneval"], after
    assert after["environ"] == [] and after["dumpable"] is False
    assert after["self"]["environ"].startswith("PermissionError") and after["self"]["mem"].startswith("PermissionError")
    assert not leaked(json.dumps(after)), after


def test_on_this_host_model_code_cannot_read_the_app_in_the_mode_the_sandbox_picks(tmp_path):
    """The app (a subprocess started with the secrets, sealed) runs the same hostile model code in
    the sandbox's own choice of mode here (as root: "namespaces", where the app's pid is not even
    visible), directly and as a HumanEval check."""
    script = SPACE_SCRIPT.split("out = {")[0] + (
        "secret_env.seal()\n"
        "print('OUT ' + json.dumps({'mode': sandbox.isolation()['mode'], 'sandbox': sandboxed(), "
        "'humaneval': humaneval('host')}), flush=True)\n")
    r = subprocess.run([sys.executable, "-c", script], env=base_env(tmp_path, **SECRET_ENV), capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("OUT ")), None)
    assert r.returncode == 0 and line, (r.stdout[-2000:], r.stderr[-3000:])
    out = json.loads(line[4:])
    assert "LEAK" in out["sandbox"] and "LEAK" in out["humaneval"], out     # the code ran
    assert not leaked(json.dumps(out)), out
