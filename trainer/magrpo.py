"""MAGRPO (Liu et al., arXiv 2508.04652) on one LoRA adapter per agent, top to bottom:

    rollout   each agent samples G completions per prompt (one batched engine call), joint
              actions (aligned: G; cross: G^N), team reward per joint action, multi-turn tree
    returns   R_t = r_t + gamma * mean(returns of the child group)            (compute_returns)
    advantage A = R - mean R (paper); rloo / max / raw; optional / std        (advantages)
    loss      per agent: -sum_t min(rho_t A, clip(rho_t, 1-eps, 1+eps) A) over the completion's
              real tokens, rho_t = pi_new / pi_behaviour. With fresh data rho = 1 and this is
              the paper's -A * log pi(a|h) (same gradient); the clip only bites on late data.
    step      one AdamW step per agent on its own adapter, then a new adapter version on disk

Policies: ONE frozen base model with a peft LoRA adapter per agent (`set_adapter` switches),
one optimizer per agent over that adapter's parameters only. Agent names are the task's roles.

Data arrives late when the app collects it online, so every sample keeps the adapter version
and the (untempered) log-probs it was generated with (collab_app/engines/engine_types.py); groups more
than `max_staleness` versions behind are dropped.

Knows nothing of collab_app: the inference engine reaches rollout through the `Sampler`
protocol below (collab_app.commands.train_cmd.EngineSampler wraps an Engine).
Left out: heterogeneous agents (one base per agent), several optimizer epochs per batch,
value baselines. Shapes in comments: B sequences, T completion tokens, G group size, J joint actions.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from tqdm import tqdm

from tasks.base import Turn, check_prompts, check_reward
from trainer import adapters as store
from trainer.config import MAGRPOConfig

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
@dataclass
class Group:
    """One prompt (one node of the rollout tree) with its G samples per agent and joint actions.
    Samples are Sample-like: .text, .token_ids, .logprobs, .prompt_token_ids, .adapter_version."""

    task: str
    example_id: str
    turn: int                                    # 0 = first turn
    prompts: list[str]                           # (N,) one per agent
    samples: list[list[Any]]                     # (N, G) [agent][g]
    joint: list[tuple[int, ...]]                 # (J,) joint action k -> sample index per agent
    returns: list[float]                         # (J,) R_t (= rewards until compute_returns)
    rewards: list[float] = field(default_factory=list)           # (J,) immediate team reward r_t
    levels: list[dict[str, float]] = field(default_factory=list)  # (J,) named reward levels
    parent: tuple[int, int] | None = None        # (parent group's index in the rollout, its joint action)
    created_at: float = field(default_factory=time.time)


class RewardError(RuntimeError):
    """Task.reward raised: the example and outputs are in the message (never a silent 0)."""


class Sampler(Protocol):
    """What the trainer needs from an inference engine (see collab_app.commands.train_cmd.EngineSampler)."""

    def sample(self, requests: list[tuple[str, str]], n: int, *, max_new_tokens: int, temperature: float,
               top_p: float, seed: int | None) -> list[list[Any]]:
        """requests = [(agent, prompt)]; result[i][j] = sample j of request i, all in one batched call."""

    def load_adapter(self, agent: str, path: str | None, version: int | None) -> None: ...


# ---------------------------------------------------------------------------------------------
# joint actions, returns, advantages
# ---------------------------------------------------------------------------------------------
def joint_actions(num_generations: int, num_agents: int, mode: str) -> list[tuple[int, ...]]:
    """aligned: [(0,0), (1,1), ...] (G); cross: every combination (G^N)."""
    if mode == "aligned":
        return [(g,) * num_agents for g in range(num_generations)]
    if mode == "cross":
        return list(itertools.product(range(num_generations), repeat=num_agents))
    raise ValueError(f"joint_mode must be 'aligned' or 'cross', got {mode!r}")


def agent_returns(group: Group, agent: int, cross_credit: str = "mean") -> list[float]:
    """(G,) the return credited to each of `agent`'s samples: the mean (or max) of the returns of
    the joint actions it took part in. In aligned mode that is exactly one joint action."""
    G = len(group.samples[agent])
    took_part: list[list[float]] = [[] for _ in range(G)]
    for action, R in zip(group.joint, group.returns):
        took_part[action[agent]].append(R)
    if any(not rs for rs in took_part):
        raise ValueError(f"group {group.example_id}: some sample of agent {agent} is in no joint action")
    pick = max if cross_credit == "max" else statistics.fmean
    return [pick(rs) for rs in took_part]


def advantages(returns: list[float], mode: str = "mean", normalize_std: bool = False,
               eps: float = 1e-4) -> list[float]:
    """(G,) advantages of a group's returns. mean: R - mean(R) (paper); rloo: R - mean of the
    others; max: R - max(R); raw: R. normalize_std divides by the population std + eps."""
    G = len(returns)
    if G < 2:
        raise ValueError("a group needs >= 2 returns: the advantage compares siblings")
    mean = statistics.fmean(returns)
    if mode == "mean":
        adv = [r - mean for r in returns]
    elif mode == "rloo":
        total = sum(returns)
        adv = [r - (total - r) / (G - 1) for r in returns]
    elif mode == "max":
        best = max(returns)
        adv = [r - best for r in returns]
    elif mode == "raw":
        adv = list(returns)
    else:
        raise ValueError(f"advantage_mode must be mean, rloo, max or raw; got {mode!r}")
    if normalize_std:
        std = statistics.pstdev(returns)
        adv = [a / (std + eps) for a in adv]
    return adv


def compute_returns(groups: list[Group], gamma: float) -> None:
    """In place, leaves first: R_t(k) = r_t(k) + gamma * mean(returns of the child group of joint
    action k); a joint action without a child (last turn, early stop) has R_t = r_t.
    Children come after their parents in `groups` (rollout appends turn by turn)."""
    children = {g.parent: i for i, g in enumerate(groups) if g.parent is not None}
    for k in range(len(groups) - 1, -1, -1):
        grp = groups[k]
        grp.returns = [
            r + gamma * statistics.fmean(groups[children[(k, j)]].returns) if (k, j) in children else r
            for j, r in enumerate(grp.rewards)
        ]


# ---------------------------------------------------------------------------------------------
# rollout
# ---------------------------------------------------------------------------------------------
def _score(task, example, outputs: list[str]):
    try:
        return check_reward(task, task.reward(example, outputs))
    except Exception as e:
        shown = " | ".join(o[:200] for o in outputs)
        log.error("%s.reward failed on example %s with outputs: %s", task.name, example.get("id"), shown)
        raise RewardError(f"{task.name}.reward raised on example {example.get('id')!r} "
                          f"({type(e).__name__}: {e}); outputs: {shown!r}") from e


def rollout(engine: Sampler, task, examples: list[dict], cfg: MAGRPOConfig,
            history: list[list[Turn]] | None = None, *, seed: int | None = None,
            timings: dict | None = None) -> list[Group]:
    """Groups for `examples` (a tree when num_turns > 1, parents before children), returns filled.

    Per turn ONE engine call samples G completions for every (node, agent). Every joint action
    of a node spawns a child node at the next turn (history + its outputs and Task.feedback),
    unless the node's mean reward reached early_stop_threshold: the check is per group, not per
    joint action, so siblings always have the same horizon and stay comparable.
    `history[e]`: turns already played for examples[e] (default: none)."""
    timings = timings if timings is not None else {}
    timings.setdefault("rollout_s", 0.0)
    timings.setdefault("reward_s", 0.0)
    N, G, roles = task.num_agents, cfg.num_generations, list(task.roles)
    joint = joint_actions(G, N, cfg.joint_mode)                                   # (J,)
    # a node to expand: (example, history, parent reference)
    nodes = [(ex, list(history[e]) if history else [], None) for e, ex in enumerate(examples)]
    groups: list[Group] = []
    for turn in range(cfg.num_turns):
        if not nodes:
            break
        prompts = [check_prompts(task, task.agent_prompts(ex, h)) for ex, h, _ in nodes]   # (P, N)
        t0 = time.perf_counter()
        out = engine.sample([(roles[a], ps[a]) for ps in prompts for a in range(N)], G,   # (P*N, G)
                            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            top_p=cfg.top_p, seed=None if seed is None else seed + turn)
        timings["rollout_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        samples = [[out[p * N + a] for a in range(N)] for p in range(len(nodes))]   # (P, N, G)
        outputs = [[[s[a][action[a]].text for a in range(N)] for action in joint] for s in samples]  # (P, J, N)
        # Reward calls of the whole turn at once, at most one per core: code rewards spend their
        # time in sandbox subprocesses, so threads overlap them (writing rewards gain nothing).
        with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, len(nodes) * len(joint)))) as pool:
            scored = list(pool.map(lambda e_o: _score(task, *e_o),
                                   [(ex, o) for (ex, _, _), outs in zip(nodes, outputs) for o in outs]))
        children = []
        for p, ((ex, hist, parent), ps) in enumerate(zip(nodes, prompts)):
            rewards = scored[p * len(joint):(p + 1) * len(joint)]                 # (J,)
            grp = Group(task=task.name, example_id=str(ex["id"]), turn=turn, prompts=ps, samples=samples[p],
                        joint=joint, returns=[r.total for r in rewards], rewards=[r.total for r in rewards],
                        levels=[dict(r.levels) for r in rewards], parent=parent)
            groups.append(grp)
            stop = cfg.early_stop_threshold is not None and statistics.fmean(grp.rewards) >= cfg.early_stop_threshold
            if turn + 1 < cfg.num_turns and not stop:
                for k, o in enumerate(outputs[p]):
                    feedback = tuple(task.feedback(ex, o))
                    children.append((ex, hist + [Turn(tuple(o), feedback)], (len(groups) - 1, k)))
        timings["reward_s"] += time.perf_counter() - t0
        nodes = children
    compute_returns(groups, cfg.gamma)
    return groups


# ---------------------------------------------------------------------------------------------
# log-probs
# ---------------------------------------------------------------------------------------------
def sequence_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                      eos_token_ids: set[int] | frozenset[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log pi(completion token t | prompt, tokens < t) for a batch, untempered.

    Returns logp (B, T) and mask (B, T) (1 = real completion token), T = longest completion.
    Sequences are right-padded with an attention mask; anything after a completion's first EOS
    is cut (it is padding); padded positions are 0 in logp. Only completion positions go
    through the LM head (the prompt's logits are never materialised)."""
    if eos_token_ids:
        completion_ids = [next((c[:t + 1] for t, tok in enumerate(c) if tok in eos_token_ids), c)
                          for c in completion_ids]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(base.config, attr, None):
            raise NotImplementedError(f"models with {attr} post-process their logits; sequence_logprobs "
                                      f"applies the LM head directly and would be wrong for them")
    device = next(model.parameters()).device
    B = len(prompt_ids)
    len_p = torch.tensor([len(p) for p in prompt_ids], device=device)             # (B,)
    len_c = torch.tensor([len(c) for c in completion_ids], device=device)         # (B,)
    if B == 0 or int(len_c.min()) < 1 or int(len_p.min()) < 1:
        raise ValueError("sequence_logprobs needs >= 1 sequence, each with a non-empty prompt and completion")
    T, L = int(len_c.max()), int((len_p + len_c).max())
    input_ids = torch.zeros(B, L, dtype=torch.long, device=device)               # (B, L), pad id 0 (masked)
    attention = torch.zeros(B, L, dtype=torch.long, device=device)               # (B, L)
    targets = torch.zeros(B, T, dtype=torch.long, device=device)                 # (B, T)
    for b, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[b, :len(p) + len(c)] = torch.tensor(list(p) + list(c))
        attention[b, :len(p) + len(c)] = 1
        targets[b, :len(c)] = torch.tensor(list(c))
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention).last_hidden_state  # (B, L, H)
    steps = torch.arange(T, device=device)[None, :]                              # (1, T)
    mask = steps < len_c[:, None]                                                # (B, T)
    # completion token t of row b sits at position len_p[b] + t; the hidden state before it predicts it
    pos = torch.where(mask, len_p[:, None] - 1 + steps, 0)                       # (B, T)
    h = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))       # (B, T, H)
    logits = base.get_output_embeddings()(h).float()                             # (B, T, V)
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)   # (B, T)
    return logp * mask, mask.to(logp.dtype)


def _pad(rows: list[list[float]], T: int, device) -> torch.Tensor:
    out = torch.zeros(len(rows), T, device=device)
    for b, r in enumerate(rows):
        out[b, :len(r)] = torch.tensor(r[:T], dtype=torch.float32)
    return out


# ---------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------
class MAGRPOTrainer:
    """Per-agent LoRA adapters on one frozen base; `update(groups)` = one MAGRPO step that also
    writes each changed agent's next adapter version; `train(engine)` loops rollout -> update ->
    hot-load. Resumes from the latest versions in `adapters_dir` when cfg.resume."""

    def __init__(self, cfg: MAGRPOConfig, task, adapters_dir: str):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        if task.num_agents != cfg.num_agents or len(task.roles) != cfg.num_agents:
            raise ValueError(f"task {task.name!r} has {task.num_agents} agents {task.roles}, but num_agents="
                             f"{cfg.num_agents}: pass --num-agents {task.num_agents}")
        if not cfg.model:
            raise ValueError("cfg.model is empty: resolve the model folder first "
                             "(collab_app.engines.model.ensure_model, which `collab train` does)")
        self.cfg, self.task, self.adapters_dir = cfg, task, adapters_dir
        self.agents = list(task.roles)
        torch.manual_seed(cfg.seed)  # the LoRA A matrices, so version 0 is reproducible
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA GPU: use --device cpu (or auto)")
        base = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype)).to(self.device)
        eos = base.generation_config.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos]) - {None}
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_target_modules), task_type="CAUSAL_LM")
        self.model = get_peft_model(base, lora, adapter_name=self.agents[0])
        for agent in self.agents[1:]:
            self.model.add_adapter(agent, lora)
        self.params = {a: [p for n, p in self.model.named_parameters() if "lora_" in n and f".{a}." in n]
                       for a in self.agents}
        self.optimizers = {a: torch.optim.AdamW(self.params[a], lr=cfg.learning_rate, weight_decay=0.0)
                           for a in self.agents}
        self.versions = {a: 0 for a in self.agents}
        self.step = 0
        self._loaded: dict[str, int] = {}  # agent -> version last handed to the engine
        self._init_versions()

    # -- versions on disk ---------------------------------------------------------------------
    def adapter_path(self, agent: str) -> str:
        return store.version_dir(self.adapters_dir, agent, self.versions[agent])

    def _init_versions(self) -> None:
        for a in self.agents:
            for path in store.remove_partial(self.adapters_dir, a):
                log.warning("removed a half-written adapter version left by a crash: %s", path)
        found = {a: store.latest_version(self.adapters_dir, a) for a in self.agents}
        if any(found.values()):
            if not self.cfg.resume:
                raise FileExistsError(f"{self.adapters_dir} already holds adapter versions: pass --resume to "
                                      f"continue from them, or choose a fresh --adapters-dir")
            missing = [a for a, f in found.items() if f is None]
            if missing:
                raise FileNotFoundError(f"{self.adapters_dir} has versions for {sorted(set(found) - set(missing))} "
                                        f"but none for {missing}: it belongs to another team; use a fresh --adapters-dir")
            self._resume(found)
            return
        for a in self.agents:
            self._save(a, {"step": 0, "parent_version": None, "metrics": {}})

    def _resume(self, found: dict[str, tuple[int, str]]) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        for a, (version, path) in found.items():
            set_peft_model_state_dict(self.model, load_file(os.path.join(path, "adapter_model.safetensors")),
                                      adapter_name=a)
            opt = os.path.join(path, store.OPTIMIZER)
            if os.path.exists(opt):
                self.optimizers[a].load_state_dict(torch.load(opt, weights_only=True, map_location=self.device))
            else:
                log.warning("%s has no optimizer state: AdamW moments restart from zero", path)
            self.versions[a] = version
            self.step = max(self.step, int(store.read_meta(path).get("step", 0)))
        log.info("resumed at step %d from versions %s", self.step, self.versions)

    def _save(self, agent: str, meta: dict) -> str:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        def write(tmp: str) -> None:
            state = {k: v.detach().cpu().contiguous() for k, v in
                     get_peft_model_state_dict(self.model, adapter_name=agent).items()}
            save_file(state, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
            self.model.peft_config[agent].save_pretrained(tmp)
            torch.save(self.optimizers[agent].state_dict(), os.path.join(tmp, store.OPTIMIZER))

        meta = {**meta, "base_model": self.cfg.model, "config": asdict(self.cfg)}
        path = store.save_version(self.adapters_dir, agent, self.versions[agent], write, meta)
        store.prune_versions(self.adapters_dir, agent, self.cfg.keep_versions)
        return path

    def load_into(self, engine: Sampler) -> None:
        """Hand every agent's current version to the engine (only those that changed)."""
        for a in self.agents:
            if self._loaded.get(a) != self.versions[a]:
                engine.load_adapter(a, self.adapter_path(a), self.versions[a])
                self._loaded[a] = self.versions[a]

    # -- one MAGRPO step ----------------------------------------------------------------------
    def update(self, groups: list[Group]) -> dict:
        """One step on `groups` (any turns, any origin): drop stale groups, advantages per agent,
        one optimizer step per agent with a learning signal, save its next version. Returns flat
        metrics (JSON-able)."""
        t_start = time.perf_counter()
        cfg = self.cfg
        fresh = [g for g in groups if not self._stale(g)]
        m: dict[str, Any] = {"step": self.step + 1, "groups": len(fresh), "groups_dropped_stale": len(groups) - len(fresh)}
        m.update(group_metrics(fresh, self.task.level_names))
        changed = []
        for i, agent in enumerate(self.agents):
            items = []  # (sample, advantage)
            for g in fresh:
                adv = advantages(agent_returns(g, i, cfg.cross_credit), cfg.advantage_mode, cfg.normalize_std)
                items += list(zip(g.samples[i], adv))
            stats = self._update_agent(agent, items)
            m.update({f"{agent}/{k}": v for k, v in stats.items()})
            if stats["trained_samples"]:
                changed.append(agent)
        self.step += 1
        m["time/update_s"] = time.perf_counter() - t_start
        t0 = time.perf_counter()
        for agent in changed:
            self.versions[agent] += 1
            self._save(agent, {"step": self.step, "parent_version": self.versions[agent] - 1, "metrics": m})
        m["time/save_s"] = time.perf_counter() - t0
        m.update({f"{a}/version": self.versions[a] for a in self.agents})
        return m

    def _stale(self, group: Group) -> bool:
        """True if some agent's samples came from a version more than max_staleness behind
        (None = the base model = version 0, which is what a B=0 version 0 adapter computes)."""
        for i, agent in enumerate(self.agents):
            oldest = min((s.adapter_version or 0) for s in group.samples[i])
            if self.versions[agent] - oldest > self.cfg.max_staleness:
                return True
        return False

    def _update_agent(self, agent: str, items: list[tuple[Any, float]]) -> dict:
        cfg, model = self.cfg, self.model
        n_samples = len(items)
        # A zero advantage contributes nothing to the policy term: skip it unless the KL term needs it.
        live = [(s, a) for s, a in items if a != 0.0 or cfg.kl_coef > 0]
        stats = {"samples": n_samples, "trained_samples": len(live), "loss": 0.0, "clip_frac": 0.0,
                 "kl": 0.0, "ratio_mean": 1.0, "grad_norm": 0.0, "tokens": 0}
        if not live:
            return stats
        model.set_adapter(agent)
        model.train()
        opt = self.optimizers[agent]
        opt.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "kl_tokens": 0.0, "ratio": 0.0, "tokens": 0.0}
        eps = cfg.clip_epsilon
        for start in range(0, len(live), cfg.micro_batch_size):
            batch = live[start:start + cfg.micro_batch_size]
            prompts = [list(s.prompt_token_ids) for s, _ in batch]
            completions = [list(s.token_ids) for s, _ in batch]
            for s, _ in batch:
                if len(s.logprobs) != len(s.token_ids):
                    raise ValueError(f"agent {agent}: a sample has {len(s.token_ids)} tokens but "
                                     f"{len(s.logprobs)} behaviour log-probs; the engine must return one per token")
            logp, mask = sequence_logprobs(model, prompts, completions, self.eos_token_ids)      # (B, T)
            behaviour = _pad([list(s.logprobs) for s, _ in batch], logp.shape[1], logp.device)  # (B, T)
            A = torch.tensor([a for _, a in batch], device=logp.device)[:, None]               # (B, 1)
            ratio = torch.exp((logp - behaviour) * mask)                                        # (B, T)
            surrogate = torch.min(ratio * A, ratio.clamp(1 - eps, 1 + eps) * A)                 # (B, T)
            loss_tok = -surrogate
            # KL to the base (adapter off) costs a third forward pass: every micro-batch when it is
            # in the loss, else only the first one, as a logged estimate.
            if cfg.kl_coef > 0 or start == 0:
                with torch.no_grad(), model.disable_adapter():
                    ref, _ = sequence_logprobs(model, prompts, completions, self.eos_token_ids)  # (B, T)
                d = ref - logp
                kl = torch.exp(d) - d - 1                                                       # (B, T) k3 >= 0
                if cfg.kl_coef > 0:
                    loss_tok = loss_tok + cfg.kl_coef * kl
                with torch.no_grad():
                    sums["kl"] += float((kl * mask).sum())
                    sums["kl_tokens"] += float(mask.sum())
            loss = (loss_tok * mask).sum() / n_samples
            loss.backward()
            with torch.no_grad():
                clipped = ((ratio > 1 + eps) & (A > 0)) | ((ratio < 1 - eps) & (A < 0))
                sums["loss"] += float(loss)
                sums["clipped"] += float((clipped * mask).sum())
                sums["ratio"] += float((ratio * mask).sum())
                sums["tokens"] += float(mask.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params[agent], cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()
        tokens = max(sums["tokens"], 1.0)
        stats.update(loss=sums["loss"], clip_frac=sums["clipped"] / tokens, kl=sums["kl"] / max(sums["kl_tokens"], 1.0),
                     ratio_mean=sums["ratio"] / tokens, grad_norm=float(grad_norm), tokens=int(sums["tokens"]))
        return stats

    # -- offline training ---------------------------------------------------------------------
    def batch(self, examples: list[dict], step: int) -> list[dict]:
        """The prompts of `step`: epochs over the split, each shuffled by (seed, epoch), so a
        resumed run sees the prompts the uninterrupted run would have."""
        out, P, n = [], self.cfg.prompts_per_step, len(examples)
        if n == 0:
            raise ValueError(f"task {self.task.name!r} has no train examples")
        for k in range(step * P, step * P + P):
            epoch, i = divmod(k, n)
            order = list(range(n))
            random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
            out.append(examples[order[i]])
        return out

    def train(self, engine: Sampler, on_step=None) -> list[dict]:
        """rollout -> update -> new versions -> engine.load_adapter, until cfg.num_steps.
        `on_step(metrics)` runs after each step (logging, evaluation). Returns every step's metrics."""
        examples = self.task.examples("train")
        self.load_into(engine)
        history = []
        with tqdm(total=self.cfg.num_steps, initial=self.step, desc="MAGRPO", unit="step", disable=None) as bar:
            while self.step < self.cfg.num_steps:
                timings: dict[str, float] = {}
                groups = rollout(engine, self.task, self.batch(examples, self.step), self.cfg,
                                 seed=self.cfg.seed * 1_000_003 + 7919 * self.step, timings=timings)
                metrics = self.update(groups)
                metrics.update({f"time/{k}": v for k, v in timings.items()})
                self.load_into(engine)
                history.append(metrics)
                bar.set_postfix(ret=f"{metrics['return_mean']:.3f}",
                                v="/".join(str(self.versions[a]) for a in self.agents))
                bar.update(1)
                if on_step:
                    on_step(metrics)
        return history


def group_metrics(groups: list[Group], level_names=()) -> dict[str, float]:
    """Return mean/std and level means over first-turn joint actions, reward std within groups,
    the share of groups whose returns are all equal (advantage 0: no learning signal)."""
    roots = [g for g in groups if g.parent is None] or groups
    returns = [R for g in roots for R in g.returns]
    m: dict[str, float] = {
        "return_mean": statistics.fmean(returns) if returns else math.nan,
        "return_std": statistics.pstdev(returns) if returns else math.nan,
        "group_return_std": statistics.fmean(statistics.pstdev(g.returns) for g in groups) if groups else math.nan,
        "zero_variance_frac": (sum(max(g.returns) - min(g.returns) < 1e-9 for g in groups) / len(groups))
        if groups else math.nan,
    }
    for name in level_names:
        vals = [lv[name] for g in roots for lv in g.levels if name in lv]
        m[f"level/{name}"] = statistics.fmean(vals) if vals else math.nan
    turns = sorted({g.turn for g in groups})
    if len(turns) > 1:
        for t in turns:
            m[f"turn{t}/reward_mean"] = statistics.fmean(r for g in groups if g.turn == t for r in g.rewards)
    return m
