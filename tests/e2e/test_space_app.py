"""The app the way a Hugging Face Space runs it: app.py as a non-root user, no user namespaces.

tests/helpers/spacelike.py builds that container on this root machine (uid 65534, no capabilities, user
namespaces off for that container only). Inside, the sandbox can only reach "plain", so the app
must fail closed: the page says which isolation it has, "My own coding problem" is not offered
(with the reason and the fix), and the handler refuses a person's own tests on every path that
reaches it (here the OpenAI-compatible API, which has no page to hide anything in). Built-in
HumanEval problems still work: their tests are ours. With COLLAB_SANDBOX_ALLOW_WEAK=1 the same
app offers it again.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest

from helpers.launch import free_port
from helpers.spacelike import available, run_space_like

pytestmark = pytest.mark.slow

KEY = "space-test-key-9f3kQ2xZ7wLm"

# Runs inside the container as uid 65534: starts app.py exactly as a Space does (PORT, env), then
# looks at it over loopback and prints one JSON line.
SCRIPT = r'''
import json, os, subprocess, sys, time
import httpx
port = int(os.environ["PORT"])
app = subprocess.Popen([sys.executable, os.path.join(os.environ["REPO"], "app.py")], cwd=os.environ["HOME"],
                       stdout=open(os.path.join(os.environ["HOME"], "app.log"), "w"), stderr=subprocess.STDOUT)
out = {"uid": os.getuid()}
try:
    base = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 240
    while True:
        if app.poll() is not None:
            raise SystemExit("app.py exited:\n" + open(os.path.join(os.environ["HOME"], "app.log")).read()[-3000:])
        try:
            config = httpx.get(base + "/config", timeout=5).json()
            break
        except Exception:
            if time.monotonic() > end:
                raise
            time.sleep(1)
    by_id = {c["props"].get("elem_id"): c["props"] for c in config["components"] if c.get("props", {}).get("elem_id")}
    out["isolation"] = by_id["code-isolation"]["value"]
    out["own_off"] = by_id["code-own-off"]["value"] if by_id["code-own-off"].get("visible", True) else ""
    out["sources"] = [c[1] for c in by_id["code-source"]["choices"]]
    out["storage_warning"] = "storage-warning" in by_id
    auth = {"Authorization": "Bearer " + os.environ["COLLAB_API_KEYS"]}
    own = {"model": "humaneval", "n": 2, "max_tokens": 4,
           "messages": [{"role": "user", "content": 'def add(a, b):\n    """Add."""\n'}],
           "collab": {"tests": "assert add(1, 2) == 3", "entry_point": "add"}}
    r = httpx.post(base + "/v1/chat/completions", json=own, headers=auth, timeout=120)
    out["own_api"] = [r.status_code, r.json()]
    he = httpx.get(base + "/v1/models/humaneval", headers=auth, timeout=30).json()
    out["humaneval_model"] = he.get("id")
    out["home_mode"] = oct(os.stat(os.environ["COLLAB_HOME"]).st_mode & 0o777)
finally:
    app.terminate()
    try:
        app.wait(60)
    except subprocess.TimeoutExpired:
        app.kill()
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def model_copy(model_path):
    """The embedded model where uid 65534 can read it (its home under /root is hidden and 0700)."""
    d = tempfile.mkdtemp(prefix="collab-space-model-")
    os.chmod(d, 0o755)
    dst = os.path.join(d, "model")
    shutil.copytree(model_path, dst)
    for root, dirs, files in os.walk(dst):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    yield dst
    shutil.rmtree(d, ignore_errors=True)


def run_app(model_copy, **env) -> dict:
    why = available()
    if why:
        pytest.skip(f"cannot build a Space-like container here: {why}")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = run_space_like(SCRIPT, env={
        "REPO": repo, "PORT": str(free_port()), "COLLAB_MODEL": model_copy, "SPACE_ID": "test/collab",
        "COLLAB_SERVE_ARGS": "--engine transformers --trainer off --tasks humaneval --max-new-tokens 8",
        "COLLAB_API_KEYS": KEY, "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "1",
        # the suite's rule (tests/conftest.py): no dtype calibration in a fresh COLLAB_HOME (each run
        # here calibrated: 30-31 s a run against 22-27 s without, 2-core AVX2 CPU;
        # tests/engines/test_calibrate.py tests it); the container's environment is not the suite's
        "COLLAB_CALIBRATE": os.environ.get("COLLAB_CALIBRATE", "0"), **env},
        timeout=420)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"exit {r.returncode}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_a_space_fails_closed(model_copy):
    out = run_app(model_copy)
    assert out["uid"] == 65534
    assert "plain" in out["isolation"]                       # the page says what it has
    assert out["sources"] == ["HumanEval problem"]           # own problems are not offered ...
    assert "COLLAB_SANDBOX_ALLOW_WEAK=1" in out["own_off"] and "user namespaces" in out["own_off"]
    status, body = out["own_api"]                            # ... nor accepted by the handler
    assert status == 400 and "off on this server" in body["error"]["message"], body
    assert out["humaneval_model"] == "humaneval"             # built-in problems still served
    assert out["storage_warning"]                            # SPACE_ID without /data: ephemeral
    assert out["home_mode"] == "0o700"


def test_allow_weak_turns_own_problems_back_on(model_copy):
    # a Space is public (SPACE_ID): ALLOW_WEAK alone stops the start (exit 2, tests/web/test_secrets_apart.py);
    # the second flag says the operator accepts it
    out = run_app(model_copy, COLLAB_SANDBOX_ALLOW_WEAK="1", COLLAB_SANDBOX_ALLOW_WEAK_PUBLIC="1")
    assert out["sources"] == ["HumanEval problem", "My own coding problem"] and not out["own_off"]
    assert "plain" in out["isolation"]
    status, body = out["own_api"]
    assert status == 200 and len(body["choices"]) == 2, body
