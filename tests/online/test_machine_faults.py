"""The machine's faults are never the groups': the trainer service through its own loop on the
embedded model (fake samples), each fault reproduced as the machine makes it:

- a full disk during the adapter save (safetensors' own error, not an OSError) for several polls:
  nothing is set aside, and every group trains once the disk has room again, a lost big step in
  one step (a disk's fault makes no suspects; another fault's suspects are retried in halves);
- one task whose trainer cannot be built beside another task: the other trains;
- a truncated latest adapter: the trainer moves it aside and resumes from the version before,
  numbering on past it (no number names two adapters);
- the adapters folder lost while the store keeps its rows (a Space restarted on PostgreSQL
  without persistent storage): the trainer continues the numbering past the store's newest;
- a store error between a step's saves and its record: the next start records that step from the
  versions on disk, once, and its groups are not trained again;
- one trainer per store: a lease that a silent holder loses, and a step of a trainer that lost it
  is not recorded.
"""
from __future__ import annotations

import os
import shutil
import time

import pytest
import sqlalchemy as sa

from collab_app.online.service import LEASE_KEY, ServiceConfig, TrainerLease, TrainerService
from collab_app.online.store import LeaseLost
from helpers.service import AGENTS, TASK, TwoAgentTask, add_groups
from trainer import adapters


def make_service(store, tmp_path, tasks=None, **kw) -> TrainerService:
    base = dict(adapters_dir=str(tmp_path / "adapters"), return_mode="auto", dtype="float32", learning_rate=1e-3,
                micro_batch_size=4, poll_s=0.05, heartbeat_s=0.5, max_wait_s=0.0, min_groups=3)
    return TrainerService(ServiceConfig(**{**base, **kw}), store=store, tasks=tasks or {TASK.name: TASK})


def poll(svc, times: int = 1, wait: bool = True) -> list[str]:
    """Poll as the service's loop does (an error is logged and retried), waiting out the tasks'
    back-off (`wait`) or not (the loop's next poll comes after poll_s)."""
    did = []
    for _ in range(times):
        for until, _ in list(svc._retry_at.values()) if wait else ():
            time.sleep(max(0.0, until - time.monotonic()))
        try:
            did.append(svc.poll_once())
        except Exception as e:  # noqa: BLE001 - what run() does: log, back off, poll again
            did.append(f"error: {type(e).__name__}")
    return did


def versions(store, agent=AGENTS[0]) -> list[int]:
    return [v.version for v in store.adapter_versions(agent)]


def test_a_full_disk_sets_nothing_aside_and_learning_resumes(sqlite_store, tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    ids = add_groups(sqlite_store, 3)
    svc = make_service(sqlite_store, tmp_path, retry_s=0.05)
    svc.trainer_for(TASK.name)                               # version 0 saved while the disk had room
    real = safetensors.torch.save_file

    def full(*a, **kw):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                              "message: \"No space left on device\" })")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert poll(svc, 4) == ["error: SafetensorError"] * 4     # the step, again after each back-off: all fail
    assert svc._suspects == {}                               # the disk's fault: no group is suspected
    assert {sqlite_store.group(g).status for g in ids} == {"ready"}
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert poll(svc, 1) == ["trained"]                       # the disk has room: learning resumes at once
    assert sqlite_store.train_steps()[0]["group_ids"] == ids  # the lost step, whole
    poll(svc, 4)
    assert {sqlite_store.group(g).status for g in ids} == {"trained"}   # every group, none set aside
    assert sorted(g for s in sqlite_store.train_steps() for g in s["group_ids"]) == ids
    assert sqlite_store.closed_groups() == []


@pytest.mark.parametrize("fault", ["disk", "other"])
def test_a_big_step_lost_to_a_passing_fault_trains_again_at_once(sqlite_store, tmp_path, monkeypatch, fault):
    """A step lost to a full disk says nothing about its groups: they are no suspects, and its 8
    groups train again in ONE step once the disk has room. Lost to another error that passes
    (here a RuntimeError of the save), they are suspects, retried by halves, and all together
    after a step that trained: 2 steps (one at a time: 8)."""
    import safetensors.torch
    from safetensors import SafetensorError

    ids = add_groups(sqlite_store, 8)
    svc = make_service(sqlite_store, tmp_path, retry_s=0.05, min_groups=8)
    svc.trainer_for(TASK.name)
    real = safetensors.torch.save_file

    def failing(*a, **kw):
        if fault == "disk":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise RuntimeError("the save failed for a reason of its own")

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    assert poll(svc, 1) == [f"error: {'SafetensorError' if fault == 'disk' else 'RuntimeError'}"]
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    sizes = {"disk": [8], "other": [4, 4]}[fault]
    assert poll(svc, len(sizes)) == ["trained"] * len(sizes)
    assert [len(s["group_ids"]) for s in sqlite_store.train_steps()] == sizes
    assert {sqlite_store.group(g).status for g in ids} == {"trained"} and sqlite_store.closed_groups() == []


def test_storage_faults_are_told_apart():
    """`storage_fault`: a disk that refused a write, however the library says it."""
    import errno
    import sqlite3

    from safetensors import SafetensorError

    from collab_app.online.service import storage_fault

    yes = [OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EDQUOT, "quota"),
           OSError(errno.EROFS, "ro"), SafetensorError("I/O error: File too large (os error 27)"),
           SafetensorError('IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'),
           RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                        "data/0: file write failed"),
           sqlite3.OperationalError("database or disk is full")]
    chained = RuntimeError("saving version 3 failed")
    chained.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    no = [RuntimeError("CUDA error: an illegal memory access"), ValueError("bad group"), MemoryError(),
          OSError(errno.ENOENT, "No such file or directory"), RuntimeError("os error 2")]
    assert all(storage_fault(e) for e in [*yes, chained]), [e for e in yes if not storage_fault(e)]
    assert not any(storage_fault(e) for e in no), [e for e in no if storage_fault(e)]


class BrokenTask(TwoAgentTask):
    name = "svc-broken"

    @property
    def roles(self):
        raise RuntimeError("this task's trainer cannot be built")


def test_a_task_that_cannot_be_built_does_not_starve_the_others(sqlite_store, tmp_path):
    broken = add_groups(sqlite_store, 3)                     # the oldest groups: due first
    with sqlite_store.engine.begin() as c:
        c.execute(sa.text("UPDATE groups SET task = 'svc-broken'"))
    good = add_groups(sqlite_store, 3, seed=3)
    svc = make_service(sqlite_store, tmp_path, tasks={TASK.name: TASK, "svc-broken": BrokenTask()})
    assert poll(svc, 2, wait=False) == ["error: RuntimeError", "trained"]
    assert {sqlite_store.group(g).status for g in good} == {"trained"}
    assert {sqlite_store.group(g).status for g in broken} == {"ready"}   # waiting for their trainer, not set aside


def test_a_truncated_latest_adapter_is_moved_aside_and_numbering_goes_on(sqlite_store, tmp_path):
    add_groups(sqlite_store, 3)
    svc = make_service(sqlite_store, tmp_path)
    assert poll(svc) == ["trained"] and versions(sqlite_store) == [0, 1]
    latest = adapters.latest_version(str(tmp_path / "adapters"), AGENTS[0])[1]
    with open(os.path.join(latest, "adapter_model.safetensors"), "r+b") as f:
        f.truncate(100)
    add_groups(sqlite_store, 3, seed=3)
    svc = make_service(sqlite_store, tmp_path)               # a restart: the trainer is built again
    assert poll(svc) == ["trained"]
    assert versions(sqlite_store) == [0, 1, 2, 3]            # v1 unreadable: v0's weights as v2, the step v3
    assert versions(sqlite_store, AGENTS[1]) == [0, 1, 2]      # its own v1 was whole: the step wrote v2
    assert any(n.startswith(".corrupt-v000001") for n in os.listdir(tmp_path / "adapters" / AGENTS[0]))


def test_a_lost_adapters_folder_on_the_same_store_numbers_on(sqlite_store, tmp_path):
    add_groups(sqlite_store, 3)
    svc = make_service(sqlite_store, tmp_path)
    assert poll(svc) == ["trained"] and versions(sqlite_store) == [0, 1]
    shutil.rmtree(tmp_path / "adapters")                     # the Space restarted; its store did not
    add_groups(sqlite_store, 3, seed=3)
    svc = make_service(sqlite_store, tmp_path)
    assert poll(svc) == ["trained"]                          # used to raise "already has version 1" forever
    assert versions(sqlite_store) == [0, 1, 2, 3]
    newest = sqlite_store.adapter_versions(AGENTS[0])[-1]
    assert os.path.isdir(newest.path) and newest.path.endswith("v000003")
    assert len(sqlite_store.train_steps()) == 2


def test_a_store_error_after_the_saves_records_that_step_once(sqlite_store, tmp_path, monkeypatch):
    ids = add_groups(sqlite_store, 3)
    svc = make_service(sqlite_store, tmp_path, retry_s=0.05)
    real = sqlite_store.record_train_step

    def locked(*a, **kw):
        raise sa.exc.OperationalError("UPDATE groups", {}, Exception("database is locked"))

    monkeypatch.setattr(sqlite_store, "record_train_step", locked)
    assert poll(svc) == ["error: OperationalError"]
    assert versions(sqlite_store) == [0]                     # the versions' rows go with the step: none yet
    assert adapters.latest_version(str(tmp_path / "adapters"), AGENTS[0])[0] == 1   # saved on disk
    monkeypatch.setattr(sqlite_store, "record_train_step", real)
    poll(svc, 3)
    steps = sqlite_store.train_steps()
    assert [s["group_ids"] for s in steps] == [ids]          # recorded once, from the versions on disk
    assert steps[0]["metrics"]["reconciled"] is True
    assert versions(sqlite_store) == [0, 1]                  # not trained again on top of itself
    assert {sqlite_store.group(g).status for g in ids} == {"trained"}


def test_one_trainer_per_store(sqlite_store, monkeypatch):
    a, b = TrainerLease(sqlite_store, stale_s=0.3), TrainerLease(sqlite_store, stale_s=0.3)
    monkeypatch.setattr(TrainerLease, "_dead_here", staticmethod(lambda v: False))   # as if on two hosts
    assert a.try_take() is None
    assert b.try_take() == a.owner                           # held and beating: b waits
    assert a.beat() and b.try_take() == a.owner
    time.sleep(0.4)
    assert b.try_take() is None                              # a went silent for longer than stale_s
    assert sqlite_store.get_state(LEASE_KEY)["owner"] == b.owner
    assert a.beat() is False                                 # a learns it lost the lease
    with pytest.raises(LeaseLost):
        sqlite_store.record_train_step(1, {}, [], lease=a.key)
    assert sqlite_store.train_steps() == []
    sqlite_store.record_train_step(1, {}, [], lease=b.key)
    b.release()
    assert TrainerLease(sqlite_store, stale_s=60).try_take() is None   # released: free at once
