"""`collab eval`: the team (current adapters) and the paper's baselines on a task split.

Systems (arXiv 2508.04652, Table 1 naming):
- `team`: the N-agent team with each agent's latest adapter version (from `--adapters-dir`),
  agents generate in parallel from their own prompts (the MAGRPO setting).
- `naive`: the same prompts with the untrained base model ("naive concatenation": each agent
  writes its part without seeing the other's, results combined).
- `sequential`: base model; agent k's prompt contains what agents < k wrote this turn.
- `single`: the task's single-agent variant (one agent does every role), base model.
- `single-trained`: the same single agent with its latest adapter version from
  `--single-adapters-dir`, trained by `collab train --num-agents 1` (the same trainer: MAGRPO with
  one agent is GRPO). The paper's fair baseline for the team: one adapter, the same model, reward
  and sampling; `team` against it is the claim under test.
(The paper's "discussion" baseline is left out: it needs a turn protocol the tasks don't model.)

The paper-style table is one call, `--systems naive sequential single single-trained team`: its
rows are naive (= the team untrained: the team's prompts, in parallel, on the base model),
sequential, single untrained, single GRPO-trained and team MAGRPO-trained.

Per system: the mean of each reward level, the mean return, each example's return (JSON, keyed by
example id, for paired comparisons between runs) and pass@1 (the share of examples
whose final joint answer reaches the task's success test: all unit tests pass for coding; the
full reward for writing). Sampling is greedy by default (temperature 0) so a run is repeatable;
pass `--temperature` to sample instead. With `naive` among the systems, every other system also
gets its paired difference to it (mean over problems of system - naive, 95% bootstrap CI); the
pairs in PAIRS that were both evaluated get theirs too (`paired`: team - single-trained, and
single-trained - single, what GRPO training gave the single agent).
`--compare A B` compares two saved results the same way (e.g. two training runs, or ours and
comlrl's) without evaluating anything.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from tasks.base import Turn, check_prompts, check_reward

from collab_app import paths

log = logging.getLogger(__name__)

SYSTEMS = ("team", "naive", "sequential", "single", "single-trained")
DEFAULT_SYSTEMS = ("team", "naive", "sequential", "single")
"""what runs without naming systems: everything but `single-trained`, which needs a trained single agent."""
PAIRS = (("team", "single-trained"), ("single-trained", "single"))
"""(B, A) pairs reported as B - A per problem with a 95% CI when both were evaluated: the trained team
against the trained single agent (the paper's claim), and the single agent trained against untrained."""


@dataclass
class EvalConfig:
    task: str = "humaneval"
    """task name (humaneval, tldr, expansion)."""
    split: str = "eval"
    """which split to evaluate: eval (held out) or train."""
    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    """systems to compare: any of team, naive, sequential, single, single-trained (in the table's order)."""
    limit: int = 0
    """evaluate only the first N examples of the split (0 = all)."""
    model: str = ""
    """base model: HF id or local folder (empty = the embedded SmolLM2-135M-Instruct)."""
    engine: str = "auto"
    """inference engine: auto, vllm or transformers."""
    adapters_dir: str = ""
    """where `collab train` / the trainer service keep adapter versions (empty = $COLLAB_HOME/adapters)."""
    single_adapters_dir: str = ""
    """single-trained: where `collab train --num-agents 1` kept the single agent's versions, e.g. its run's adapters/ (empty = --adapters-dir)."""
    num_turns: int = 1
    """turns per example; turn 2+ prompts carry Task.feedback (the paper reports 2 for HumanEval)."""
    max_new_tokens: int = 256
    """new tokens per agent answer."""
    temperature: float = 0.0
    """sampling temperature (0 = greedy, repeatable)."""
    seed: int = 0
    """sampling seed."""
    batch_size: int = 16
    """examples per engine call."""
    compare: list[str] = field(default_factory=list)
    """instead of evaluating: compare two results problem by problem (A B; each a `collab eval --out` or `collab bench comlrl --out` JSON, or a run's metrics.jsonl, its last eval or FILE@STEP)."""
    compare_system: str = "team"
    """which system of a `collab eval` JSON to compare (--compare)."""
    json: bool = False
    """print the result as JSON only."""
    out: str = ""
    """also write the JSON result to this file."""

    def __post_init__(self):
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad:
            raise ValueError(f"unknown system(s) {bad}: pick from {list(SYSTEMS)}")
        if self.split not in ("train", "eval"):
            raise ValueError("--split must be 'train' or 'eval'")
        if self.num_turns < 1:
            raise ValueError("--num-turns must be >= 1")
        if self.limit < 0 or self.batch_size < 1:
            raise ValueError("--limit must be >= 0 and --batch-size >= 1")
        if self.engine not in ("auto", "vllm", "transformers"):
            raise ValueError("--engine must be auto, vllm or transformers")
        if len(set(self.systems)) != len(self.systems):
            raise ValueError(f"--systems names a system twice: {self.systems}")
        if self.single_adapters_dir and "single-trained" not in self.systems:
            raise ValueError("--single-adapters-dir is read only by the single-trained system: add "
                             "single-trained to --systems, or drop --single-adapters-dir")
        if self.compare and len(self.compare) != 2:
            raise ValueError(f"--compare takes two result files (A B), got {len(self.compare)}")


def _success(task, reward) -> bool:
    """pass@1's test: for coding tasks every unit test passes, for writing the full reward."""
    if "tests" in reward.levels:
        return math.isclose(reward.levels["tests"], 1.0)
    return math.isclose(reward.total, reward.max_total)


def generate_joint(engine, agent_names, prompts_per_example, sampling, n: int = 1):
    """prompts_per_example[e][a] -> texts[e][a][g] (g < n) in one batched engine call: agent a's
    sample g of every example (`collab bench online`'s held-out scoring pairs sample g of each
    agent into joint answer g, as the server's candidates do)."""
    from collab_app.engines.engine_types import Request

    requests = [Request(agent=agent_names[a], prompt=p)
                for ps in prompts_per_example for a, p in enumerate(ps)]
    out = engine.generate(requests, n=n, sampling=sampling)
    k = len(agent_names)
    return [[[s.text for s in out[e * k + a]] for a in range(k)] for e in range(len(prompts_per_example))]


def run_system(system: str, task, examples, engine, agent_names, cfg: EvalConfig, sampling, progress):
    """Final-turn rewards for every example under one system."""
    rewards = []
    for start in range(0, len(examples), cfg.batch_size):
        batch = examples[start:start + cfg.batch_size]
        histories: list[list[Turn]] = [[] for _ in batch]
        outputs = None
        for _turn in range(cfg.num_turns):
            if system == "sequential":
                # agent k sees this turn's outputs of agents < k: one engine call per agent.
                outputs = [[] for _ in batch]
                for k in range(task.num_agents):
                    prompts = [[check_prompts(task, task.agent_prompts(ex, h, tuple(o)))[k]]
                               for ex, h, o in zip(batch, histories, outputs)]
                    texts = generate_joint(engine, [agent_names[k]], prompts, sampling)
                    for o, t in zip(outputs, texts):
                        o.append(t[0][0])
            else:
                prompts = [check_prompts(task, task.agent_prompts(ex, h)) for ex, h in zip(batch, histories)]
                outputs = [[a[0] for a in ex] for ex in generate_joint(engine, agent_names, prompts, sampling)]
            for ex, h, o in zip(batch, histories, outputs):
                h.append(Turn(tuple(o), tuple(task.feedback(ex, o))))
        for ex, o in zip(batch, outputs):
            rewards.append(check_reward(task, task.reward(ex, o)))
        progress.update(len(batch))
    return rewards


COOPERATION_FLAGS = ("calls_aux", "aux_reaches_return", "thin_wrapper", "ignores_aux")
"""What the coding reward's run-time probe found per answer (tasks/coding.py): counted, so a
cooperation level can be read as how many answers cooperated and how (thin wrapper or not)."""


def summarize(task, rewards, examples) -> dict:
    """Means over `rewards` (one per example, in order) plus each example's return, keyed by its
    id, so two runs can be compared example by example (paired), not only by their means."""
    n = max(len(rewards), 1)
    out = {
        "examples": len(rewards),
        "mean_return": sum(r.total for r in rewards) / n,
        "max_return": task.max_reward,
        "pass@1": sum(_success(task, r) for r in rewards) / n,
        "levels": {k: sum(r.levels[k] for r in rewards) / n for k in task.level_names},
        "returns": {str(ex["id"]): round(r.total, 4) for ex, r in zip(examples, rewards)},
    }
    if "cooperation" in task.level_names:
        out["cooperation_answers"] = {f: sum(bool((r.details or {}).get(f)) for r in rewards) for f in COOPERATION_FLAGS}
        out["cooperation_answers"]["rewarded"] = sum(r.levels["cooperation"] > 0 for r in rewards)
    return out


def evaluate(cfg: EvalConfig, engine=None) -> dict:
    from collab_app.engines.choose import make_engine
    from collab_app.engines.engine_types import Sampling
    from collab_app.engines.model import ensure_model
    from tasks import load_task
    from trainer.adapters import latest_version

    team_task = load_task(cfg.task)
    model_path = ensure_model(cfg.model or None)
    adapters_dir = cfg.adapters_dir or paths.adapters_dir()
    single_dir = cfg.single_adapters_dir or adapters_dir
    if "single-trained" in cfg.systems:   # before anything is evaluated: a missing adapter is a typo, not a baseline
        role = load_task(cfg.task, num_agents=1).roles[0]
        found = latest_version(single_dir, role)
        if found is None:
            raise FileNotFoundError(f"single-trained: no version of the single agent {role!r} under {single_dir}: train it "
                             f"with `collab train --task {cfg.task} --num-agents 1` and pass its run's adapters/ "
                             f"as --single-adapters-dir")
        if found[0] == 0:
            log.warning("single-trained: %s has only version 0 (the untrained adapter, = single)", role)
    # Agent names in use: the team's roles and the single agent's role (adapters), "base-<role>" for
    # naive/sequential and the untrained single agent: vLLM reserves LoRA slots per agent, so it must
    # know them all. The single role differs from every team role (tasks/), so none is served twice.
    # One call holds one system's agents: a compiled CPU engine's in-graph lanes are the team's.
    engine = engine or make_engine(cfg.engine, model=model_path, num_agents=2 * team_task.num_agents + 2,
                                   lora_lanes=team_task.num_agents)
    sampling = Sampling(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    examples = team_task.examples(cfg.split)
    examples = examples[:cfg.limit] if cfg.limit else examples

    result = {"task": cfg.task, "split": cfg.split, "engine": engine.name, "model": model_path,
              "num_turns": cfg.num_turns, "temperature": cfg.temperature, "systems": {}}
    total = len(examples) * len(cfg.systems)
    with tqdm(total=total, desc="eval", unit="ex", disable=None) as progress:
        for system in cfg.systems:
            task = load_task(cfg.task, num_agents=1) if system.startswith("single") else team_task
            if system in ("team", "single-trained"):
                # Agents named by role serve their latest adapter version (base if none yet).
                names, versions = list(task.roles), {}
                for role in task.roles:
                    engine.register_agent(role)
                    found = latest_version(adapters_dir if system == "team" else single_dir, role)
                    if found:
                        engine.load_adapter(role, found[1], found[0])
                    versions[role] = found[0] if found else None
            else:
                names, versions = [f"base-{r}" for r in task.roles], {}
                for name in names:
                    engine.register_agent(name)
            t0 = time.time()
            rewards = run_system(system, task, examples, engine, names, cfg, sampling, progress)
            summary = summarize(task, rewards, examples)
            summary["seconds"] = round(time.time() - t0, 1)
            if versions:
                summary["adapter_versions"] = versions
            result["systems"][system] = summary
    # each system against the untrained team, problem by problem (a paired CI, not just two means)
    systems = result["systems"]
    if "naive" in systems:
        base = systems["naive"]["returns"]
        for name, summary in systems.items():
            if name != "naive":
                summary["vs_naive"] = paired_difference(base, summary["returns"])
    paired = {f"{b} - {a}": paired_difference(systems[a]["returns"], systems[b]["returns"])
              for b, a in PAIRS if a in systems and b in systems}
    if paired:
        result["paired"] = paired
    return result


def format_table(result: dict) -> str:
    systems = result["systems"]
    levels = list(next(iter(systems.values()))["levels"]) if systems else []
    cols = ["system", "pass@1", "return"] + levels + ["sec", "return - naive (95% CI)"]

    def vs(s):
        c = s.get("vs_naive")
        return f"{c['mean_diff']:+.3f} ({c['ci95'][0]:+.3f} .. {c['ci95'][1]:+.3f})" if c else ""

    rows = [cols] + [[name, f"{s['pass@1']:.3f}", f"{s['mean_return']:.3f}"]
                     + [f"{s['levels'].get(k, float('nan')):.3f}" for k in levels] + [str(s["seconds"]), vs(s)]
                     for name, s in systems.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    head = f"{result['task']} / {result['split']} on {result['engine']} ({result['model']})"
    pairs = [f"{name}: {c['mean_diff']:+.3f} (95% CI {c['ci95'][0]:+.3f} .. {c['ci95'][1]:+.3f}) over "
             f"{c['problems']} problems; better on {c['b_better']}, equal on {c['equal']}, worse on {c['b_worse']}"
             for name, c in result.get("paired", {}).items()]
    return "\n".join([head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows] + pairs)


# ------------------------------------------------------------------------------- paired comparison
def load_returns(spec: str, system: str = "team") -> dict[str, float]:
    """Per-problem returns {example id: return} from a result file: a `collab eval` JSON (its
    `system`), any JSON with a top-level "returns" (collab bench comlrl), or a run's metrics.jsonl
    (its last eval record, or FILE@STEP for the eval at that step)."""
    path, _, step = spec.partition("@") if spec.rsplit("@", 1)[-1].isdigit() else (spec, "", "")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no result file {path!r}")
    if path.endswith(".jsonl"):
        with open(path) as f:
            evals = [r for r in map(json.loads, filter(str.strip, f)) if r.get("kind") == "eval" and "returns" in r]
        if step:
            evals = [r for r in evals if r["step"] == int(step)]
        if not evals:
            raise ValueError(f"{spec}: no eval record with per-problem returns"
                             + (f" at step {step}" if step else ""))
        return evals[-1]["returns"]
    with open(path) as f:
        data = json.load(f)
    if "returns" in data:
        return data["returns"]
    systems = data.get("systems", {})
    if system not in systems:
        raise ValueError(f"{path} has no system {system!r} (it has {sorted(systems)}): pass --compare-system")
    return systems[system]["returns"]


def paired_difference(a: dict[str, float], b: dict[str, float], resamples: int = 10_000, seed: int = 0) -> dict:
    """B - A over the problems both evaluated: the mean paired difference, a 95% percentile
    bootstrap CI over problems (resampled with replacement; fixed seed, so repeatable) and the
    count of problems where B is better / equal / worse. Pairing removes the between-problem
    variance (HumanEval problems differ far more from each other than two runs on one problem)."""
    import numpy as np

    ids = sorted(set(a) & set(b))
    if not ids:
        raise ValueError("the two results share no problem ids")
    d = np.array([b[i] - a[i] for i in ids])                                    # (P,)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)   # (resamples,)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"problems": len(ids), "mean_a": float(np.mean([a[i] for i in ids])),
            "mean_b": float(np.mean([b[i] for i in ids])), "mean_diff": float(d.mean()),
            "ci95": [float(lo), float(hi)], "b_better": int((d > 1e-9).sum()), "equal": int((abs(d) <= 1e-9).sum()),
            "b_worse": int((d < -1e-9).sum()), "only_in_a": len(set(a) - set(b)), "only_in_b": len(set(b) - set(a))}


def format_comparison(names: list[str], c: dict) -> str:
    return (f"A = {names[0]}\nB = {names[1]}\n{c['problems']} problems: mean return A {c['mean_a']:.3f}, "
            f"B {c['mean_b']:.3f}; B - A = {c['mean_diff']:+.3f} (95% CI {c['ci95'][0]:+.3f} .. {c['ci95'][1]:+.3f}); "
            f"B better on {c['b_better']}, equal on {c['equal']}, worse on {c['b_worse']}")


def cli_main(argv: list[str] | None = None) -> int:
    from trainer.configcli import parse_config

    cfg, _ = parse_config(EvalConfig, argv, prog="collab eval",
                          description="Evaluate the team (current adapters) and the baselines "
                                      "(naive, sequential, single agent) on a task split.")
    logging.basicConfig(level=logging.INFO if not cfg.json else logging.WARNING)
    if cfg.compare:
        comparison = paired_difference(*(load_returns(p, cfg.compare_system) for p in cfg.compare))
        comparison.update(a=cfg.compare[0], b=cfg.compare[1])
        if cfg.out:
            with open(cfg.out, "w") as f:
                json.dump(comparison, f, indent=2)
        print(json.dumps(comparison, indent=2) if cfg.json else format_comparison(cfg.compare, comparison))
        return 0
    try:
        result = evaluate(cfg)
    except FileNotFoundError as e:   # single-trained without a trained single agent: say how to make one
        print(f"collab eval: {e}", file=sys.stderr)
        return 2
    result["config"] = asdict(cfg)
    text = json.dumps(result, indent=2)
    if cfg.out:
        with open(cfg.out, "w") as f:
            f.write(text)
    print(text if cfg.json else format_table(result))
    return 0
