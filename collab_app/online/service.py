"""`collab trainer`: the background trainer service.

A separate process that polls the store and runs one MAGRPO step (`MAGRPOTrainer.update`) on the
ready groups of a task whenever `min_groups` (K) of them are waiting, or as soon as the oldest
ready one has waited `max_wait_s` (T). One step: status "training" (the store's app_state,
STATUS_KEY); `trainer.update(groups)` writes each changed agent's next adapter version to a temp
dir and renames it into place; `store.record_train_step(...)` records the versions' rows, the
used groups as trained and the too-late ones as expired in one transaction, only while this
service holds the store's trainer lease (`TrainerLease`); status "idle". The serving process
picks the new rows up (online/hotswap.py).

Also here: one MAGRPOTrainer per task team, built when that task first has ready groups;
faults of a step make that task back off and its groups suspects, retried in halves until an
untrainable one is set aside (SUSPECTS_KEY); late groups train under the clipped importance
ratio, only those past `max_staleness` are dropped; crash safety (`reconcile`, `check_lineage`:
kill -9 at any point never applies a batch twice nor names two adapters with one version); a
stop (SIGTERM) abandons a step at its next pause point (TrainerHooks.stop_requested); status and
pause in the store's app_state (`read_status`, `set_paused`) with a heartbeat every
`heartbeat_s`; optional self-play (`--self-play`); data parallel under torchrun
(trainer/distributed.py: rank 0 is this service, the other ranks follow its commands);
heterogeneous teams (`--agent-models`). Online multi-turn is refused (`num_turns > 1`).

Each rule and its reason: docs/ARCHITECTURE.md "The trainer service in detail".
"""
from __future__ import annotations

import contextlib

import dataclasses
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal

from collab_app import paths
from collab_app.cpu.lending import YIELD_SHARE
from collab_app.online.returns import ReturnRule
from tasks import team_of
from trainer.config import StepConfig

log = logging.getLogger(__name__)

STATUS_KEY = "trainer_status"
"""app_state key: {"state": starting|waiting|idle|loading|training|self-play|paused|error|stopped, "step", "task", "groups",
"message", "pid", "heartbeat" (unix time), "since", "last_step": {...}}."""
PAUSE_KEY = "trainer_control"
"""app_state key: {"paused": bool, "by": str, "at": unix time}, written by the UI (handlers.py
set_training_paused) or `set_paused`; the service checks it before every step."""
SUSPECTS_KEY = "trainer_suspects"
"""app_state key: {"groups": {group id: {"fails", "alone", "pending", "task", "error"}}}: groups whose
step raised, retried in halves until they train (cleared) or one fails alone and is set aside. Module doc: "Groups that cannot train"."""
STORAGE_ERRNOS = (5, 27, 28, 30, 122)   # EIO, EFBIG, ENOSPC, EROFS, EDQUOT
STORAGE_MESSAGES = ("no space left on device", "disk quota exceeded", "file too large", "read-only file system",
                    "pytorchstreamwriter failed writing file", "database or disk is full")
"""`storage_fault`: how a full, read-only or failing disk shows in an error that is not an OSError
(safetensors' SafetensorError, torch.save's RuntimeError, SQLite's OperationalError)."""
SET_ASIDE_SHOWN = 20
"""the status row's "set_aside" list keeps the newest this many {group, task, error, at}."""
PUBLIC_RATER_SHARE = 0.25
"""max_rater_share and max_network_share that `collab serve` gives its trainer child when the app is public."""


@dataclass
class ServiceConfig(StepConfig):
    """StepConfig (the trainer's hyperparameters; not `collab train`'s schedule, time budget and
    dynamic sampling, which have nothing to apply to online) plus the service's own knobs."""

    db: str = ""
    """store URL (empty = $COLLAB_DB, else sqlite:///$COLLAB_HOME/collab.db)."""
    min_groups: int = 4
    """K: run a step as soon as this many groups of one task are ready."""
    max_wait_s: float = 120.0
    """T: also run a step on fewer than K ready groups once the oldest has waited this long (0 = only K)."""
    max_groups_per_step: int = 32
    """most groups in one step (the oldest first)."""
    max_step_s: float = 120.0
    """also at most as many groups as fit in this many seconds at the task's last step's seconds per group, at least K (a backlog makes more steps, not longer ones: served versions stay fresh under load; 0 = off)."""
    poll_s: float = 2.0
    """seconds between store polls when there is nothing to do."""
    retry_s: float = 10.0
    """a task whose step failed (its trainer could not be built, a save or the store failed) waits this long, doubling per failure up to 5 minutes; other tasks go on."""
    heartbeat_s: float = 5.0
    """refresh the status row this often, also during a step (a stale heartbeat = a dead service)."""
    return_mode: Literal["human_first", "auto", "human", "weighted"] = "weighted"
    """how automatic rewards and human ratings become a return (collab_app/online/returns.py); weighted keeps the task's own checks in the return beside a rating."""
    human_weight: float = 0.5
    """weighted mode: w in w*human + (1-w)*auto (0.5: a rating and the task's checks count equally)."""
    human_timeout_s: float = 300.0
    """seconds to wait for ratings before falling back to the automatic reward / expiring a group."""
    self_play: bool = False
    """between human groups, sample --task's train split with the service's own engine (auto rewards)."""
    self_play_prompts: int = 2
    """prompts per self-play round (each becomes one stored group of num_generations joint answers)."""
    max_steps: int = 0
    """stop after this many steps (0 = run until stopped); tests and one-off runs."""
    parent_pid: int = 0
    """pid of the process that started this one: stop once re-parented, i.e. it died (`collab serve` passes its own); 0 = off."""
    keep_versions: int = 0
    """keep all versions (0): store rows name every version and an admin may pin (roll back to) any of them."""
    core_lease: str = ""
    """lock file through which `collab serve`'s engine borrows this trainer's cores while it is not working (lending.CoreLease; '' = off; serve sets it)."""
    borrow_engine_cores: str = ""
    """with core_lease: the serving engine's cores (e.g. "0"), on which a step also works while no round is being generated (lending.CoreLease; '' = own cores only; serve sets it)."""
    yield_share: float = YIELD_SHARE
    """with core_lease: most share of a step's time it may pause while a person's round waits for its cores (0.5 = a step takes at most twice its working time; 0 = never pause)."""
    pause_credit: bool = True
    """with yield_share: pause only as long as this trainer was idle before (banked, at most lending.PAUSE_CREDIT_CAP_S): free at a person's pace, none while ratings pile up (--no-pause-credit: yield_share alone)."""
    max_rater_share: float = 1.0
    """most of a step's K groups one rater may decide: max(1, floor(share*K)), the rest wait (1 = off, for one person's local app; `collab serve` passes 0.25 when public)."""
    max_network_share: float = 1.0
    """most of a step's K groups the raters of one client network may decide together: max(1, floor(share*K)) (1 = off; `collab serve` passes 0.25 when public)."""
    max_anonymous_share: float = 1.0
    """most of a step's K groups raters who did not sign in may decide, all of them together (1 = off; `collab serve` passes 0.25 where Hugging Face sign-in is available)."""

    def __post_init__(self):
        super().__post_init__()
        if self.min_groups < 1 or self.max_groups_per_step < self.min_groups:
            raise ValueError(f"need 1 <= min_groups <= max_groups_per_step, got {self.min_groups}, "
                             f"{self.max_groups_per_step}")
        if self.max_step_s < 0:
            raise ValueError(f"max_step_s must be >= 0 (0 = steps bounded by max_groups_per_step only), got {self.max_step_s}")
        if self.max_wait_s < 0 or self.poll_s <= 0 or self.heartbeat_s <= 0 or not 0 < self.retry_s <= 300:
            raise ValueError("max_wait_s must be >= 0, poll_s and heartbeat_s > 0, retry_s in (0, 300]")
        if not 0.0 <= self.yield_share < 1.0:
            raise ValueError(f"yield_share must be in [0, 1) (0 = a step never pauses for a round; 1 would let "
                             f"rounds stop training), got {self.yield_share}")
        if self.borrow_engine_cores:
            if not self.core_lease:
                raise ValueError("borrow_engine_cores needs core_lease (the lock files through which the engine "
                                 "announces its rounds); `collab serve` sets both")
            if not all(c.strip().isdigit() for c in self.borrow_engine_cores.split(",")):
                raise ValueError(f"borrow_engine_cores must list core numbers like '0' or '0,1', got "
                                 f"{self.borrow_engine_cores!r}")
        for name in ("max_rater_share", "max_network_share", "max_anonymous_share"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1] (1 = no cap), got {getattr(self, name)}")
        if self.self_play_prompts < 1 or self.max_steps < 0:
            raise ValueError("self_play_prompts must be >= 1 and max_steps >= 0")
        if self.num_turns > 1:
            raise ValueError(f"num_turns={self.num_turns}: the online trainer trains one turn per group (the store "
                             f"keeps no parent link between turns, so gamma-returns cannot be formed online). "
                             f"Use --num-turns 1 here, and `collab train --num-turns {self.num_turns}` for "
                             f"multi-turn training offline.")
        self.rule()   # validates the return settings

    def rule(self) -> ReturnRule:
        return ReturnRule(self.return_mode, self.human_weight, self.human_timeout_s)


def rater_cap(k: int, share: float) -> int:
    """Most groups of one rater in a step of `k` groups: max(1, floor(share * k)); k when share >= 1.
    floor, not ceil: ceil(0.25 * 5) = 2 would let one rater decide 40% of a 5-group step."""
    if share >= 1.0:
        return k
    return max(1, math.floor(share * k + 1e-9))


def share_keys(rater: str | None, network: str | None, signed_in: bool) -> list[tuple[str, ...]]:
    """What a group counts against in a step: its rater, the rater's client network (when known)
    and, for a rater who did not sign in, the one anonymous share. A group no rating decides
    (rater None: automatic returns) counts against nothing. The one rule of the shares: both the
    store's scan (`scan_shares`) and a step (`take_capped`) count by it."""
    if rater is None:
        return []
    return [("rater", rater), *([("net", network)] if network is not None else []),
            *([] if signed_in else [("anon",)])]


def _count_in(per: dict, caps: dict, keys: list[tuple[str, ...]]) -> bool:
    """Count a group with these share keys in `per` ({key: groups so far}), unless one of its
    shares is full (`caps`: kind -> most groups, None = off): then count nothing, return False."""
    keys = [key for key in keys if caps.get(key[0]) is not None]
    if any(per.get(key, 0) >= caps[key[0]] for key in keys):
        return False
    for key in keys:
        per[key] = per.get(key, 0) + 1
    return True


def scan_shares(per_rater: int | None = None, per_network: int | None = None, per_anonymous: int | None = None,
                held: list | None = None) -> Callable[..., bool]:
    """The store scan's `admit` (Store.ready_groups) for the shares of a step: admit at most this
    many groups of one (task, rater), of one (task, network), and of anonymous raters together per
    task (None = no cap), in scan order, so one backlog cannot fill the read and hide other
    raters' groups; the ones refused are appended to `held` as (group id, rater) when given."""
    caps = {"rater": per_rater, "net": per_network, "anon": per_anonymous}
    per: dict[tuple, int] = {}

    def admit(*, group_id: int, task: str, rater: str | None, network: str | None, signed_in: bool) -> bool:
        keys = [(key[0], task, *key[1:]) for key in share_keys(rater, network, signed_in)]
        if _count_in(per, caps, keys):
            return True
        if held is not None:
            held.append((group_id, rater))
        return False

    return admit


def _share_keys(g) -> list[tuple[str, ...]]:
    """`share_keys` of a ready group (or anything with `rater`, `network`, `signed_in`)."""
    return share_keys(getattr(g, "rater", None), getattr(g, "network", None), getattr(g, "signed_in", False))


def take_capped(groups: list, share: float, max_k: int, network_share: float = 1.0,
                anonymous_share: float = 1.0) -> tuple[list, list]:
    """The groups of one step under the shares, and those held back by them. `groups` (oldest
    first, each with a `rater` (None = no rating decides its returns), the rater's `network` and
    whether it `signed_in`) are taken oldest first, skipping a group once its rater has
    `rater_cap(K, share)` groups in the step, OR its network has `rater_cap(K, network_share)`,
    OR (not signed in) the anonymous raters together have `rater_cap(K, anonymous_share)`, for the
    largest K <= max_k that can be filled that way. Held: the groups left out because one of
    their shares was full (they stay ready and come first in a later step, oldest first); groups
    without a rater are never held. Every share >= 1: the oldest max_k, nothing held."""
    shares = {"rater": share, "net": network_share, "anon": anonymous_share}
    if all(v >= 1.0 for v in shares.values()) or not groups:
        return list(groups[:max_k]), []
    for k in range(min(len(groups), max_k), 0, -1):
        caps = {kind: rater_cap(k, v) for kind, v in shares.items()}
        taken, per = [], {}
        for g in groups:
            if len(taken) == k:
                break
            if _count_in(per, caps, _share_keys(g)):
                taken.append(g)
        if len(taken) == k:
            full = {key for key, n in per.items() if n >= caps[key[0]]}
            ids = {id(g) for g in taken}
            return taken, [g for g in groups if id(g) not in ids and any(key in full for key in _share_keys(g))]
    return [], []   # not reached: k = 1 always fills


def storage_fault(error: BaseException) -> bool:
    """Whether `error` (or one it was raised from) says the disk refused a write: full, over quota,
    read-only, an I/O error. Such a failure says nothing about the groups of the step, so they
    are not made suspects (`TrainerService._step_failed`): they train again together, in one
    step, once the disk takes writes (retried in halves, a lost step of 8 took 2 steps, and
    the backlog the fault left behind one more)."""
    import re

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
            return True
        text = str(error).lower()
        if any(m in text for m in STORAGE_MESSAGES) or re.search(
                r"os error (%s)\b|code: (%s),"
                % ("|".join(map(str, STORAGE_ERRNOS)), "|".join(map(str, STORAGE_ERRNOS))), text):
            return True
        error = error.__cause__ or error.__context__
    return False


def _dist():
    """trainer.distributed (data parallel under torchrun), imported on first use: it imports torch,
    which the UI's status reads and `collab trainer --help` do not need."""
    from trainer import distributed

    return distributed


# ----------------------------------------------------------------------------- status / pause

def read_status(store) -> dict:
    """The service's last status, plus "alive": False when its heartbeat is older than 3 beats."""
    st = dict(store.get_state(STATUS_KEY) or {"state": "not started"})
    beat = st.get("heartbeat")
    st["alive"] = bool(beat) and st.get("state") != "stopped" and \
        time.time() - float(beat) < 3 * float(st.get("heartbeat_s", 5.0)) + 5
    return st


def set_paused(store, paused: bool, by: str = "admin") -> None:
    """Ask the service to pause (it finishes a running step first) or resume."""
    store.set_state(PAUSE_KEY, {"paused": bool(paused), "by": by, "at": time.time()})


def is_paused(store) -> bool:
    return bool((store.get_state(PAUSE_KEY) or {}).get("paused"))


class _Status:
    """The status dict and a thread that rewrites it every heartbeat_s (also mid-step)."""

    def __init__(self, store, every_s: float):
        self.store, self.every_s = store, every_s
        self.on_beat: Callable[[], None] | None = None   # also called every beat (the trainer lease)
        self.value: dict = {"state": "starting", "pid": os.getpid(), "heartbeat_s": every_s}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="collab-trainer-heartbeat", daemon=True)

    def set(self, state: str, **fields) -> None:
        with self._lock:
            if state != self.value.get("state"):
                self.value["since"] = time.time()
            self.value.update(state=state, **fields)
            self._write()

    def _write(self) -> None:
        self.value["heartbeat"] = time.time()
        try:
            self.store.set_state(STATUS_KEY, self.value)
        except Exception:  # noqa: BLE001 - a status write must never stop training
            log.exception("could not write the trainer status")

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._lock:
                self._write()
            if self.on_beat is not None:
                try:
                    self.on_beat()
                except Exception:  # noqa: BLE001 - e.g. the store is locked: the next beat tries again
                    log.exception("could not renew the trainer lease")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


# ----------------------------------------------------------------------------- the service

def reconcile(store, adapters_dir: str) -> list[tuple[str, int]]:
    """Record every complete adapter version on disk that has no store row yet: a fresh team's
    version 0, which building its trainer writes (logged as news), or a crash (or a store error)
    between a step's rename and its record. A version whose collab.json names the step's groups
    (`group_ids`, written by MAGRPOTrainer.update before the save) is recorded with that step, in
    one transaction (`Store.record_train_step`), so its groups are marked trained and never
    trained twice. Returns the (agent, version) pairs recorded."""
    from trainer import adapters

    done = []
    if not os.path.isdir(adapters_dir):
        return done
    steps: dict[tuple, tuple[dict, list]] = {}   # (group ids, stale ids) -> (its metrics, its versions)
    for agent in sorted(os.listdir(adapters_dir)):
        if agent.startswith(".") or not os.path.isdir(os.path.join(adapters_dir, agent)):
            continue
        known = {a.version for a in store.adapter_versions(agent)}
        for version, path in adapters.list_versions(adapters_dir, agent):
            if version in known:
                continue
            meta = adapters.read_meta(path)
            m = meta.get("metrics") or {}
            row = dict(agent=agent, version=version, path=path, base_model=meta.get("base_model"),
                       metrics={"reconciled": True, "task_step": meta.get("step"), "saved_at": meta.get("created_at")})
            if m.get("group_ids"):
                steps.setdefault((tuple(m["group_ids"]), tuple(m.get("stale_group_ids") or ())), (m, []))[1].append(row)
            else:
                store.record_adapter_version(step=None, **row)
            done.append((agent, version))
    for (used, stale), (saved, rows) in steps.items():
        last = store.train_steps(last=1)
        step = (last[-1]["step"] if last else 0) + 1
        metrics = {**saved, "reconciled": True, "step": step}
        metrics.pop("group_ids", None), metrics.pop("stale_group_ids", None), metrics.pop("refused_groups", None)
        store.record_train_step(step, metrics, list(used), stale_group_ids=list(stale), versions=rows,
                                stale_reason="waited too long for the trainer (recorded after a restart)")
        log.warning("recorded step %d from adapter versions that were saved but not recorded (a crash or a store "
                    "error between them): %s, groups %s now trained", step,
                    [(r["agent"], r["version"]) for r in rows], list(used))
    first, later = [d for d in done if d[1] == 0], [d for d in done if d[1] != 0]
    if first:
        log.info("recorded a fresh team's first adapter versions: %s", first)
    if later and not steps:
        log.warning("recorded adapter versions found on disk without a store row: %s", later)
    return done


def check_lineage(store, adapters_dir: str, agents) -> dict[str, int]:
    """Make the adapters folder and the store's version rows one lineage before a trainer starts.
    Where the store names versions of an agent that the folder does not have (a Space restarted
    without persistent storage on a PostgreSQL store, a restored or wiped folder), or the folder's
    version with the store's newest number holds other weights than the row recorded, the
    agent's floor is set past the store's newest (trainer/adapters.py): the trainer then saves what
    it resumes from as a new number, so no number ever names two different adapters and samples
    of the lost versions count as off-policy. Returns {agent: floor} for the agents it moved on."""
    from trainer import adapters

    moved = {}
    for agent in agents:
        rows = store.adapter_versions(agent)
        if not rows:
            continue
        newest = rows[-1]
        on_disk = adapters.latest_version(adapters_dir, agent)
        other = False
        if on_disk is not None and on_disk[0] == newest.version:
            saved_at = (newest.metrics or {}).get("saved_at")
            disk_at = adapters.read_meta(on_disk[1]).get("created_at")
            other = saved_at is not None and disk_at is not None and abs(float(saved_at) - float(disk_at)) > 1e-6
        if on_disk is None or on_disk[0] < newest.version or other:
            adapters.set_floor(adapters_dir, agent, newest.version + 1)
            moved[agent] = newest.version + 1
    if moved:
        log.warning("the store names adapter versions that %s does not hold (%s): the trainer continues from what the "
                    "folder has, numbered from %s (versions are never reused); the weights of the missing versions "
                    "are not recoverable from the store", adapters_dir,
                    ", ".join(f"{a} up to v{v - 1}" for a, v in moved.items()), moved)
    return moved


LEASE_KEY = "trainer_lease"
"""app_state key: {"owner": str, "beat": int, "pid": int, "host": str}: the one trainer service
that may publish to this store (`TrainerLease`)."""


class TrainerLease:
    """One trainer per store. The holder bumps "beat" every heartbeat; another service waits until
    the beat has not moved for `stale_s` seconds of its own clock (no comparison of two hosts'
    clocks), then takes it. Steps are recorded only while held (`Store.record_train_step(lease=)`
    checks it in the same transaction), so a trainer that hung, or a killed app's orphaned child
    that finishes its step, cannot publish beside the one that holds it."""

    def __init__(self, store, stale_s: float):
        import socket
        import uuid

        self.store, self.stale_s = store, stale_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._seen: tuple | None = None   # (owner, beat) last seen held by another, and since when (monotonic)
        self._seen_at = 0.0

    @property
    def key(self) -> tuple[str, str]:
        return LEASE_KEY, self.owner

    def try_take(self) -> str | None:
        """Take the lease if it is free, ours, or stale. Returns None when held now, else its holder."""
        import socket

        now = time.monotonic()
        holder: list = [None]

        def change(v):
            if v and v.get("owner") not in (None, self.owner) and not self._dead_here(v):
                seen = (v.get("owner"), v.get("beat"))
                if seen != self._seen:
                    self._seen, self._seen_at = seen, now
                if now - self._seen_at < self.stale_s:
                    holder[0] = v.get("owner")
                    return None
                log.warning("taking the trainer lease from %s: no heartbeat for %.0f s", v.get("owner"), now - self._seen_at)
            return {"owner": self.owner, "beat": int((v or {}).get("beat") or 0) + 1, "pid": os.getpid(),
                    "host": socket.gethostname()}

        self.store.swap_state(LEASE_KEY, change)
        return holder[0]

    @staticmethod
    def _dead_here(v: dict) -> bool:
        """The holder ran on this host and its process is gone (or it was this very process, an
        earlier service object): no need to wait for its heartbeat to go stale."""
        import socket

        if v.get("host") != socket.gethostname() or not isinstance(v.get("pid"), int):
            return False
        if v["pid"] == os.getpid():
            return True
        try:
            os.kill(v["pid"], 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    def beat(self) -> bool:
        """Renew while held; False when another took it."""
        held = [False]

        def change(v):
            if not v or v.get("owner") != self.owner:
                return None
            held[0] = True
            return {**v, "beat": int(v.get("beat") or 0) + 1}

        self.store.swap_state(LEASE_KEY, change)
        return held[0]

    def release(self) -> None:
        self.store.swap_state(LEASE_KEY, lambda v: {**v, "owner": None} if v and v.get("owner") == self.owner else None)


def resolve_agent_models(agent_models) -> tuple[str, ...]:
    """cfg.agent_models with each model as a local folder (ensure_model), in the same form:
    positional ("" stays "": --model) or ROLE=MODEL."""
    from collab_app.engines.model import ensure_model

    out = []
    for m in agent_models:
        role, sep, model = m.partition("=") if "=" in m else ("", "", m)
        out.append(f"{role}{sep}{ensure_model(model)}" if model else "")
    return tuple(out)


def to_trainer_group(g):
    """A store ReadyGroup as the trainer's Group (returns = the rule's returns; its id and the
    versions it arrived at ride along: update() reports ids back, and lateness counts the versions
    written since, from the store's rows, not two processes' clocks)."""
    from trainer.magrpo import Group

    return Group(task=g.task, example_id=g.example_id, turn=g.turn, prompts=list(g.prompts),
                 samples=g.samples, joint=[tuple(j) for j in g.joint], returns=list(g.returns),
                 rewards=list(g.returns), levels=[dict(lv) for lv in g.levels],
                 created_at=g.created_at.timestamp(), id=g.group_id, arrived_versions=g.arrived_versions)


class TrainerService:
    def __init__(self, cfg: ServiceConfig, store=None, tasks: dict | None = None):
        """`store`: an open Store (default: Store(cfg.db)); `tasks`: task objects by name to use
        instead of `tasks.load_task(name)` (e.g. a person's own task, or a test's)."""
        from collab_app.engines.model import ensure_model
        from collab_app.online.store import Store

        self.cfg = dataclasses.replace(cfg, model=ensure_model(cfg.model or None),
                                       adapters_dir=cfg.adapters_dir or paths.adapters_dir(),
                                       agent_models=resolve_agent_models(cfg.agent_models))
        # data parallel: only rank 0 talks to the store; the other ranks follow its commands (run)
        self.store = store if store is not None else Store(cfg.db or None) if _dist().is_main() else None
        self.rule = cfg.rule()
        self.tasks = dict(tasks or {})
        self.trainers: dict = {}          # task name -> MAGRPOTrainer
        self.status = _Status(self.store, cfg.heartbeat_s)
        self.stop_event = threading.Event()
        self.steps_done = 0
        self._backoff = 0.0
        self._sampler = None              # self-play engine, built on first use
        self._self_play_round = 0
        self._in_step = False             # data parallel: inside a step the ranks' collectives are running
        self._suspects: dict[int, dict] = {}   # group id -> {"fails", "alone", "pending", "error"} (SUSPECTS_KEY)
        self._last_ok: dict[str, bool] = {}    # task -> whether its last step went through
        self._s_per_group: dict[str, float] = {}   # task -> seconds per group of its last step (max_step_s)
        self._retry_at: dict[str, tuple[float, float]] = {}   # task -> (monotonic time it may step again, back-off s)
        self.lease = TrainerLease(self.store, stale_s=3 * cfg.heartbeat_s + 10) if self.store is not None else None
        self.lease_lost = False
        self._lease_held = False
        self.held: list[tuple[int, str]] = []   # (group id, rater) the rater cap kept out at the last `due`
        self._held_shown: dict | None = None     # last RATER_CAP_KEY value written
        if self.store is not None:
            saved = (self.store.get_state(SUSPECTS_KEY) or {}).get("groups", {})
            self._suspects = {int(g): (v if isinstance(v, dict) else {"fails": int(v)}) for g, v in saved.items()}

    # -- pieces ------------------------------------------------------------------------------
    def next_step(self) -> int:
        last = self.store.train_steps(last=1)
        return (last[-1]["step"] if last else 0) + 1

    def trainer_for(self, task_name: str):
        if task_name not in self.trainers:
            from trainer.magrpo import MAGRPOTrainer

            if _dist().is_main():
                self._command("load", task_name)   # the followers build theirs too (the constructor syncs them)

            task = self.tasks.get(task_name)
            if task is None:
                from tasks import load_task

                task = load_task(task_name)
            models = self.cfg.agent_models   # ROLE=MODEL entries: every team; a positional list: --task's team
            if models and "=" not in models[0] and team_of(task_name) != team_of(self.cfg.task):
                models = ()
            cfg = dataclasses.replace(self.cfg, task=task_name, num_agents=task.num_agents, agent_models=models)
            if _dist().is_main():   # the folder and the store's rows one lineage (versions never reused)
                check_lineage(self.store, self.cfg.adapters_dir, task.roles)
            self.trainers[task_name] = MAGRPOTrainer(cfg, task, self.cfg.adapters_dir)
            lease = self._core_lease()
            if lease is not None:   # a person's round waiting on these cores may get them mid-step
                self.trainers[task_name].hooks.pause = lease.pause
                self.trainers[task_name].hooks.pieces_done = lease.narrow   # the engine's cores back before saving
            if _dist().world_size() == 1:   # a stop abandons the step at its next pause point (run);
                # data parallel: every rank is inside the step's collectives, so it ends the step first
                self.trainers[task_name].hooks.stop_requested = self.stop_event.is_set
            if _dist().is_main():
                reconcile(self.store, self.cfg.adapters_dir)   # version 0 of a fresh team gets its rows
        return self.trainers[task_name]

    def private_tasks_held(self) -> tuple[str, ...]:
        """Tasks whose groups must not train the shared team now: a person's own coding problems
        (returns.PRIVATE_TASKS), unless an admin allowed it in the app (returns.CUSTOM_TRAINING_KEY).
        Their groups wait in the store, ratings and all, until allowed (or expire unused)."""
        from collab_app.online.returns import CUSTOM_TRAINING_KEY, PRIVATE_TASKS, may_train_shared

        allowed = self.store.get_state(CUSTOM_TRAINING_KEY)
        return tuple(t for t in PRIVATE_TASKS if not may_train_shared(t, allowed))

    def due(self, ready) -> tuple[str, list] | None:
        """(task, groups) of the first task that has K ready groups or waited T, else None. Tasks
        whose last step failed wait out their back-off (`_retry_at`), so one broken task cannot
        starve the others. A task with suspects (groups of a step that raised) steps on half of
        its least-tried suspects (`suspects_next`); once every suspect has failed alone, on the
        other ready groups (the control: do other groups train while the suspects fail?), else on
        its suspects again (module doc, "Groups that cannot train").

        Shares (`max_rater_share`, `max_network_share`, `max_anonymous_share` < 1): a step's groups
        are `take_capped`: at most max(1, floor(share * size)) of them decided by one rater, by one
        client network, and by anonymous raters together; the rest wait (ready, oldest first;
        `self.held` lists them as (group id, rater), for every task). K and
        T count the capped step: a rater alone (no other rater's and no automatic-return groups
        ready) trains one group per step, once it waited T (max_wait_s = 0: waits for others)."""
        by_task: dict[str, list] = {}
        for g in ready:
            by_task.setdefault(team_of(g.task), []).append(g)   # a person's own problem: the coding team
        now, clock = time.time(), time.monotonic()
        picked, self.held = None, []
        for task, groups in by_task.items():
            if self._retry_at.get(task, (0.0, 0.0))[0] > clock:
                continue
            suspects = [g for g in groups if g.group_id in self._suspects]
            others = [g for g in groups if g.group_id not in self._suspects]
            if suspects:
                untried = [g for g in suspects if not self._suspects[g.group_id].get("pending")]
                if untried:
                    picked = picked or (task, self.suspects_next(task, untried))
                    continue
                if not others:
                    picked = picked or (task, suspects[:1])
                    continue
                groups = others   # the control step: any size, now
            step, held = take_capped(groups, self.cfg.max_rater_share, self.step_size(task),
                                     self.cfg.max_network_share, self.cfg.max_anonymous_share)
            self.held += [(g.group_id, g.rater) for g in held]
            waited = now - min(g.created_at.timestamp() for g in step)
            if suspects or len(step) >= self.cfg.min_groups or (self.cfg.max_wait_s and waited >= self.cfg.max_wait_s):
                picked = picked or (task, step)
        return picked

    def step_size(self, task: str) -> int:
        """Most groups the task's next step takes: max_groups_per_step, and at most what fits in
        max_step_s at its last step's seconds per group, never under K. Why: a step took every
        ready group, so a backlog made steps longer and the served versions staler (on a 2-core
        AVX2 box under attack, a step of 16 groups took 410 s)."""
        per = self._s_per_group.get(task)
        if not self.cfg.max_step_s or not per:
            return self.cfg.max_groups_per_step
        fit = int(self.cfg.max_step_s // per)
        return max(self.cfg.min_groups, min(self.cfg.max_groups_per_step, fit))

    def suspects_next(self, task: str, untried: list) -> list:
        """The suspects' next step, among those that failed least often (oldest first, within
        max_groups_per_step): all of them when the task's last step trained, else the older half
        (rounded up). A fault of the machine that has passed clears a lost step in two steps (one
        at a time, a 16-group step lost to a full disk took 16 steps to train again); a group that
        breaks every step it is in is narrowed down by halves until it fails alone, which the
        set-aside rule needs."""
        fails = {g.group_id: self._suspects[g.group_id].get("fails", 0) for g in untried}
        level = sorted((g for g in untried if fails[g.group_id] == min(fails.values())), key=lambda g: g.group_id)
        n = len(level) if self._last_ok.get(task) else max(1, math.ceil(len(level) / 2))
        return level[:min(self.cfg.max_groups_per_step, n)]

    def train_step(self, task_name: str, ready) -> dict:
        """Steps 1-5 of the module docstring on one task's ready groups. Returns the metrics."""
        from trainer import adapters

        from collab_app.online.store import LeaseLost

        if not self._hold_lease():
            raise LeaseLost("another trainer service holds this store's lease: no step here")
        step = self.next_step()
        ids = [g.group_id for g in ready]
        try:
            if task_name not in self.trainers:
                self.status.set("loading", step=step, task=task_name, message=f"loading the {task_name} trainer")
                self.trainer_for(task_name)
                if self.next_step() != step:
                    return {}   # building it recorded a step left on disk (reconcile): read the ready groups again
            trainer = self.trainer_for(task_name)
            self.status.set("training", step=step, task=task_name, groups=len(ids),
                            message=f"MAGRPO step {step} on {len(ids)} {task_name} groups")
            before = dict(trainer.versions)
            t0 = time.time()
            groups = [to_trainer_group(g) for g in ready]
            self._command("train", task_name, groups)   # data parallel: the followers join this update
            lease = self._core_lease()
            wide0 = lease.wide_s if lease is not None else 0.0
            credit0 = lease.credit_s if lease is not None else 0.0   # the pause credit this step starts with
            metrics = trainer.update(groups)
            if lease is not None:   # seconds of the step also on the engine's cores (borrow_engine_cores);
                # update's pieces_done gave them back before its saves, a raising one the unit's end
                metrics["time/wide_s"] = lease.wide_s - wide0
                metrics["time/pause_credit_s"] = credit0   # 0 with groups piling up: it did not pause for rounds
            used, stale = metrics.pop("group_ids"), metrics.pop("stale_group_ids")
            refused = {int(g): str(r) for g, r in (metrics.pop("refused_groups", None) or {}).items()}
            metrics.update(task=task_name, task_step=metrics.get("step"), step=step,
                           oldest_group_age_s=t0 - min(g.created_at.timestamp() for g in ready))
            versions = [dict(agent=a, version=trainer.versions[a], path=trainer.adapter_path(a),
                             base_model=trainer.base_of[a],
                             metrics={**metrics, "saved_at": adapters.read_meta(trainer.adapter_path(a)).get("created_at")})
                        for a in trainer.agents if trainer.versions[a] != before[a]]
            # the versions' rows, the step and its groups in one transaction (renamed into place already)
            rerated = self.store.record_train_step(
                step, metrics, used, stale_group_ids=stale, ratings_seen={g.group_id: g.ratings_seen for g in ready},
                versions=versions, lease=None if self.lease is None else self.lease.key,
                stale_reason=f"waited while an agent wrote more than {self.cfg.max_staleness} versions (max_staleness)")
            if refused:
                for gid, reason in refused.items():
                    self.store.set_aside([gid], reason)
                log.warning("step %d: %d groups were sampled with settings the trainer cannot reproduce; set aside: %s",
                            step, len(refused), refused)
        except Exception as e:
            self._step_failed(task_name, ids, e)
            if _dist().world_size() == 1:   # torchrun: fatal instead (run), on every rank
                self.trainers.pop(task_name, None)   # half-stepped, or stepped without rows: rebuild from disk
            raise
        self._step_went_through(task_name, ids)
        if ids:
            self._s_per_group[task_name] = (time.time() - t0) / len(ids)
        if rerated:
            log.info("step %d: %d groups were rated while it ran; they stay ready for the next step: %s",
                     step, len(rerated), rerated)
        if stale:
            log.warning("step %d: %d groups waited too long (> %d versions) and were retired: %s",
                        step, len(stale), self.cfg.max_staleness, stale)
        self.steps_done += 1
        # An agent whose every advantage was 0 (all returns of every group equal) is not updated and
        # gets no new version: say so, or a run of such steps looks like training that goes nowhere.
        flat = [a for a in trainer.agents if ids and metrics.get(f"{a}/trained_samples") == 0]
        log.info("step %d (%s): %d groups, return %.3f, versions %s, %.1fs%s", step, task_name, len(ids),
                 metrics.get("return_mean", float("nan")), trainer.versions, time.time() - t0,
                 f"; no learning signal for {', '.join(flat)} (advantages all 0: each group's returns were equal): no new version"
                 if flat else "")
        self.status.set("idle", step=step, message=f"step {step} done",
                        last_step={"step": step, "task": task_name, "groups": len(ids),
                                   "versions": dict(trainer.versions), "at": time.time(),
                                   "return_mean": metrics.get("return_mean")})
        return metrics

    def _step_went_through(self, task_name: str, ids: list[int]) -> None:
        """A step of `task_name` trained: its groups are cleared of suspicion, and a suspect that
        failed alone right after a step that went through is set aside now: groups trained before
        and after it while it failed, so the fault is the group's, not the machine's."""
        self._retry_at.pop(task_name, None)
        self._last_ok[task_name] = True
        if not self._suspects:
            return
        suspects = {g: v for g, v in self._suspects.items() if g not in ids}
        culprits = {g: v for g, v in suspects.items() if v.get("pending") and v.get("task", task_name) == task_name}
        for gid, v in culprits.items():
            reason = (f"its step raised alone right after a step that trained, and the next step trained again: "
                      f"{v.get('error', '')}")[:1000]
            try:
                self.store.set_aside([gid], reason)
            except Exception:  # noqa: BLE001 - stays a suspect, decided again at the next step
                log.exception("could not set group #%d aside", gid)
                continue
            del suspects[gid]
            log.error("group #%d (%s) set aside (status 'untrainable'; an admin can put it back): %s",
                      gid, task_name, reason)
            shown = list(self.status.value.get("set_aside") or [])
            shown.append({"group": gid, "task": task_name, "error": v.get("error", ""), "at": time.time()})
            self.status.value["set_aside"] = shown[-SET_ASIDE_SHOWN:]
        if suspects != self._suspects:
            self._save_suspects(suspects)

    def _step_failed(self, task_name: str, ids: list[int], error: Exception) -> None:
        """A step of `task_name` on `ids` raised (building its trainer, the update, its saves or
        the store's record). The task waits out a back-off (doubling to 5 minutes; other tasks go
        on); the groups become suspects, unless the disk refused a write (`storage_fault`). A
        suspect that failed alone right after a step that went
        through is marked pending; `_step_went_through` sets it aside if the next step trains too.
        Never raises itself: the step's own error is the one to report."""
        from collab_app.online.store import LeaseLost
        from trainer.magrpo import StepStopped

        if isinstance(error, (StepStopped, LeaseLost)) or self.store is None:
            return
        backoff = min(max(2 * self._retry_at.get(task_name, (0.0, 0.0))[1], self.cfg.retry_s), 300.0)
        self._retry_at[task_name] = (time.monotonic() + backoff, backoff)
        was_ok, self._last_ok[task_name] = self._last_ok.get(task_name, False), False
        message = f"{type(error).__name__}: {error}"[:500]
        storage = storage_fault(error)
        log.error("step on %d %s groups failed (%s); the task waits %.0f s, other tasks go on; its groups stay "
                  "ready and %s", len(ids), task_name, message, backoff,
                  "train together once the disk takes writes again (the disk's fault, not theirs)" if storage
                  else "are retried in halves")
        try:
            suspects = {g: dict(v) for g, v in self._suspects.items()}
            for v in suspects.values():   # a failure breaks every sandwich but the group's own
                if v.get("task") == task_name and not (len(ids) == 1 and ids[0] in suspects):
                    v["pending"] = False
            for g in [] if storage else ids:   # a disk that refused a write suspects no group
                v = suspects.setdefault(g, {"fails": 0, "alone": 0, "task": task_name})
                v["fails"] = v.get("fails", 0) + 1
                v["error"] = message
                if len(ids) == 1:
                    v["alone"] = v.get("alone", 0) + 1
                    v["pending"] = was_ok or bool(v.get("pending"))   # still waiting for its control step
            self._save_suspects(suspects)
        except Exception:  # noqa: BLE001 - e.g. the store is down too; the groups stay as they were
            log.exception("could not record the groups of the failed step as suspects")

    def _publish_held(self, held: list[tuple[int, str]]) -> None:
        """RATER_CAP_KEY for `Store.stats()`: the share and the groups the cap keeps waiting now
        (written only when it changed, not every poll)."""
        from collab_app.online.store import RATER_CAP_KEY

        value = {"share": self.cfg.max_rater_share, "network_share": self.cfg.max_network_share,
                 "anonymous_share": self.cfg.max_anonymous_share, "held": len(held),
                 "raters": len({r for _, r in held})}
        if value != self._held_shown:
            if held:
                log.info("rater cap %.2f: %d ready groups of %d raters wait for other raters' groups",
                         value["share"], value["held"], value["raters"])
            self.store.set_state(RATER_CAP_KEY, {**value, "at": time.time()})
            self._held_shown = value

    def _save_suspects(self, suspects: dict[int, dict]) -> None:
        self._suspects = suspects
        self.store.set_state(SUSPECTS_KEY, {"groups": {str(g): v for g, v in suspects.items()}})

    def self_play_round(self) -> list[int]:
        """Sample `self_play_prompts` train prompts of cfg.task with the current adapters and store
        the groups with their automatic rewards. Returns the new group ids."""
        from collab_app.engines.sampler import EngineSampler
        from collab_app.engines.team import make_team_engine
        from tasks.base import Reward
        from trainer.magrpo import rollout
        from trainer.offline import prompts_of_step

        trainer = self.trainer_for(self.cfg.task)
        if self._sampler is None:
            self._sampler = EngineSampler(make_team_engine(self.cfg.engine, self.cfg.model, trainer.base_of))
            for agent in trainer.agents:
                self._sampler.engine.register_agent(agent)
        trainer.load_into(self._sampler)
        self.status.set("self-play", message=f"self-play round {self._self_play_round + 1} on {self.cfg.task}")
        examples = prompts_of_step(trainer.task.examples("train"), trainer.cfg, self._self_play_round)[:self.cfg.self_play_prompts]
        self._self_play_round += 1
        ids = []
        for g in rollout(self._sampler, trainer.task, examples, self.cfg):
            example = next(ex for ex in examples if str(ex["id"]) == g.example_id)
            rewards = [Reward(total=r, levels=lv, max_total=trainer.task.max_reward)
                       for r, lv in zip(g.rewards, g.levels)]
            gid, _ = self.store.add_group(task=self.cfg.task, example=example, prompts=g.prompts,
                                          samples=g.samples, joint=g.joint, auto_rewards=rewards,
                                          session_id="self-play", turn=g.turn)
            ids.append(gid)
        return ids

    # -- data parallel -----------------------------------------------------------------------
    def _command(self, *cmd) -> None:
        """Rank 0: tell the followers what to do next (nothing when the world size is 1). From a
        "load" or "train" until the step is recorded, an error is fatal (see run)."""
        if _dist().world_size() > 1:
            self._in_step = self._in_step or cmd[0] in ("load", "train")
            _dist().broadcast_object(cmd)

    def follow(self) -> int:
        """Ranks > 0: build trainers and join updates as rank 0 says, until it says "stop".
        Returns the steps joined."""
        while True:
            cmd, *args = _dist().broadcast_object(None)
            if cmd == "stop":
                return self.steps_done
            if cmd == "load":
                self.trainer_for(args[0])
            elif cmd == "train":
                self.trainer_for(args[0]).update(args[1])
                self.steps_done += 1
            # "idle": rank 0 is alive and polling; nothing to do

    # -- the loop ----------------------------------------------------------------------------
    def poll_once(self) -> str:
        """One look at the store; does at most one step or one self-play round. Returns what it did:
        "waiting" (another trainer holds the store's lease) | "paused" | "trained" | "self-play" | "idle"."""
        if not self._hold_lease():
            return "waiting"
        if is_paused(self.store):
            self.status.set("paused", message="paused by an admin; resume in the Training tab")
            return "paused"
        self.store.expire_groups(self.rule)
        scan_held: list = []
        scan = {name: None if share >= 1.0 else rater_cap(self.cfg.max_groups_per_step, share)
                for name, share in (("per_rater", self.cfg.max_rater_share),
                                    ("per_network", self.cfg.max_network_share),
                                    ("per_anonymous", self.cfg.max_anonymous_share))}
        due = self.due(self.store.ready_groups(self.rule, limit=4 * self.cfg.max_groups_per_step,
                                               exclude_tasks=self.private_tasks_held(),
                                               admit=scan_shares(**scan, held=scan_held)))
        self._publish_held(scan_held + self.held)
        if due:
            with self._cores():
                self.train_step(*due)
            return "trained"
        if self.cfg.self_play:
            with self._cores():
                self.self_play_round()
            self.status.set("idle", message="self-play round stored")
            return "self-play"
        if self.status.value.get("state") != "idle":
            self.status.set("idle", message="waiting for ready groups")
        return "idle"

    def _hold_lease(self) -> bool:
        """Hold the store's trainer lease (`TrainerLease`), taking it when free or stale; on taking
        it, clear what a predecessor left (half-written versions, versions without rows). False
        while another trainer holds it. Losing it once held raises LeaseLost: this trainer stops."""
        from collab_app.online.store import LeaseLost
        from trainer import adapters

        if self.lease is None:
            return True
        if self.lease_lost:
            raise LeaseLost(f"another trainer took the store's lease from this one ({self.lease.owner}): stopping")
        if self._lease_held:
            return True
        holder = self.lease.try_take()
        if holder is not None:
            self.status.set("waiting", message=f"another trainer service ({holder}) holds this store's lease; "
                                               f"taking over once its heartbeat stops for {self.lease.stale_s:.0f} s")
            return False
        self._lease_held = True
        self.status.on_beat = self._renew_lease
        os.makedirs(self.cfg.adapters_dir, exist_ok=True)
        for agent in os.listdir(self.cfg.adapters_dir):
            adapters.remove_partial(self.cfg.adapters_dir, agent)
        reconcile(self.store, self.cfg.adapters_dir)
        return True

    def _renew_lease(self) -> None:
        if self._lease_held and not self.lease.beat():
            log.error("another trainer service took this store's lease: this one stops after its current step "
                      "(which it cannot record)")
            self.lease_lost = True
            self.stop_event.set()

    def _cores(self):
        """Hold this process's cores for one unit of work: the serving engine, which borrows them
        in between (cfg.core_lease), gives them back within one decode step."""
        lease = self._core_lease()
        return contextlib.nullcontext() if lease is None else lease.held()

    def _core_lease(self):
        """The one CoreLease of cfg.core_lease (None = off): its `pause` needs the unit `held` opened."""
        if not self.cfg.core_lease:
            return None
        from collab_app.cpu.lending import CoreLease

        lease = getattr(self, "_lease", None)
        if lease is None or lease.path != self.cfg.core_lease:
            engine_cores = tuple(int(c) for c in self.cfg.borrow_engine_cores.split(",") if c.strip())
            lease = self._lease = CoreLease(self.cfg.core_lease, self.cfg.yield_share, engine_cores,
                                            self.cfg.pause_credit)
        return lease

    def run(self) -> int:
        """Poll until stopped (SIGTERM / SIGINT / stop_event) or max_steps. Returns steps done.
        Under torchrun, ranks > 0 follow rank 0 instead (`follow`)."""
        from collab_app.online.store import LeaseLost
        from trainer.magrpo import StepStopped

        if not _dist().is_main():
            return self.follow()
        if self.cfg.core_lease:   # a predecessor killed mid-step may have left its want file
            from collab_app.cpu.lending import CoreLease

            CoreLease(self.cfg.core_lease).clear_stale()
        self.status.start()
        self.status.set("idle", message="started")
        try:
            while not self.stop_event.is_set():
                if self.cfg.max_steps and self.steps_done >= self.cfg.max_steps:
                    break
                if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:   # re-parented: it died
                    log.warning("parent process %d is gone: stopping", self.cfg.parent_pid)
                    break
                try:
                    did = self.poll_once()
                    self._backoff = 0.0
                    self._in_step = False
                except StepStopped as e:   # stopped mid-step: nothing saved, its groups stay ready
                    log.info("%s; its groups stay ready for the next start", e)
                    break
                except LeaseLost as e:   # another trainer publishes to this store now
                    log.error("%s", e)
                    self.status.set("stopped", message=str(e))
                    break
                except Exception as e:  # noqa: BLE001 - report, back off, retry; never die silently
                    log.exception("trainer step failed")
                    if self._in_step:   # data parallel: the followers' adapters may now differ from ours
                        self.status.set("error", message=f"{type(e).__name__}: {e} (data-parallel step failed: "
                                                         f"exiting for torchrun to restart every rank)")
                        raise
                    # outside a step every rank's trainers are as they were: keep them (module doc);
                    # a failed step without torchrun already dropped its own (train_step) and its
                    # task waits out its own back-off (_step_failed) while the other tasks go on
                    waiting = {t: until - time.monotonic() for t, (until, _) in self._retry_at.items()
                               if until > time.monotonic()}
                    self._backoff = self.cfg.poll_s if waiting else min(max(2 * self._backoff, self.cfg.poll_s), 300.0)
                    self.status.set("error", message=f"{type(e).__name__}: {e} (" + (
                        ", ".join(f"{t} retries in {w:.0f}s" for t, w in waiting.items()) + "; other tasks go on"
                        if waiting else f"retrying in {self._backoff:.0f}s") + ")")
                    self.stop_event.wait(self._backoff)
                    self._command("idle")   # followers: rank 0 is alive, however long the store stays down
                    continue
                if did in ("idle", "paused"):
                    self._command("idle")   # followers wait in a collective: keep it well within its timeout
                    self.stop_event.wait(self.cfg.poll_s)
            self._command("stop")
        finally:
            if not self.lease_lost:
                self.status.set("stopped", message=f"stopped after {self.steps_done} steps")
            self.status.stop()
            if self._lease_held and not self.lease_lost:
                try:
                    self.lease.release()
                except Exception:  # noqa: BLE001 - it goes stale on its own
                    log.exception("could not release the trainer lease")
        return self.steps_done


def cli_main(argv: list[str] | None = None) -> int:
    from trainer import distributed
    from trainer.configcli import parse_config

    cfg, _ = parse_config(ServiceConfig, argv, prog="collab trainer",
                          description="Background trainer service: MAGRPO steps on the store's ready groups, "
                                      "new adapter versions published for the serving engine to hot-load.")
    # Secrets apart (collab_app/secret_env.py): the store URL (COLLAB_DB, where `collab serve` puts
    # it for its child: never on the command line) and any token, read once and dropped from the
    # environment; non-dumpable before anything else starts (self-play runs model code in the
    # sandbox, which on a Space has this process's uid): `collab trainer` sealed already, before
    # this module imported torch (cli.SEALED_FIRST); sealing again returns what it holds
    from collab_app.cpu.pin import confine_after_torch
    confine_after_torch()   # started by serve on both sides' cores (`pin --load-on`): now its own
    from collab_app.secret_env import seal
    held = seal()
    if not cfg.db and held.get("COLLAB_DB"):
        cfg = dataclasses.replace(cfg, db=held["COLLAB_DB"])
    world = distributed.init()   # torchrun: join its process group (world size 1 otherwise)
    rank = "" if world == 1 else f"[{distributed.rank()}]"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s trainer{rank} %(levelname)s %(message)s")
    service = TrainerService(cfg)

    def stop(signum, _frame):
        log.info("signal %d: stopping (a step under way stops at its next layer, nothing of it saved)", signum)
        service.stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        steps = service.run()
    finally:
        distributed.close()
    log.info("trainer service stopped after %d steps", steps)
    return 0
