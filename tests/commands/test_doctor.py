"""`collab doctor` (collab_app/commands/doctor.py): the report's parts in-process on this machine,
the training verdicts on a real store, and the probe with the transformers engine (vLLM is never
started here)."""
from __future__ import annotations

import json
import os
import time

import pytest

from collab_app.commands import doctor
from collab_app.engines.engine_types import Sample
from collab_app.online.service import PAUSE_KEY, STATUS_KEY
from tasks.base import Reward


def run(capsys, *argv) -> str:
    assert doctor.cli_main(list(argv)) == 0
    return capsys.readouterr().out


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path))
    monkeypatch.delenv("COLLAB_DB", raising=False)
    monkeypatch.delenv("COLLAB_ENGINE", raising=False)
    return tmp_path  # so sqlite_store (tmp_path/collab.db) is the store doctor finds here


def test_report_names_what_this_machine_gives_without_making_a_store(home, capsys):
    from collab_app.cpu import cores
    from tasks.sandbox import isolation, max_concurrent
    from trainer.dtypes import cpu_capability

    t0 = time.monotonic()
    rep = json.loads(run(capsys, "--json", "--tasks", "humaneval", "tldr"))
    assert time.monotonic() - t0 < 60
    assert rep["cpu"]["capability"] == cpu_capability() and rep["cpu"]["model"]
    b = rep["cpu_budget"]
    assert b["budget"] == cores.cpu_budget() and b["affinity"] == cores.affinity_cores()
    assert b["sandbox_max_concurrent"] == max_concurrent()
    assert (b["split"] is None) == (cores.plan(0) is None)
    assert rep["sandbox"]["mode"] == isolation()["mode"]
    assert rep["engine"]["kind"] in ("vllm", "transformers")
    assert [a["agent"] for a in rep["engine"]["agents"]] == ["helper", "main", "summary", "detail"]
    assert all(a["served"] is None and a["disk_latest"] is None for a in rep["engine"]["agents"])
    assert rep["training"]["verdict"].startswith("unknown: no store at")
    assert not (home / "collab.db").exists()   # reported, not created
    text = run(capsys, "--tasks", "humaneval")
    for heading in ("CPU\n", "CPU budget\n", "Sandbox\n", "Engine\n", "Training\n"):
        assert heading in text
    assert "serve's split" in text and "sandbox cap" in text and "verdict        unknown" in text


def test_budget_in_the_report_follows_a_cgroup_quota(home, capsys, monkeypatch, tmp_path):
    import collab_app.cpu.cores as cs

    root = tmp_path / "cg"
    (root / "c").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu")
    (root / "c" / "cpu.max").write_text("150000 100000")
    (tmp_path / "self-cgroup").write_text("0::/c\n")
    monkeypatch.setattr(cs, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(cs, "PROC_CGROUP", str(tmp_path / "self-cgroup"))
    monkeypatch.setattr(cs, "_BEFORE_SPLIT", None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(cs, "_on_gpu", lambda: False)
    b = doctor.budget_info(0)
    assert (b["quota_cpus"], b["budget"], b["usable_cores"]) == (1.5, 2, [0, 1])
    assert b["split"] == {"engine": [0], "trainer": [1]}
    text = run(capsys, "--tasks", "humaneval")
    assert "cgroup quota   1.5 CPUs (" in text and "budget         2 CPUs: cores 0,1" in text


def _group(store, rated: bool) -> int:
    samples = [[Sample(agent=a, adapter_version=0, prompt_token_ids=[1, 2], text=f"{a} {g}", token_ids=[3 + g],
                       logprobs=[-1.0]) for g in range(2)] for a in ("helper", "main")]
    gid, jids = store.add_group("humaneval", {"id": "HumanEval/0", "prompt": "def f():"}, ["p", "q"], samples,
                                [(0, 0), (1, 1)], [Reward(g, {"tests": g}, 4.0) for g in (0.0, 1.0)])
    if rated:   # human_first: a group is ready once people rated it (or after the timeout)
        for j, v in zip(jids, (2, 5)):
            store.add_rating(j, "rater", v)
    return gid


def test_training_verdicts_from_the_store(home, sqlite_store, capsys):
    adapters = home / "adapters"
    for v in (0, 1, 2):
        (adapters / "helper" / f"v{v:06d}").mkdir(parents=True)
        (adapters / "helper" / f"v{v:06d}" / "collab.json").write_text("{}")
        sqlite_store.record_adapter_version("helper", v, str(adapters / "helper" / f"v{v:06d}"))
    sqlite_store.pin_adapter("helper", 1)
    sqlite_store.record_train_step(3, {"task": "humaneval"}, [_group(sqlite_store, rated=False)])

    def verdict(state: str, beat_age: float = 0.0, **kw) -> dict:
        sqlite_store.set_state(STATUS_KEY, {"state": state, "heartbeat": time.time() - beat_age, "heartbeat_s": 5.0,
                                     "pid": 123, **kw})
        return json.loads(run(capsys, "--json", "--tasks", "humaneval", "--min-groups", "2"))

    rep = verdict("idle")
    t = rep["training"]
    assert t["last_step"]["step"] == 3 and t["last_step"]["groups"] == 1 and t["ready_groups"] == {}
    assert t["verdict"].startswith("waiting for groups: the trainer is alive")
    helper = rep["engine"]["agents"][0]
    assert (helper["served"], helper["pinned"], helper["disk_latest"]) == (1, True, 2)

    _group(sqlite_store, rated=True)
    _group(sqlite_store, rated=True)
    _group(sqlite_store, rated=False)   # not ready: nobody rated it and the timeout has not passed
    assert verdict("idle")["training"]["ready_groups"] == {"humaneval": 2}
    assert verdict("idle")["training"]["verdict"].startswith("a step is due (humaneval")
    assert verdict("training", step=4)["training"]["verdict"].startswith("advancing")
    assert "NOT ADVANCING: no live trainer" in verdict("idle", beat_age=3600)["training"]["verdict"]
    assert "ValueError: boom" in verdict("error", message="ValueError: boom")["training"]["verdict"]
    sqlite_store.set_state(PAUSE_KEY, {"paused": True})
    assert verdict("paused")["training"]["verdict"].startswith("PAUSED")
    text = run(capsys, "--tasks", "humaneval")
    assert "last step      #3," in text and "ready groups   humaneval 2" in text
    assert "helper         serves v1 (pinned); newest on disk v2" in text


def test_probe_compares_each_agent_with_transformers_and_catches_wrong_weights(home, sqlite_store, capsys, monkeypatch,
                                                                                lora_adapter, model_path):
    """helper: a version row naming a real adapter; main: no version (a random LoRA). The engine is
    made to serve main with helper's weights: helper and the base row stay equal, main differs.
    COLLAB_MODEL: the provisioned model, not a second conversion into this fresh COLLAB_HOME (48 s
    on an AVX2 CPU; provisioning has its own tests in tests/engines/test_model.py)."""
    monkeypatch.setenv("COLLAB_MODEL", model_path)
    from collab_app.engines.engine_hf import TransformersEngine

    helper_dir = lora_adapter(1)
    sqlite_store.record_adapter_version("helper", 4, helper_dir)
    load = TransformersEngine.load_adapter

    def mixed_up(self, agent, path, version):
        return load(self, agent, helper_dir if agent == "main" else path, version)
    monkeypatch.setattr(TransformersEngine, "load_adapter", mixed_up)
    rep = json.loads(run(capsys, "--json", "--probe", "--engine", "transformers", "--tasks", "humaneval",
                         "--probe-tokens", "8"))
    p = rep["probe"]
    rows = {a["agent"]: a for a in p["agents"]}
    assert p["engine"] == "transformers" and list(rows) == ["base", "helper", "main"]
    assert rows["base"]["equal"] and rows["helper"]["equal"]
    assert (rows["helper"]["source"], rows["helper"]["version"]) == ("store row", 4)
    assert rows["main"]["source"].startswith("random LoRA")
    assert not rows["main"]["equal"] and rows["main"]["first_difference"] == 0 and rows["main"]["prompt_equal"]
    assert rows["main"]["engine_text"] == rows["helper"]["engine_text"] != rows["main"]["reference_text"]
    assert not p["all_equal"] and not p["same_text_for_every_row"]


def test_closed_groups_are_listed_with_their_reason_and_put_back(home, sqlite_store, capsys):
    gid = _group(sqlite_store, rated=True)
    sqlite_store.set_aside([gid], "SafetensorError: the file is truncated")
    t = json.loads(run(capsys, "--json", "--tasks", "humaneval"))["training"]
    assert [(g["id"], g["status"], g["reason"]) for g in t["closed_groups"]] == [
        (gid, "untrainable", "SafetensorError: the file is truncated")]
    text = run(capsys, "--tasks", "humaneval")
    assert f"untrainable    #{gid} humaneval, 2 ratings: SafetensorError: the file is truncated" in text
    assert doctor.cli_main(["--json", "--tasks", "humaneval", "--put-back", str(gid)]) == 0
    assert "put 1 of 1 groups back" in capsys.readouterr().err
    assert sqlite_store.group(gid).status == "ready" and sqlite_store.closed_groups() == []
