"""`collab serve` never waits for the engine race: where engine `auto` needs one and none is cached,
it runs in a background process of its own, niced, after the page is up, on the cores and with the
environment serve had before its split, and it ends with serve (web/serve.py BackgroundRace,
engines/engine_race.py main)."""
import os
import subprocess
import sys
import time

import pytest

from collab_app.web import serve
from collab_app.web.serve import BackgroundRace, ServeConfig


@pytest.fixture
def spawned(monkeypatch):
    """race_missing answers every base; Popen records instead of starting."""
    calls = {"asked": [], "started": []}

    class Proc:
        pid = 12345

        def poll(self):
            return 0

    monkeypatch.setattr("collab_app.engines.choose.race_missing",
                        lambda bases: calls["asked"].append(list(bases)) or list(dict.fromkeys(bases)))
    monkeypatch.setattr(serve.subprocess, "Popen", lambda cmd, **kw: calls["started"].append((cmd, kw)) or Proc())
    monkeypatch.delenv("COLLAB_ENGINE", raising=False)
    return calls


def test_a_missing_race_runs_in_the_background_niced_on_the_cores_and_env_before_the_split(spawned, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    race = BackgroundRace.wanted(ServeConfig(), ["/base", "/other", "/base"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")                 # the split narrows serve after this
    race.start(after_s=0.0)
    end = time.monotonic() + 10
    while not spawned["started"] and time.monotonic() < end:
        time.sleep(0.01)
    (cmd, kw), = spawned["started"]
    assert cmd == [sys.executable, "-m", "collab_app.engines.engine_race", "/base", "/other"]
    assert kw["start_new_session"] is True and kw["preexec_fn"] == race._in_child
    assert kw["env"]["OMP_NUM_THREADS"] == "8"                  # every thread, as the race's key says
    from collab_app.cpu.cores import usable_cores
    assert race.cores == usable_cores()
    race.stop()


def test_a_race_stopped_before_its_time_never_starts(spawned):
    race = BackgroundRace.wanted(ServeConfig(), ["/base"])
    race.start(after_s=0.5)
    race.stop()
    time.sleep(1.0)
    assert spawned["started"] == []


def test_nothing_missing_starts_nothing(spawned, monkeypatch):
    monkeypatch.setattr("collab_app.engines.choose.race_missing", lambda bases: [])
    assert BackgroundRace.wanted(ServeConfig(), ["/base"]) is None


@pytest.mark.parametrize("cfg, env", [(ServeConfig(engine="transformers"), None), (ServeConfig(engine="vllm"), None),
                                      (ServeConfig(), "transformers"), (ServeConfig(), "http://127.0.0.1:8000"),
                                      (ServeConfig(engine_url="http://127.0.0.1:8000"), None)])
def test_an_engine_chosen_by_hand_or_remote_races_nothing(spawned, monkeypatch, cfg, env):
    if env:
        monkeypatch.setenv("COLLAB_ENGINE", env)
    assert BackgroundRace.wanted(cfg, ["/base"]) is None
    assert spawned == {"asked": [], "started": []}


def test_the_background_race_ends_with_the_process_that_started_it(tmp_path):
    """serve killed (SIGKILL, no clean-up): the race notices its parent is gone and ends its
    process group within seconds, instead of racing on as an orphan."""
    parent = ("import subprocess, sys\n"
              "p = subprocess.Popen([sys.executable, '-m', 'collab_app.engines.engine_race', '--after-s', '600', "
              f"{str(tmp_path)!r}], start_new_session=True)\n"
              "print(p.pid, flush=True)\n"
              "import time; time.sleep(3)\n")   # then it exits without stopping the race
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    end = time.monotonic() + 15
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, 9)
    pytest.fail("the background race outlived its parent")
