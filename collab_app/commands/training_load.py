"""A real MAGRPO update loop in a child process on the trainer child's cores, as `collab serve`
runs one: the training load the benches time a person's round beside (`collab bench generate
--beside-training`, `collab bench train`). Not for serving: the benches' tool."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

from collab_app.cpu.cores import THREAD_VARS, CpuSplit, affinity_cores, apply_to_serving, confine, fmt_cores, plan
from collab_app.cpu.lending import YIELD_SHARE, CoreLease
from collab_app.cpu.pin import confine_after_torch, pinned_command
from collab_app.engines.engine_types import Sample
from collab_app.engines.model import ensure_model
from tasks import load_task
from trainer.config import MAGRPOConfig
from trainer.magrpo import Group, MAGRPOTrainer, TrainerHooks, sequence_logprobs


def _load_loop(args) -> None:
    """A real MAGRPO update loop on fake groups (random completions of real prompts; behaviour
    log-probs = the trainer's own, so the ratio starts at 1), until SIGTERM. Writes
    {"ready": true} once the model is loaded, then {"steps": n, "last_s": s} after each step."""
    import random
    import signal

    import torch
    import transformers

    confine_after_torch()   # started on both sides' cores (training_load's engine_cores): now its own
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    task = load_task("tldr")
    cfg = MAGRPOConfig(model=ensure_model(None), task="tldr", num_agents=task.num_agents,
                       num_generations=args.num_generations, dtype=args.dtype)
    trainer = MAGRPOTrainer(cfg, task, args.adapters_dir)
    tok = transformers.AutoTokenizer.from_pretrained(cfg.model)
    rng = random.Random(0)
    vocab = [i for i in range(100, tok.vocab_size) if i not in trainer.eos_token_ids]
    examples = task.examples("train")
    groups = []
    for k in range(args.groups):
        ex = examples[k % len(examples)]
        prompts = task.agent_prompts(ex, [])
        samples = []
        for i, p in enumerate(prompts):
            pids = list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"])
            comps = [[rng.choice(vocab) for _ in range(args.new_tokens)] for _ in range(args.num_generations)]
            model = trainer.model_of[trainer.agents[i]]
            model.set_adapter(trainer.agents[i])
            with torch.no_grad():
                lp, _ = sequence_logprobs(model, [pids] * len(comps), comps, trainer.eos_of[trainer.agents[i]])
            samples.append([Sample(agent=trainer.agents[i], adapter_version=0, prompt_token_ids=pids, text="",
                                   token_ids=c, logprobs=lp[j].tolist()) for j, c in enumerate(comps)])
        G = args.num_generations
        groups.append(Group(task="tldr", example_id=str(ex["id"]), turn=0, prompts=prompts, samples=samples,
                            joint=[(g,) * task.num_agents for g in range(G)],
                            returns=[float(g % 2) + 0.1 * g for g in range(G)]))   # distinct: a signal

    def write(obj):
        with open(args.status + ".tmp", "w") as f:
            json.dump(obj, f)
        os.replace(args.status + ".tmp", args.status)

    write({"ready": True, "steps": 0, "pid": os.getpid(), "threads": torch.get_num_threads(),
           "cores": affinity_cores()})
    steps, paused = 0, 0.0
    engine_cores = tuple(int(c) for c in args.engine_cores.split(",") if c)
    lease = CoreLease(args.core_lease, args.yield_share, engine_cores, args.pause_credit) if args.core_lease else None
    if lease:   # as `collab trainer --core-lease` does
        trainer.hooks = TrainerHooks(pause=lease.pause, pieces_done=lease.narrow)
    while not stop:
        for g in groups:   # keep them within max_staleness: the load is about compute, not data
            for i, a in enumerate(trainer.agents):
                for s in g.samples[i]:
                    s.adapter_version = trainer.versions[a]
        t0 = time.perf_counter()
        with (lease.held() if lease else contextlib.nullcontext()):
            m = trainer.update(groups)
        steps += 1
        paused += m["time/paused_s"]
        write({"ready": True, "steps": steps, "last_s": time.perf_counter() - t0, "last_paused_s": m["time/paused_s"],
               "paused_s": paused, "wide_s": lease.wide_s if lease else 0.0, "pid": os.getpid(),
               "threads": torch.get_num_threads(), "cores": affinity_cores()})


class TrainingLoad:
    """Handle of a running `training_load()`: `.status()` = the loop's last report."""

    def __init__(self, proc: subprocess.Popen, status_path: str, split: CpuSplit | None):
        self.proc, self.status_path, self.split = proc, status_path, split

    def status(self) -> dict:
        try:
            with open(self.status_path) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_steps(self, n: int, timeout: float) -> dict:
        """Block until the loop reports `n` steps (or raise TimeoutError)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.status()
            if st.get("steps", 0) >= n:
                return st
            if self.proc.poll() is not None:
                raise RuntimeError(f"training load exited with code {self.proc.returncode}")
            time.sleep(0.5)
        raise TimeoutError(f"training load did not reach {n} steps in {timeout:.0f}s: {self.status()}")


@contextlib.contextmanager
def training_load(engine_cores: int = 0, groups: int = 2, num_generations: int = 4, new_tokens: int = 128,
                  dtype: str = "auto", ready_timeout: float = 600.0, core_lease: str | None = None,
                  yield_share: float = YIELD_SHARE, lend_engine_cores: bool = False, pause_credit: bool = True):
    """A MAGRPO update loop (2 tldr groups x G=4 x 128 tokens by default: the interactive
    workload's step) in a child process, on the trainer child's cores of `plan(engine_cores)`
    (-1 = no split: every core, as before this module); this process is confined to the engine's
    cores like `collab serve` does, and restored on exit. Yields a TrainingLoad once the
    model is loaded and updates are running; stops the child on exit. `core_lease`: the loop
    holds this CoreLease for each step, as `collab trainer --core-lease` does (an engine given
    `lend_trainer_cores` borrows the cores between steps, and within a step while its round waits
    for them, up to `yield_share`: 0 = the old behaviour, a step never pauses).
    `pause_credit` False: the steps pause on `yield_share` alone, as serve's trainer does when it
    was idle before a step (a person's pace); the loop itself never idles (steps back to back), so
    with the credit rule it pauses as a trainer behind on its ratings does: hardly at all.
    `lend_engine_cores` (with core_lease and a split): the loop's steps also work on the engine's
    cores between its calls, as serve's trainer child does (`CoreLease(engine_cores=...)`; the
    engine must announce its calls: `lend_trainer_cores(..., lend_engine_cores=True)`).

        with training_load() as load:
            ... time a round ...
        print(load.status())   # {"steps": n, "last_s": seconds of the last step}
    """
    split = plan(engine_cores)
    tmp = tempfile.mkdtemp(prefix="collab-load-")
    status = os.path.join(tmp, "status.json")
    argv = [sys.executable, "-m", "collab_app.commands.training_load", "--status", status,
            "--adapters-dir", os.path.join(tmp, "adapters"), "--groups", str(groups),
            "--num-generations", str(num_generations), "--new-tokens", str(new_tokens), "--dtype", dtype]
    if core_lease:
        argv += ["--core-lease", core_lease, "--yield-share", str(yield_share)]
        if not pause_credit:
            argv.append("--no-pause-credit")
        if lend_engine_cores and split is not None:
            argv += ["--engine-cores", fmt_cores(split.engine)]
    old_aff = affinity_cores()
    old_env = {v: os.environ.get(v) for v in (*THREAD_VARS, "VLLM_CPU_OMP_THREADS_BIND")}
    import torch
    old_threads = torch.get_num_threads()
    if split is not None:
        argv = pinned_command(split.trainer, argv, split.engine + split.trainer)
        apply_to_serving(split)
    proc = subprocess.Popen(argv)
    load = TrainingLoad(proc, status, split)
    try:
        end = time.monotonic() + ready_timeout
        while not load.status().get("ready"):
            if proc.poll() is not None:
                raise RuntimeError(f"training load exited with code {proc.returncode} before it was ready")
            if time.monotonic() > end:
                raise TimeoutError(f"training load not ready after {ready_timeout:.0f}s")
            time.sleep(0.5)
        yield load
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if old_aff is not None:
            confine(old_aff)
        for v, val in old_env.items():
            if val is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = val
        torch.set_num_threads(old_threads)
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m collab_app.commands.training_load")
    p.add_argument("--status", required=True)
    p.add_argument("--adapters-dir", required=True)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--core-lease", default="", help="hold this CoreLease for each step")
    p.add_argument("--yield-share", type=float, default=YIELD_SHARE,
                   help="with --core-lease: pause budget for a waiting round (ServiceConfig.yield_share)")
    p.add_argument("--engine-cores", default="",
                   help="with --core-lease: the engine's cores, worked on between its calls (ServiceConfig.borrow_engine_cores)")
    p.add_argument("--no-pause-credit", dest="pause_credit", action="store_false",
                   help="with --core-lease: pause on --yield-share alone, not only as long as the loop idled "
                        "(it never idles: steps back to back; ServiceConfig.pause_credit)")
    _load_loop(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
