"""`collab train`: offline MAGRPO on a task's train split, with held-out evaluation.

    collab train --task humaneval --num-steps 20 --engine transformers
    collab train --task humaneval --num-agents 1 ...   # the single-agent GRPO baseline
    collab train --task tldr --agent-models "" /path/to/other-model   # a heterogeneous team

Provisions the model (embedded SmolLM2 by default), starts an engine (`auto`: see
collab_app/engines/__init__.py), saves version 0 of every agent's adapter, evaluates the team on
the first `--eval-examples` of the held-out split, then loops rollout -> MAGRPO update -> new
adapter versions -> hot-load into the engine, and finally evaluates again. Evaluation is greedy by
default (`--eval-temperature 0`), so before/after numbers are comparable; it is `collab eval`'s
"team" system (same code, same metrics).

Writes to `--output-dir`: metrics.jsonl (one line per train step and per evaluation),
TensorBoard events (tb/), config.json, summary.png, and adapter versions under adapters/ unless
`--adapters-dir` says otherwise.

`--num-agents 1` trains the task's single-agent variant with this same trainer (MAGRPO with one
agent is GRPO, the paper's baseline); its adapter is named by the task's single role, so its
versions cannot mix with the team's. `--agent-models A B` puts each agent on its own base (one
frozen base per distinct model, one engine per base: engines/team.py TeamEngine).

Data parallel (`torchrun --nproc_per_node 4 --no-python collab train ...`, one process per
device): each rank rolls out its share of the step's prompts with its own transformers engine,
the groups are all-gathered, the gradients summed over the ranks (trainer/distributed.py) and
every rank takes the same step; rank 0 alone evaluates, writes the run folder and publishes
adapter versions. docs/SCALING.md has the commands.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, replace

from collab_app.engines.engine_types import Sampling
from collab_app.engines.sampler import EngineSampler

log = logging.getLogger(__name__)


def evaluate_team(engine, task, examples, cfg) -> dict:
    """Mean return, pass@1 and level means of the team (agents = roles, current adapters) on
    `examples`, with `collab eval`'s code; one joint answer per example, cfg.num_turns turns."""
    from tqdm import tqdm

    from collab_app.commands.evaluate import EvalConfig, run_system, summarize

    ecfg = EvalConfig(task=cfg.task, systems=["team"], num_turns=cfg.num_turns, max_new_tokens=cfg.max_new_tokens,
                      temperature=cfg.eval_temperature, seed=cfg.seed)
    sampling = Sampling(max_new_tokens=cfg.max_new_tokens, temperature=cfg.eval_temperature, seed=cfg.seed)
    t0 = time.time()
    with tqdm(total=len(examples), desc="eval", unit="ex", leave=False, disable=None) as progress:
        rewards = run_system("team", task, examples, engine, list(task.roles), ecfg, sampling, progress)
    summary = summarize(task, rewards, examples)
    out = {"return_mean": summary["mean_return"], "pass@1": summary["pass@1"], "examples": summary["examples"],
           "seconds": round(time.time() - t0, 1)}
    out.update({f"level/{k}": v for k, v in summary["levels"].items()})
    if "cooperation_answers" in summary:   # how many answers cooperated, and how (tasks/coding.py)
        out["cooperation_answers"] = summary["cooperation_answers"]
    out["returns"] = summary["returns"]   # per problem: collab eval --compare pairs two runs or steps
    return out


class RunLog:
    """metrics.jsonl + TensorBoard, one record per train step / evaluation."""

    def __init__(self, output_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.records: list[dict] = []
        if os.path.exists(self.path):  # a resumed run keeps its history (and its plot)
            from collab_app.web.plots import load_metrics

            self.records = load_metrics(self.path)
        self.tb = SummaryWriter(os.path.join(output_dir, "tb"))

    def write(self, kind: str, step: int, metrics: dict) -> None:
        rec = {"kind": kind, "step": step, "time": time.time(), **metrics}
        self.records.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=float) + "\n")
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step":
                self.tb.add_scalar(f"{kind}/{k}", v, step)
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()


def _fmt_eval(e: dict) -> str:
    levels = "  ".join(f"{k.split('/', 1)[1]}={v:.3f}" for k, v in e.items() if k.startswith("level/"))
    return f"return={e['return_mean']:.3f}  pass@1={e['pass@1']:.3f}  {levels}"


def cli_main(argv: list[str] | None = None) -> int:
    from collab_app.engines.model import collab_home, ensure_model
    from collab_app.engines.team import make_team_engine
    from collab_app.web.plots import save_summary_plot
    from tasks import load_task
    from trainer import distributed
    from trainer.config import MAGRPOConfig
    from trainer.configcli import parse_config
    from trainer import offline
    from trainer.magrpo import MAGRPOTrainer

    cfg, _ = parse_config(MAGRPOConfig, argv, prog="collab train",
                          description="Offline MAGRPO training of the team's per-agent LoRA adapters on a task.")
    world = distributed.init()   # torchrun: join its process group (world size 1 otherwise)
    main = distributed.is_main()
    logging.basicConfig(level=logging.INFO if main else logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    if world > 1 and cfg.engine != "transformers":
        if cfg.engine == "vllm":
            print("collab train: --engine vllm is not supported under torchrun (each rank would start its "
                  "own vLLM beside the trainer's process group); use --engine transformers", file=sys.stderr)
            return 2
        log.info("torchrun: rollouts on the transformers engine of each rank")
        cfg = replace(cfg, engine="transformers")
    try:   # before a run folder is made: a refused run leaves nothing behind
        # --num-agents 1 is the task's single-agent variant (one agent does every role): MAGRPO with
        # one agent is GRPO, the paper's single-agent baseline, trained by this same loop
        task = load_task(cfg.task, num_agents=cfg.num_agents)
    except ValueError as e:   # an unknown task, or a team size the task has no prompts for
        print(f"collab train: --task {cfg.task} --num-agents {cfg.num_agents}: {e}", file=sys.stderr)
        return 2
    unknown = [role for role in cfg.named_models() if role not in task.roles]
    if unknown:
        print(f"collab train: --agent-models names {unknown}, which are not roles of {cfg.task} "
              f"(its roles: {list(task.roles)}); name those roles, or give one model per agent in role order",
              file=sys.stderr)
        return 2
    t_start = time.time()
    single = "single-" if cfg.num_agents == 1 else ""   # a single agent's run folder says so
    output_dir = cfg.output_dir or os.path.join(collab_home(), "runs", f"{cfg.task}-{single}{time.strftime('%Y%m%d-%H%M%S')}")
    output_dir = distributed.broadcast_object(output_dir)   # rank 0's clock names the run
    cfg = replace(cfg, output_dir=output_dir, adapters_dir=cfg.adapters_dir or os.path.join(output_dir, "adapters"),
                  model=ensure_model(cfg.model or None))
    if cfg.agent_models:   # each agent's own base, resolved to a folder: positional from here on
        cfg = replace(cfg, agent_models=tuple(ensure_model(m) for m in cfg.models_for(task.roles)))
    if main:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)

    eval_examples = task.examples("eval")[:cfg.eval_examples]
    trainer = MAGRPOTrainer(cfg, task, cfg.adapters_dir)
    # decode_thread=False: rollouts and steps alternate on this thread, so an in-process vLLM engine
    # shares the trainer's OpenMP team instead of keeping a second one alive beside it, which made
    # libgomp throttle both (engine_vllm.VLLMEngine's decode_thread; docs/CPU.md)
    kw = {"seed": cfg.seed, "num_agents": cfg.num_agents, "decode_thread": False}
    if cfg.lora_r > 8:  # VLLMEngine's default max_lora_rank
        kw["max_lora_rank"] = cfg.lora_r
    # a heterogeneous team (--agent-models): one engine per distinct base, as one Engine (engines/team.py)
    engine = make_team_engine(cfg.engine, cfg.model, trainer.base_of, **kw)
    sampler = EngineSampler(engine)
    for role in task.roles:
        engine.register_agent(role)
    trainer.load_into(sampler)
    if not main:   # data parallel, rank > 0: rollouts and gradients only; rank 0 evaluates and writes
        try:
            offline.train(trainer, sampler)
        finally:
            engine.close()
            distributed.close()
        return 0
    run = RunLog(output_dir)
    bases = "".join(f"\n  {a} on {trainer.base_of[a]}" for a in trainer.agents) if cfg.agent_models else ""
    print(f"collab train: task={cfg.task} engine={engine.name} model={cfg.model}{bases}"
          f"{f' ranks={world}' if world > 1 else ''}\n"
          f"  output {output_dir}\n  adapters {cfg.adapters_dir} (versions {trainer.versions})", flush=True)

    def evaluate(label: str) -> dict | None:
        if not eval_examples:
            return None
        e = evaluate_team(engine, task, eval_examples, cfg)
        e["versions"] = dict(trainer.versions)
        run.write("eval", trainer.step, e)
        print(f"eval {label} (step {trainer.step}, {len(eval_examples)} held-out examples, "
              f"{'greedy' if cfg.eval_temperature == 0 else f'T={cfg.eval_temperature}'}): {_fmt_eval(e)}", flush=True)
        return e

    def on_step(metrics: dict) -> None:
        run.write("train", metrics["step"], metrics)
        if (cfg.eval_every and metrics["step"] % cfg.eval_every == 0 and metrics["step"] < cfg.num_steps
                and not offline.out_of_time(trainer)):   # the last step's evaluation is "after"
            evaluate("during")

    try:
        before = evaluate("before")
        offline.train(trainer, sampler, on_step=on_step)
        after = evaluate("after")
    finally:
        run.close()
        engine.close()
        distributed.close()
    plot = save_summary_plot(run.records, os.path.join(output_dir, "summary.png"),
                             title=f"{'GRPO, one agent,' if cfg.num_agents == 1 else 'MAGRPO'} on {cfg.task} "
                                   f"({os.path.basename(cfg.model)})")
    print(f"done in {time.time() - t_start:.0f} s ({trainer.train_seconds / 60:.1f} min of rollouts + updates): "
          f"step {trainer.step}, versions {trainer.versions}")
    if before and after:
        print(f"  held-out before: {_fmt_eval(before)}\n  held-out after:  {_fmt_eval(after)}")
    print(f"  metrics {run.path}\n  plot    {plot}\n  adapters {cfg.adapters_dir}")
    return 0
