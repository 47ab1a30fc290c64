"""Version slots (engines/version_slots.py): a state already held is not loaded again; a new one takes
the least recently used free slot; a slot leased by a request in flight is never reloaded; with
every slot busy a lease waits, then says so."""
from __future__ import annotations

import threading
import time

import pytest

from collab_app.engines.engine_types import EngineError
from collab_app.engines.version_slots import SlotsBusy, VersionSlots


class FakeEngine:
    """Records what each agent serves (the Engine calls the slots make)."""

    def __init__(self, max_agents: int | None = None):
        self.serving: dict[str, tuple[str | None, int | None]] = {}
        self.loads: list[tuple[str, str | None, int | None]] = []
        self.max_agents = max_agents

    def register_agent(self, agent):
        if agent not in self.serving and self.max_agents is not None and len(self.serving) >= self.max_agents:
            raise EngineError("this engine holds at most 1 agent")
        self.serving.setdefault(agent, (None, None))

    def load_adapter(self, agent, path, version):
        self.serving[agent] = (path, version)
        self.loads.append((agent, path, version))


def state(key, v):
    """A two-role state: both roles at version v (None: base)."""
    return key, {r: (v, None if v is None else f"/adapters/{r}/v{v}") for r in ("x", "y")}


ROLES = ["x", "y"]


def test_each_side_serves_its_versions_and_held_states_are_not_reloaded():
    eng = FakeEngine()
    slots = VersionSlots(eng, threading.RLock(), slots=3)
    with slots.serve([state("s1", 1), state("base", None)], ROLES) as (a, b):
        assert [eng.serving[n] for n in a] == [("/adapters/x/v1", 1), ("/adapters/y/v1", 1)]
        assert [eng.serving[n] for n in b] == [(None, None), (None, None)]
        assert set(a).isdisjoint(b)
    assert slots.loads == 2
    with slots.serve([state("base", None), state("s1", 1)], ROLES) as (b2, a2):
        assert (a2, b2) == (a, b)                  # both held: no load
    assert slots.loads == 2
    with slots.serve([state("s1", 1), state("s2", 2)], ROLES) as (_, c):
        assert [eng.serving[n][1] for n in c] == [2, 2]
    assert slots.loads == 3 and sorted(k for k in slots.held() if k) == ["base", "s1", "s2"]
    with slots.serve([state("s3", 3), state("s1", 1)], ROLES):   # the least recently used (base) goes
        pass
    assert "base" not in slots.held() and "s1" in slots.held()


def test_a_slot_in_flight_is_never_reloaded_and_a_full_house_waits_then_refuses():
    eng = FakeEngine()
    slots = VersionSlots(eng, threading.RLock(), slots=2, wait_s=0.3)
    lease = slots.serve([state("s1", 1), state("s2", 2)], ROLES)
    a, b = lease.__enter__()
    t0 = time.monotonic()
    with pytest.raises(SlotsBusy):
        with slots.serve([state("s3", 3)], ROLES):
            pass
    assert time.monotonic() - t0 >= 0.25
    assert [eng.serving[n][1] for n in a + b] == [1, 1, 2, 2]      # untouched while in flight
    with slots.serve([state("s2", 2)], ROLES) as (same,):          # a held state is shared
        assert same == b
    got = []
    waiter = threading.Thread(target=lambda: got.append(slots.serve([state("s3", 3)], ROLES).__enter__()))
    slots.wait_s = 5.0
    waiter.start()
    time.sleep(0.2)
    assert not got                                                  # still waiting for a free slot
    lease.__exit__(None, None, None)
    waiter.join(5)
    assert got and [eng.serving[n][1] for n in got[0][0]] == [3, 3]


def test_bad_leases_and_engine_limits_are_errors():
    slots = VersionSlots(FakeEngine(), threading.RLock(), slots=2)
    with pytest.raises(EngineError, match="distinct"):
        with slots.serve([state("s1", 1), state("s1", 1)], ROLES):
            pass
    with pytest.raises(EngineError, match="1..2"):
        with slots.serve([state(f"s{i}", i) for i in range(3)], ROLES):
            pass
    small = VersionSlots(FakeEngine(max_agents=1), threading.RLock(), slots=1)
    with pytest.raises(EngineError, match="at most 1"):
        with small.serve([state("s1", 1)], ROLES):
            pass
    assert small.held() == [None]                                   # a failed load holds nothing
