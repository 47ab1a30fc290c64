"""`MAGRPOConfig`: every knob of a MAGRPO run, flat dataclasses (the CLI is generated from them).

`StepConfig` holds what the steps and their rollouts need, which the online trainer
(collab_app/online/service.py `ServiceConfig`) extends too; `MAGRPOConfig` adds the offline loop's
own (learning-rate schedule, time budget, dynamic sampling), so `collab trainer` has no such flags.

Names follow the paper (arXiv 2508.04652); docs/ARCHITECTURE.md "MAGRPO as implemented" says how
they are used. Each field's one-line doc after it is its `--help` text (trainer/configcli.py).
`__post_init__` rejects settings that cannot work and says how to fix them; it checks nothing that
needs the task or the model (the trainer does: num_agents vs the task's roles, the model folder).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

# A rollout tree with more reward calls per prompt than this is almost surely a typo
# (cross mode grows as G^N per turn and (G^N)^T over T turns).
MAX_REWARD_CALLS_PER_PROMPT = 512

# Each list of choices is spelled once: the Literal types the field (and gives `--help` its
# choices), the tuple is what `__post_init__` and trainer/magrpo.py check against.
JointMode = Literal["aligned", "cross"]
JOINT_MODES: tuple[str, ...] = get_args(JointMode)
CrossCredit = Literal["mean", "max"]
CROSS_CREDITS: tuple[str, ...] = get_args(CrossCredit)
AdvantageMode = Literal["mean", "rloo", "max", "raw"]
ADVANTAGE_MODES: tuple[str, ...] = get_args(AdvantageMode)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclass
class StepConfig:
    """The knobs of MAGRPO steps and their rollouts, which the offline run (`MAGRPOConfig`,
    `collab train`) and the online trainer (`ServiceConfig`, `collab trainer`) share."""

    # -- what to train ------------------------------------------------------------------------
    task: str = "humaneval"
    """task name (humaneval, tldr, expansion); its roles name the agents."""
    model: str = ""
    """base model: HF id or local folder (empty = the embedded SmolLM2-135M-Instruct)."""
    agent_models: tuple[str, ...] = ()
    """each agent's own base model, a heterogeneous team: one entry per agent in role order ("" = --model), or ROLE=MODEL entries (roles not named: --model); empty = every agent on --model."""
    engine: Literal["auto", "vllm", "transformers"] = "auto"
    """inference engine for rollouts: auto (vLLM where it is faster/available), vllm or transformers."""
    num_agents: int = 2
    """agents: the task's team size (its number of roles), or 1 for its single-agent variant (one agent does every role: GRPO, the paper's single-agent baseline)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the trainer's frozen base model: auto (bf16 on a GPU or a CPU with native bf16, else fp32; trainer/dtypes.py), float32 or bfloat16 (LoRA weights and optimizer state are always float32)."""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """where the trainer's model and optimizers live: auto (cuda when a GPU is visible, else mps on Apple silicon, else cpu; trainer/dtypes.py), cpu, cuda or mps."""

    # -- groups and joint actions (paper §4) --------------------------------------------------
    num_generations: int = 8
    """G: completions each agent samples per prompt (the group size). 8 with 2 prompts per step: the same 16 samples per agent and step as 4 x 4, and a better held-out team at equal minutes on HumanEval (two seeds) and TL;DR (docs/results/README.md)."""
    joint_mode: JointMode = "aligned"
    """aligned: sample g of every agent forms joint action g (G joint actions); cross: Cartesian product (G^N)."""
    cross_credit: CrossCredit = "mean"
    """cross mode only: a completion's return is the mean (default) or max of the joint returns it took part in."""
    advantage_mode: AdvantageMode = "mean"
    """advantage of a return R in its group: mean (R - mean R, the paper's), rloo (R - mean of the others), max (R - max R), raw (R)."""
    normalize_std: bool = False
    """divide advantages by the group's return std (+1e-4); off in the paper."""

    # -- multi-turn ---------------------------------------------------------------------------
    num_turns: int = 1
    """turns per episode; turn t+1 prompts carry Task.feedback (the paper uses 2 for HumanEval)."""
    gamma: float = 0.9
    """discount: R_t = r_t + gamma * mean(returns of the child group)."""
    early_stop_threshold: float | None = None
    """a group whose mean reward reaches this spawns no next turn (None = always run num_turns)."""

    # -- optimisation -------------------------------------------------------------------------
    learning_rate: float = 1e-4
    """AdamW learning rate of each agent's LoRA adapter (the peak, when lr_schedule is not constant)."""
    max_grad_norm: float = 1.0
    """clip each agent's adapter gradient to this L2 norm."""
    lora_r: int = 8
    """LoRA rank (vLLM serves ranks up to its max_lora_rank, 16 by default)."""
    lora_alpha: int = 16
    """LoRA alpha (scale = alpha / r)."""
    lora_dropout: float = 0.0
    """LoRA dropout; > 0 makes the importance ratio noisy even when nothing moved."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """module names that get LoRA (attention projections of a Llama block)."""
    clip_epsilon: float = 0.2
    """PPO clip range of the importance ratio pi_new / pi_behaviour (matters for late, online data)."""
    max_staleness: int = 16
    """last resort: drop a group once an agent wrote more than this many versions after it arrived (late data is otherwise trained under the clipped ratio)."""
    kl_coef: float = 0.0
    """weight of the KL penalty to the base model (adapter disabled); KL is logged either way."""
    micro_batch_size: int = 8
    """sequences per forward/backward in the update (gradients accumulate; lower it to save memory)."""

    # -- sampling -----------------------------------------------------------------------------
    temperature: float = 0.8
    """rollout sampling temperature (> 0: siblings must differ to give an advantage)."""
    top_p: float = 1.0
    """rollout nucleus sampling: 1 only (the trainer cannot reproduce a truncated distribution's log-probs; groups sampled with top_p < 1 are refused for training)."""
    max_new_tokens: int = 128
    """new tokens per agent completion."""

    # -- schedule -----------------------------------------------------------------------------
    prompts_per_step: int = 2
    """prompts (groups at turn 1) per MAGRPO step (x num_generations = samples per agent and step)."""
    num_steps: int = 100
    """MAGRPO steps (one update of every agent each)."""
    eval_every: int = 0
    """evaluate on the held-out split every this many steps (0 = only before and after training)."""
    eval_examples: int = 16
    """held-out examples per evaluation (the first N of the eval split, so every evaluation sees the same ones)."""
    eval_temperature: float = 0.0
    """evaluation sampling temperature (0 = greedy, repeatable)."""
    seed: int = 0
    """seed for LoRA init, prompt order and sampling."""

    # -- files --------------------------------------------------------------------------------
    output_dir: str = ""
    """run folder: metrics.jsonl, TensorBoard events, summary plot (empty = $COLLAB_HOME/runs/<task>-<time>)."""
    adapters_dir: str = ""
    """adapter versions <dir>/<agent>/v000001/ (empty = <output_dir>/adapters)."""
    resume: bool = True
    """continue from the latest adapter versions (weights, optimizer, step) found in adapters_dir."""
    keep_versions: int = 20
    """keep only the newest N adapter versions per agent, plus version 0 (0 = keep all)."""

    def __post_init__(self):
        _need(self.num_agents >= 1, f"num_agents must be >= 1, got {self.num_agents}")
        self.agent_models = tuple(self.agent_models)
        named = [m for m in self.agent_models if "=" in m]
        _need(not named or len(named) == len(self.agent_models),
             f"agent_models {list(self.agent_models)} mixes ROLE=MODEL entries with plain ones: give one model "
             f"per agent in role order (\"\" = --model), or name every entry's role, e.g. main=/path/to/model")
        _need(named or not self.agent_models or len(self.agent_models) == self.num_agents,
             f"agent_models has {len(self.agent_models)} entries for {self.num_agents} agents: give one per agent "
             f"in role order (\"\" keeps an agent on --model), e.g. --agent-models \"\" /path/to/model, "
             f"or ROLE=MODEL entries for some roles only")
        roles = [m.split("=", 1)[0] for m in named]
        _need(all(r.strip() and m.split("=", 1)[1].strip() for r, m in zip(roles, named)) and len(set(roles)) == len(roles),
             f"agent_models {named}: each ROLE=MODEL entry needs a role and a model, each role once")
        _need(self.num_generations >= 2,
             f"num_generations must be >= 2, got {self.num_generations}: a group needs siblings: MAGRPO's "
             f"advantage is a return minus the mean of its group, so a group of one has advantage 0 and "
             f"teaches nothing. Use --num-generations 2 or more (the paper uses 4).")
        _need(self.joint_mode in JOINT_MODES, f"joint_mode must be one of {', '.join(JOINT_MODES)}; got {self.joint_mode!r}")
        _need(self.cross_credit in CROSS_CREDITS, f"cross_credit must be one of {', '.join(CROSS_CREDITS)}; got {self.cross_credit!r}")
        _need(self.advantage_mode in ADVANTAGE_MODES,
             f"advantage_mode must be one of {', '.join(ADVANTAGE_MODES)}; got {self.advantage_mode!r}")
        _need(self.engine in ("auto", "vllm", "transformers"), f"engine must be auto, vllm or transformers, got {self.engine!r}")
        _need(self.dtype in ("auto", "float32", "bfloat16"), f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        _need(self.device in ("auto", "cpu", "cuda", "mps"), f"device must be auto, cpu or cuda (or mps on Apple silicon), got {self.device!r}")
        _need(self.num_turns >= 1, f"num_turns must be >= 1, got {self.num_turns}")
        _need(0.0 <= self.gamma <= 1.0, f"gamma must be in [0, 1], got {self.gamma}")
        joint = self.num_generations ** (self.num_agents if self.joint_mode == "cross" else 1)
        calls = sum(joint ** t for t in range(1, self.num_turns + 1))
        _need(calls <= MAX_REWARD_CALLS_PER_PROMPT,
             f"this rollout tree needs {calls} reward calls per prompt ({joint} joint actions per group, "
             f"{self.num_turns} turns; max {MAX_REWARD_CALLS_PER_PROMPT}): lower --num-generations or "
             f"--num-turns, or use --joint-mode aligned")
        _need(self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate}")
        _need(self.max_grad_norm > 0, f"max_grad_norm must be > 0 (gradient clipping), got {self.max_grad_norm}")
        _need(self.lora_r >= 1 and self.lora_alpha > 0, f"lora_r must be >= 1 and lora_alpha > 0, got {self.lora_r}, {self.lora_alpha}")
        _need(0.0 <= self.lora_dropout < 1.0, f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        _need(bool(self.lora_target_modules), "lora_target_modules is empty: name at least one module, e.g. q_proj v_proj")
        _need(self.clip_epsilon > 0, f"clip_epsilon must be > 0 (PPO clip range), got {self.clip_epsilon}")
        _need(self.max_staleness >= 0, f"max_staleness must be >= 0 versions, got {self.max_staleness}")
        _need(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
        _need(self.micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        _need(self.temperature > 0,
             f"temperature must be > 0 for rollouts, got {self.temperature}: greedy decoding makes all G "
             f"siblings identical, so every advantage is 0. Use e.g. --temperature 0.8 "
             f"(evaluation is greedy by default: --eval-temperature).")
        _need(self.top_p == 1.0, f"top_p must be 1, got {self.top_p}: the trainer's log-probs cannot reproduce "
                                f"nucleus truncation, so every group sampled with top_p < 1 would be refused")
        _need(self.eval_temperature >= 0, f"eval_temperature must be >= 0 (0 = greedy), got {self.eval_temperature}")
        _need(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _need(self.prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        _need(self.num_steps >= 0, f"num_steps must be >= 0, got {self.num_steps}")
        _need(self.eval_every >= 0 and self.eval_examples >= 0,
             f"eval_every and eval_examples must be >= 0 (0 = off), got {self.eval_every}, {self.eval_examples}")
        _need(self.keep_versions >= 0, f"keep_versions must be >= 0 (0 = keep all), got {self.keep_versions}")
        if self.keep_versions:
            _need(self.keep_versions > self.max_staleness,
                 f"keep_versions ({self.keep_versions}) must exceed max_staleness ({self.max_staleness}): an "
                 f"engine may still serve a version the trainer accepts data from; raise --keep-versions or use 0")

    def named_models(self) -> dict[str, str]:
        """ROLE -> MODEL of ROLE=MODEL agent_models entries ({} for a positional list or none)."""
        return dict(m.split("=", 1) for m in self.agent_models if "=" in m)

    def models_for(self, roles) -> list[str]:
        """(N,) the base model of each agent of a team with these roles, in order: its agent_models
        entry (positional, or ROLE=MODEL), else `model`. A positional list must match the team's size."""
        roles = list(roles)
        named = self.named_models()
        if named:
            return [named.get(r) or self.model for r in roles]
        if not self.agent_models:
            return [self.model] * len(roles)
        if len(self.agent_models) != len(roles):
            raise ValueError(f"agent_models has {len(self.agent_models)} entries for the {len(roles)} agents "
                             f"{roles}: give one per agent, or ROLE=MODEL entries")
        return [m or self.model for m in self.agent_models]


@dataclass
class MAGRPOConfig(StepConfig):
    """Every knob of an offline MAGRPO run (`collab train`): StepConfig plus the offline loop's
    own, which an online trainer has nothing to apply to (no end of the run to decay towards, no
    prompts of its own to refill)."""

    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """learning rate over the run: constant, or decay to 0 (cosine / linear) over num_steps or max_minutes, whichever ends first."""
    warmup_steps: int = 0
    """steps of linear warm-up from learning_rate / (warmup_steps + 1) to learning_rate."""
    max_minutes: float = 0.0
    """also stop once rollouts + updates took this many minutes (0 = no limit; evaluation and start-up not counted)."""
    dynamic_sampling: int = 0
    """extra rollouts per step that replace prompts whose groups all have equal returns (no signal) with fresh ones (0 = off; DAPO's dynamic sampling)."""

    def __post_init__(self):
        super().__post_init__()
        _need(self.max_minutes >= 0, f"max_minutes must be >= 0 (0 = no time limit), got {self.max_minutes}")
        _need(self.dynamic_sampling >= 0, f"dynamic_sampling must be >= 0 extra rollouts per step (0 = off), "
                                         f"got {self.dynamic_sampling}")
        _need(self.lr_schedule in ("constant", "cosine", "linear"),
             f"lr_schedule must be constant, cosine or linear, got {self.lr_schedule!r}")
        _need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
