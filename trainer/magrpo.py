"""MAGRPO (Liu et al., arXiv 2508.04652) on one LoRA adapter per agent, top to bottom:

    rollout   each agent samples G completions per prompt (one batched engine call), joint
              actions (aligned: G; cross: G^N), team reward per joint action, multi-turn tree
    returns   R_t = r_t + gamma * mean(returns of the child group)            (compute_returns)
    advantage A = R - mean R (paper); rloo / max / raw; optional / std        (advantages)
    loss      per agent: -sum_t min(rho_t A, clip(rho_t, 1-eps, 1+eps) A) over the completion's
              real tokens, rho_t = pi_new / pi_behaviour, pi the policy's softmax(logits / T) at
              the sample's own temperature; on-policy samples take the trainer's own log-probs
              as behaviour (rho = 1: the paper's -A * log pi_T(a|h)), the clip bites on late data
    step      one AdamW step per agent on its own adapter, then a new adapter version on disk

Policies: a peft LoRA adapter per agent on a frozen base, one optimizer per agent. A homogeneous
team has ONE base holding every adapter (`set_adapter` switches); a heterogeneous team
(cfg.agent_models) keeps one frozen base per distinct model (`model_of[agent]`, `eos_of[agent]`).
Samples carry their engine's prompt token ids, so the trainer needs no tokenizer.

Late data: every sample keeps its adapter version, sampling and behaviour log-probs; samples the
trainer cannot reproduce (greedy, top_p < 1) are refused (`refused_groups`), off-policy ones go
through the clipped ratio (and a dual clip for A < 0), and only a group that waited while an
agent wrote more than `max_staleness` versions is dropped. `update()` returns the metrics and
which groups were used, dropped and refused. The update shares each prompt's forward across its
siblings and packs completions of similar length (`length_passes`).
`MAGRPOTrainer.train` (trainer/offline.py) adds a time budget, a learning-rate schedule and
dynamic sampling around the loop. Data parallel under torchrun: trainer/distributed.py (without
it the `distributed.*` calls do nothing). Where a trainer starts and how it saves a version:
trainer/adapter_state.py. Knows nothing of collab_app: the engine reaches rollout through the
`Sampler` protocol below. Each rule and its reason: docs/ARCHITECTURE.md "MAGRPO as implemented".
Shapes in comments: B sequences, T completion tokens, G group size, J joint actions.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from tasks.base import Turn, check_prompts, check_reward
from trainer import adapter_state
from trainer import adapters as versions_on_disk
from trainer import distributed
from trainer.config import ADVANTAGE_MODES, JOINT_MODES, StepConfig
from trainer.dtypes import gqa_attention, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
@dataclass
class Group:
    """One prompt (one node of the rollout tree) with its G samples per agent and joint actions.
    Samples are Sample-like: .text, .token_ids, .logprobs, .prompt_token_ids, .adapter_version,
    .meta["sampling"] (see `sampling_of`)."""

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
    created_at: float = field(default_factory=time.time)   # unix time the group (its returns) arrived
    id: Any = None                               # the caller's id (the store's group id), echoed by update()
    arrived_versions: dict[str, int] | None = None   # agent -> its newest version when the group arrived
                                                     # (lateness in versions); None: by created_at


@dataclass
class TrainerHooks:
    """What the process around a trainer does between the pieces of a step (each decoder layer's
    forward and backward, a micro-batch, an agent). All optional; `collab trainer` sets them."""

    pause: Callable[[], float] | None = None
    """called at each pause point; returns the seconds it paused (the service's core lease: a
    person's round waiting on this process's cores gets them, within a budget)."""
    stop_requested: Callable[[], bool] | None = None
    """checked at the same points, before `pause`: True abandons the step (StepStopped), so a
    SIGTERM ends a step within one layer's time and the step's groups stay ready."""
    pieces_done: Callable[[], None] | None = None
    """called once a step's compute is over, before it saves: cores borrowed at the pause points
    go back, so a round that starts during the save does not wait for it."""


class StepStopped(Exception):
    """update() was told to stop (TrainerHooks.stop_requested) at one of its pause points: the step
    was abandoned before anything was saved. No version moved on disk; this process's in-memory
    adapters may be half-stepped, so a caller that goes on must rebuild the trainer from disk."""


class RewardError(RuntimeError):
    """Task.reward raised: the example and outputs are in the message (never a silent 0)."""


class Sampler(Protocol):
    """What the trainer needs from an inference engine (see collab_app.engines.sampler.EngineSampler)."""

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
    raise ValueError(f"joint_mode must be one of {', '.join(JOINT_MODES)}; got {mode!r}")


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


ADV_TOL = 1e-4
"""Returns closer than ADV_TOL * max(1, |R|max) count as equal. AdamW's step hardly depends on the
gradient's size (m / sqrt(v)), so a spread of float leftovers (1e-16) or of noise (1e-6) would
move the adapter as much as a real signal and write a version; every signal a task's levels or a
rating (1/8 of the return's scale per star) express is far above 1e-4 of the scale."""


def advantages(returns: list[float], mode: str = "mean", normalize_std: bool = False,
               eps: float = 1e-4) -> list[float]:
    """(G,) advantages of a group's returns. mean: R - mean(R) (paper); rloo: R - mean of the
    others; max: R - max(R); raw: R. normalize_std divides by the population std + eps.
    A zero-variance group (returns equal within ADV_TOL) has advantage exactly 0 in the
    sibling-relative modes, and is not divided by its (zero) std in any mode: raw R / 1e-4
    would be a 10^4-fold step."""
    G = len(returns)
    if G < 2:
        raise ValueError("a group needs >= 2 returns: the advantage compares siblings")
    flat = is_flat(returns)
    if flat and mode != "raw":
        return [0.0] * G
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
        raise ValueError(f"advantage_mode must be one of {', '.join(ADVANTAGE_MODES)}; got {mode!r}")
    if normalize_std and not flat:
        std = statistics.pstdev(returns)
        adv = [a / (std + eps) for a in adv]
    return adv


def is_flat(returns: list[float]) -> bool:
    """All returns equal within ADV_TOL: the group's advantages are 0 (no learning signal)."""
    return max(returns) - min(returns) <= ADV_TOL * max(1.0, max(abs(r) for r in returns))


def split_trees(groups: list[Group]) -> list[list[Group]]:
    """The rollout's groups per prompt: each first-turn group with its descendants, in order
    (parents before children), parent references re-based to the tree's own list."""
    trees: list[list[Group]] = []
    where: dict[int, tuple[int, int]] = {}            # index in groups -> (tree, index in tree)
    for i, g in enumerate(groups):
        if g.parent is None:
            trees.append([])
            t = len(trees) - 1
        else:
            t, j = where[g.parent[0]]
            g.parent = (j, g.parent[1])
        where[i] = (t, len(trees[t]))
        trees[t].append(g)
    return trees


def join_trees(trees: list[list[Group]]) -> list[Group]:
    """Inverse of split_trees: one list, parent references shifted to it. Any lists of whole
    trees whose parent references are local to their list (a rank's rollout: gather_groups)."""
    out: list[Group] = []
    for tree in trees:
        offset = len(out)
        for g in tree:
            if g.parent is not None:
                g.parent = (g.parent[0] + offset, g.parent[1])
            out.append(g)
    return out


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


def gather_groups(groups: list[Group]) -> list[Group]:
    """Data parallel: every rank's rolled-out groups on every rank, rank 0's first (world size 1:
    `groups` itself). Parent references are shifted to the gathered list's indices."""
    if distributed.world_size() == 1:
        return groups
    return join_trees(distributed.all_gather_objects(groups))


def sample_weights(groups: list[Group]) -> list[float]:
    """(groups,) the loss weight of one sample of each group: every generation of the step's
    rollout trees weighs the same, its samples alike: 1 / (generations * samples of its generation).

    A group's generation is its depth in the step: 0 without a parent among `groups`, else its
    parent's + 1. A tree fans out (every joint action of a group has a child group), so weighing
    every sample alike would dilute turn 1 to 1/(1+J) of the loss; per generation, every turn of
    an offline rollout weighs the same (comlrl updates turn by turn), early-stopped roots counted
    with their turn. Online groups arrive one by one, whatever their turn (a later turn's history
    was played and its parent trained apart): all generation 0, so every sample weighs
    1 / samples in the step. Counted by turn instead, the mix of a step's turns set the weights:
    one turn-2 group among 7 turn-1 groups weighed 7x per sample."""
    def depth(g: Group) -> int:
        return 0 if g.parent is None else 1 + depth(groups[g.parent[0]])

    depths = [depth(g) for g in groups]                                          # (groups,)
    per_depth: dict[int, int] = {}
    for g, d in zip(groups, depths):
        per_depth[d] = per_depth.get(d, 0) + len(g.samples[0])
    return [1.0 / (len(per_depth) * per_depth[d]) for d in depths]


# ---------------------------------------------------------------------------------------------
# rollout
# ---------------------------------------------------------------------------------------------
def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (a container's cpuset, `collab serve`'s core
    split for its trainer child), os.cpu_count() where the OS has no affinity API (macOS, Windows).
    collab_app/cpu's cpu_budget also applies a cgroup CPU quota, but trainer/ must not
    import collab_app (collab_app imports trainer)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _score(task, example, outputs: list[str]):
    try:
        return check_reward(task, task.reward(example, outputs))
    except Exception as e:
        shown = " | ".join(o[:200] for o in outputs)
        log.error("%s.reward failed on example %s with outputs: %s", task.name, example.get("id"), shown)
        raise RewardError(f"{task.name}.reward raised on example {example.get('id')!r} "
                          f"({type(e).__name__}: {e}); outputs: {shown!r}") from e


def rollout(engine: Sampler, task, examples: list[dict], cfg: StepConfig,
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
        # Cores are usable_cpus(), not os.cpu_count(): in a container or a core split that counts the host's.
        with ThreadPoolExecutor(max(1, min(usable_cpus(), len(nodes) * len(joint)))) as pool:
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
def sampling_of(sample, cfg: StepConfig) -> tuple[float, float, bool]:
    """(temperature, top_p, recorded) of the distribution that drew `sample`: its
    meta["sampling"], which the engines record; a sample stored before they did (recorded False)
    is taken to be of the trainer's own settings, cfg.temperature and cfg.top_p."""
    rec = (getattr(sample, "meta", None) or {}).get("sampling")
    if rec is None:
        return cfg.temperature, cfg.top_p, False
    return float(rec["temperature"]), float(rec.get("top_p", 1.0)), True


def unreproducible(temperature: float, top_p: float) -> str | None:
    """Why the trainer cannot compute the log-probs of a distribution sampled so (None: it can)."""
    if temperature <= 0:
        return "sampled greedily (temperature 0): no sampling distribution to take log-probs and a ratio of"
    if top_p < 1:
        return (f"sampled with top_p {top_p} < 1: the trainer's log-probs cannot reproduce the nucleus "
                f"truncation (sample with top_p 1 to train on it)")
    return None


def sequence_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                      eos_token_ids: set[int] | frozenset[int] = frozenset(),
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log pi_T(completion token t | prompt, tokens < t) for a batch: log softmax
    of the logits / temperature, the distribution a sample at that temperature was drawn from.

    Returns logp (B, T) and mask (B, T) (1 = real completion token), T = longest completion.
    Sequences are right-padded with an attention mask; anything after a completion's first EOS
    is cut (it is padding); padded positions are 0 in logp. Only completion positions go
    through the LM head (the prompt's logits are never materialised). When every row has the
    same prompt (the G siblings of a group) the prompt goes through the decoder once and its KV
    cache is shared by the rows (gradients flow back through it): prompts are most of the
    positions (HumanEval: 180-370 prompt tokens per <= 128 completion tokens)."""
    if not temperature > 0:
        raise ValueError(f"sequence_logprobs needs a temperature > 0, got {temperature}")
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
    if B > 1 and all(list(p) == list(prompt_ids[0]) for p in prompt_ids[1:]):
        hidden = _shared_prompt_hidden(base.get_decoder(), list(prompt_ids[0]), completion_ids, T, device)  # (B, T, H)
        steps = torch.arange(T, device=device)[None, :]                          # (1, T)
        mask = steps < len_c[:, None]                                            # (B, T)
        return _completion_logprobs(base, hidden, completion_ids, mask, T, device, temperature)
    input_ids = torch.zeros(B, L, dtype=torch.long, device=device)               # (B, L), pad id 0 (masked)
    attention = torch.zeros(B, L, dtype=torch.long, device=device)               # (B, L)
    for b, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[b, :len(p) + len(c)] = torch.tensor(list(p) + list(c))
        attention[b, :len(p) + len(c)] = 1
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention).last_hidden_state  # (B, L, H)
    steps = torch.arange(T, device=device)[None, :]                              # (1, T)
    mask = steps < len_c[:, None]                                                # (B, T)
    # completion token t of row b sits at position len_p[b] + t; the hidden state before it predicts it
    pos = torch.where(mask, len_p[:, None] - 1 + steps, 0)                       # (B, T)
    h = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))       # (B, T, H)
    return _completion_logprobs(base, h, completion_ids, mask, T, device, temperature)


PASS_COST = 8
"""A decoder pass's own cost, in positions, for `length_passes`: one more pass over a prompt's rows
is worth it when it saves more padded positions than this. A position of the embedded model is ~0.8
GFLOP forward and backward (~14 ms on one AVX2 core at the 58 GFLOP/s an update's GEMMs ran at);
8 of them (~0.1 s) stand for a pass's per-layer overheads and its cache copy, not measured apart."""


def length_passes(lengths: list[int], pass_cost: int = PASS_COST) -> list[list[int]]:
    """Row indices in passes of similar length: sorted longest first and cut where a pass's rows
    padded to its longest cost least (positions + pass_cost per pass; the optimal contiguous cuts,
    B^2 work for a group's B <= 32 rows). A row padded to the longest completion costs as much as a
    full one, and completions differ most once a team has learned to stop (EOS)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    L = [lengths[i] for i in order]
    best, cut = [0.0] + [math.inf] * len(L), [0] * (len(L) + 1)   # best[j]: cost of rows order[:j]
    for j in range(1, len(L) + 1):
        for i in range(j):                                # the last pass: order[i:j], padded to L[i]
            cost = best[i] + (j - i) * L[i] + pass_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    passes, j = [], len(L)
    while j:
        passes.append(order[cut[j]:j])
        j = cut[j]
    return passes[::-1]


def _shared_prompt_hidden(decoder, prompt: list[int], completion_ids, T: int, device) -> torch.Tensor:
    """(B, T, H) hidden states that predict each completion token (zeros past a row's end), the
    prompt run once: prompt (1, P) -> its KV cache, repeated for each pass's rows -> the pass's
    completion tokens 0..T_p-2 on top. Rows go in passes of similar length (`length_passes`)."""
    P, B = len(prompt), len(completion_ids)
    pre = decoder(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    h_last = pre.last_hidden_state[:, -1:]                                       # (1, 1, H) predicts token 0
    passes = length_passes([len(c) for c in completion_ids])
    if not hasattr(pre.past_key_values, "layers"):   # a cache this code cannot copy: one pass, padded
        passes = [sorted(i for p in passes for i in p)]
    parts, order = [], []
    for k, rows in enumerate(passes):
        n, T_p = len(rows), max(len(completion_ids[b]) for b in rows)
        h = h_last.expand(n, 1, -1)                                              # (n, 1, H)
        if T_p > 1:
            cache = pre.past_key_values
            if k < len(passes) - 1:   # the pass appends to its cache: the others get copies of the prompt's
                cache = _copy_cache(cache)
            cache.batch_repeat_interleave(n)                                     # (n, heads, P, d) per layer
            tokens = torch.zeros(n, T_p - 1, dtype=torch.long, device=device)   # (n, T_p-1), pad id 0 (masked)
            attention = torch.zeros(n, P + T_p - 1, dtype=torch.long, device=device)   # (n, P+T_p-1)
            attention[:, :P] = 1
            for r, b in enumerate(rows):
                m = min(len(completion_ids[b]), T_p - 1)
                tokens[r, :m] = torch.tensor(list(completion_ids[b][:m]))
                attention[r, P:P + m] = 1
            positions = torch.arange(P, P + T_p - 1, device=device)[None].expand(n, -1)   # (n, T_p-1)
            out = decoder(input_ids=tokens, attention_mask=attention, position_ids=positions,
                          past_key_values=cache, use_cache=True)
            h = torch.cat([h, out.last_hidden_state], 1)                         # (n, T_p, H)
        parts.append(torch.nn.functional.pad(h, (0, 0, 0, T - T_p)))             # (n, T, H)
        order += rows
    hidden = torch.cat(parts, 0)                                                 # (B, T, H), rows in pass order
    return hidden[torch.tensor(order, device=device).argsort()]                  # (B, T, H), rows as given


def _copy_cache(cache):
    """A copy of a transformers DynamicCache whose layers can be repeated and appended to without
    touching the original's (the tensors are shared until then: both ops make new ones)."""
    new = copy.copy(cache)
    new.layers = [copy.copy(layer) for layer in cache.layers]
    return new


def _completion_logprobs(base, h, completion_ids, mask, T: int, device,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log-probs of the completion tokens from the hidden states h (B, T, H) that predict
    them, at `temperature` (the logits divided by it). Only the real positions go through the LM
    head (a row padded to T would pay for its padding there too: (positions, V) logits)."""
    targets = torch.zeros(len(completion_ids), T, dtype=torch.long, device=device)   # (B, T)
    for b, c in enumerate(completion_ids):
        targets[b, :len(c)] = torch.tensor(list(c))
    logits = base.get_output_embeddings()(h[mask]).float()                       # (N, V), N real positions
    if temperature != 1.0:
        logits = logits / temperature                                            # (N, V) tempered
    real = logits.gather(-1, targets[mask][:, None]).squeeze(-1) - torch.logsumexp(logits, -1)   # (N,)
    logp = real.new_zeros(mask.shape)                                            # (B, T)
    logp[mask] = real
    return logp, mask.to(logp.dtype)


def _pad(rows: list[list[float]], T: int, device) -> torch.Tensor:
    out = torch.zeros(len(rows), T, device=device)
    for b, r in enumerate(rows):
        out[b, :len(r)] = torch.tensor(r[:T], dtype=torch.float32)
    return out


DUAL_CLIP = 3.0
"""For A < 0 the PPO min does not bound a large ratio (late data from a far-off version): the loss
of such a token is capped at -DUAL_CLIP * A (dual-clip PPO, Ye et al. 2020)."""
KL_ESTIMATE_ROWS = 2
"""With kl_coef = 0 the KL to the base is only logged: estimated on this many sequences per agent."""


def magrpo_loss(logp: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                mask: torch.Tensor, clip_epsilon: float, ref_logp: torch.Tensor | None = None,
                kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch of one agent's loss: the clipped surrogate of every completion token,
    weighted, summed (the step's gradient is the sum over its micro-batches and ranks).

        ratio   = exp(logp - behaviour)                                  (B, T) per token
        surr    = min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)       PPO clip
        surr    = max(surr, DUAL_CLIP * A)  where A < 0                  dual clip
        loss    = sum over tokens of W * (-surr + kl_coef * KL)           KL = k3 to the base, if given

    logp (B, T) the policy's log-probs (with grad); behaviour (B, T) those of the policy that
    sampled (no grad); advantages A (B, 1), sample weights W (B, 1); mask (B, T) the completion's
    tokens; ref_logp (B, T) the base model's, for the KL term (k3 = e^d - d - 1 >= 0, d = ref -
    logp). Returns (loss, per-token tensors for the logs: ratio, clipped, kl (None without it))."""
    A, W, eps = advantages, weights, clip_epsilon
    ratio = torch.exp((logp - behaviour) * mask)                                           # (B, T)
    surrogate = torch.min(ratio * A, ratio.clamp(1 - eps, 1 + eps) * A)                    # (B, T)
    surrogate = torch.where(A < 0, torch.max(surrogate, DUAL_CLIP * A), surrogate)        # (B, T)
    loss_tok = -surrogate                                                                  # (B, T)
    kl = None
    if ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1                                                          # (B, T)
        loss_tok = loss_tok + kl_coef * kl
    loss = (loss_tok * mask * W).sum()
    with torch.no_grad():
        clipped = (((ratio > 1 + eps) & (A > 0)) | ((ratio < 1 - eps) & (A < 0))) * mask   # (B, T)
    return loss, {"ratio": ratio.detach(), "clipped": clipped, "kl": None if kl is None else kl.detach()}


def adapter_parameters(model, agent: str) -> list[torch.nn.Parameter]:
    """The LoRA parameters of adapter `agent`, read from peft's per-adapter dicts (lora_A[agent],
    ...), never from parameter-name substrings (an agent named "a" would match "lora_A.a1")."""
    from peft.tuners.lora import LoraLayer

    params = []
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for table in (module.lora_A, module.lora_B):
                if agent in table:
                    params += list(table[agent].parameters())
            for table in (module.lora_embedding_A, module.lora_embedding_B):
                if agent in table:
                    params.append(table[agent])
    if not params:
        raise ValueError(f"the model has no LoRA adapter named {agent!r}")
    return params


# ---------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------
class MAGRPOTrainer:
    """Per-agent LoRA adapters, each on its agent's frozen base (one base per distinct model:
    `model_of[agent]`, `eos_of[agent]`); `update(groups)` = one MAGRPO step that also
    writes each changed agent's next adapter version; `train(engine)` loops rollout -> update ->
    hot-load. Resumes from the latest versions in `adapters_dir` when cfg.resume."""

    def __init__(self, cfg: StepConfig, task, adapters_dir: str):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        if task.num_agents != cfg.num_agents or len(task.roles) != cfg.num_agents:
            raise ValueError(f"task {task.name!r} has {task.num_agents} agents {task.roles}, but num_agents="
                             f"{cfg.num_agents}: pass --num-agents {task.num_agents}")
        if not cfg.model:
            raise ValueError("cfg.model is empty: resolve the model folder first "
                             "(collab_app.engines.model.ensure_model, which `collab train` does)")
        if distributed.rank() > 0:
            # data parallel: rank 0 alone publishes versions; this rank keeps its copies (the same
            # weights) in a private dir, where its own rollout engine loads them (`collab train`)
            adapters_dir = distributed.scratch_dir("adapters")
        self.cfg, self.task, self.adapters_dir = cfg, task, adapters_dir
        self.agents = list(task.roles)
        torch.manual_seed(cfg.seed)  # the LoRA A matrices, so version 0 is reproducible
        self.device = resolve_device(cfg.device)   # auto: cuda > mps > cpu; a device torch lacks is refused with the fix
        self.dtype = resolve_dtype(cfg.dtype, self.device)  # "auto" -> bf16 only where the hardware has it natively

        def lora():   # a fresh config per adapter: peft writes the adapter's base into it
            return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                              target_modules=list(cfg.lora_target_modules), task_type="CAUSAL_LM")

        # One frozen base per distinct model, the adapters of the agents on it inside its PeftModel
        # (a homogeneous team: one base, one PeftModel holding every adapter).
        self.base_of = dict(zip(self.agents, cfg.models_for(self.agents)))   # agent -> base model (path / HF id)
        self.models: dict[str, Any] = {}          # base model -> PeftModel with its agents' adapters
        self.model_of: dict[str, Any] = {}        # agent -> the PeftModel that holds its adapter
        self.eos_of: dict[str, frozenset[int]] = {}   # agent -> its base's EOS token ids
        for agent in self.agents:
            name = self.base_of[agent]
            if name not in self.models:
                base = AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, self.dtype)).to(self.device)
                gqa_attention(base, self.device)   # on a CPU: masked attention without copied key/value heads
                try:
                    self.models[name] = get_peft_model(base, lora(), adapter_name=agent)
                except ValueError as e:   # peft: "Target modules {...} not found in the base model"
                    raise ValueError(f"agent {agent!r} on base {name}: {e}; pick --lora-target-modules that "
                                     f"every agent's base has (q_proj k_proj v_proj o_proj: Llama, Qwen2, Mistral)") from e
            else:
                self.models[name].add_adapter(agent, lora())
            self.model_of[agent] = self.models[name]
            eos = self.models[name].get_base_model().generation_config.eos_token_id
            self.eos_of[agent] = frozenset(eos if isinstance(eos, list) else [eos]) - {None}
        self.model = self.model_of[self.agents[0]]              # the first agent's (a homogeneous team's only) model
        self.eos_token_ids = self.eos_of[self.agents[0]]
        self.params = {a: adapter_parameters(self.model_of[a], a) for a in self.agents}
        self.optimizers = {a: torch.optim.AdamW(self.params[a], lr=cfg.learning_rate, weight_decay=0.0)
                           for a in self.agents}
        self.versions = {a: 0 for a in self.agents}
        self.saved_at: dict[str, list[float]] = {a: [] for a in self.agents}  # unix times of versions > 0 (lateness)
        self.step = 0
        self.train_seconds = 0.0   # rollout + update wall time of `train` so far (offline.out_of_time, lr_schedule)
        self._step_t0: float | None = None   # perf_counter at the start of train()'s current step
        self._loaded: dict[str, int] = {}  # agent -> version last handed to the engine
        self.hooks = TrainerHooks()   # what the process around it does between a step's pieces
        self._paused_s = 0.0   # seconds the current update() has paused (metric time/paused_s)
        adapter_state.start(self)   # resume from adapters_dir, or version 0; ranks > 0 from rank 0

    # -- versions on disk ---------------------------------------------------------------------
    def adapter_path(self, agent: str) -> str:
        return versions_on_disk.version_dir(self.adapters_dir, agent, self.versions[agent])

    def save_version(self, agent: str, meta: dict) -> str:
        """Save `agent`'s adapter and optimizer as its current version number (adapter_state.save)."""
        return adapter_state.save(self.model_of[agent], self.optimizers[agent], self.cfg, self.adapters_dir, agent,
                                  self.versions[agent], {**meta, "base_model": self.base_of[agent]})

    def load_into(self, engine: Sampler) -> None:
        """Hand every agent's current version to the engine (only those that changed)."""
        for a in self.agents:
            if self._loaded.get(a) != self.versions[a]:
                engine.load_adapter(a, self.adapter_path(a), self.versions[a])
                self._loaded[a] = self.versions[a]

    # -- one MAGRPO step ----------------------------------------------------------------------
    def update(self, groups: list[Group]) -> dict:
        """One step on `groups` (any turns, any origin): refuse groups whose sampling the
        trainer cannot reproduce, drop groups that waited too long, advantages per agent, one
        optimizer step per agent with a learning signal, save its next version. Returns flat
        metrics (JSON-able) plus `group_ids` (the ids of the groups that went into the step: the
        caller marks these trained), `stale_group_ids` (dropped: the caller must retire them,
        retrying cannot help) and `refused_groups` ({id: reason in words}: greedy or top_p < 1
        samples; never trainable either). The saved versions' metrics hold the same three. A
        zero-advantage group counts as used: its gradient is exactly 0 and would be 0 on every retry."""
        t_start = time.perf_counter()
        self._paused_s = 0.0
        cfg = self.cfg
        why = {id(g): self.refusal(g) for g in groups}
        refused = [g for g in groups if why[id(g)] is not None]
        kept = [g for g in groups if why[id(g)] is None]
        used = [g for g in kept if self.lateness(g) <= cfg.max_staleness]
        stale = [g for g in kept if self.lateness(g) > cfg.max_staleness]
        late = [g for g in used if any(not self._on_policy(a, s) for i, a in enumerate(self.agents)
                                       for s in g.samples[i])]
        m: dict[str, Any] = {"step": self.step + 1, "groups": len(used), "groups_dropped_stale": len(stale),
                             "groups_refused": len(refused), "late_groups": len(late),
                             "ranks": distributed.world_size(),
                             # samples stored before the engines recorded their sampling: taken at cfg's
                             "sampling_unrecorded": sum(not sampling_of(s, cfg)[2] for g in used
                                                        for row in g.samples for s in row)}
        m.update(group_metrics(used, self.task.level_names))
        # before the saves: each saved version's metrics name the step's groups (a caller that
        # crashed between the save and its own record can tell the step happened)
        m["group_ids"] = [g.id for g in used]
        m["stale_group_ids"] = [g.id for g in stale]
        m["refused_groups"] = {g.id: why[id(g)] for g in refused}
        weights = sample_weights(used)                                               # (groups,)
        changed = []
        for i, agent in enumerate(self.agents):
            items = []  # (sample, advantage, loss weight)
            for g, w in zip(used, weights):
                adv = advantages(agent_returns(g, i, cfg.cross_credit), cfg.advantage_mode, cfg.normalize_std)
                items += [(s, a, w) for s, a in zip(g.samples[i], adv)]
            with self._layer_pauses():
                stats = self._update_agent(agent, items)
            m.update({f"{agent}/{k}": v for k, v in stats.items()})
            if stats["trained_samples"]:
                changed.append(agent)
            self._pause()
        if self.hooks.pieces_done is not None:
            self.hooks.pieces_done()
        self.step += 1
        m["time/update_s"] = time.perf_counter() - t_start   # pauses included: they are in time/paused_s
        m["time/paused_s"] = self._paused_s
        if self._step_t0 is not None:   # inside train(): saved with the versions, so a resumed run keeps its clock
            m["train_seconds"] = self.train_seconds + time.perf_counter() - self._step_t0
        t0 = time.perf_counter()
        for agent in changed:
            self.versions[agent] += 1
            self.save_version(agent, {"step": self.step, "parent_version": self.versions[agent] - 1, "metrics": m})
        saved_at = distributed.broadcast_object(time.time())   # rank 0's clock: lateness must agree on every rank
        for agent in changed:
            self.saved_at[agent].append(saved_at)
        m["time/save_s"] = time.perf_counter() - t0
        m.update({f"{a}/version": self.versions[a] for a in self.agents})
        return m

    def _pause(self) -> None:
        # every call sits before the step's saves (update): raising here leaves the disk untouched
        if self.hooks.stop_requested is not None and self.hooks.stop_requested():
            # no step number: the service numbers its steps over all tasks, this trainer over its own
            raise StepStopped("the step under way stopped at a pause point; nothing of it was saved")
        if self.hooks.pause is not None:
            self._paused_s += self.hooks.pause()

    @contextlib.contextmanager
    def _layer_pauses(self):
        """While update() runs with a pause hook: a pause point after every decoder layer's forward
        and, through a hook on the layer's output, after its backward too. A person's round that
        starts mid-step then waits for one layer (~10-60 ms for the embedded model on 2 CPU cores), not
        for a whole micro-batch's forward or backward (~1-1.5 s). The layers are those the model
        names as its unsplittable blocks (transformers' `_no_split_modules`); a model naming none
        keeps the coarse points only. Hooks go at the end: nothing outside update() pauses. A stop
        hook alone (stop_requested) installs the same points: a stop is seen within one layer."""
        handles = []
        if self.hooks.pause is not None or self.hooks.stop_requested is not None:
            def after_layer(module, args, output):
                self._pause()
                hidden = output[0] if isinstance(output, tuple) else output
                if torch.is_tensor(hidden) and hidden.requires_grad:
                    hidden.register_hook(lambda grad: self._pause())   # backward reaches this layer's output: between two layers
            for model in {id(m): m for m in self.model_of.values()}.values():
                blocks = set(getattr(model, "_no_split_modules", None) or ())
                handles += [mod.register_forward_hook(after_layer) for mod in model.modules()
                            if type(mod).__name__ in blocks]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def lateness(self, group: Group) -> int:
        """Versions some agent wrote after the group arrived, the most over agents. Counted from
        arrival, not from the generating version: a pinned old version serving fresh groups gives
        lateness 0 (those samples are off-policy; the ratio handles it). With
        group.arrived_versions (the caller's record of each agent's newest version then): this
        trainer's version minus that one (an agent it does not name had no version recorded yet:
        version 0, the base); no clock is read.
        Without (offline rollouts): the versions saved after group.created_at, one process's clock."""
        if group.arrived_versions is not None:
            return max(0, max(self.versions[a] - int(group.arrived_versions.get(a, 0))
                              for a in self.agents))
        return max(sum(t > group.created_at for t in self.saved_at[a]) for a in self.agents)

    def refusal(self, group: Group) -> str | None:
        """Why the group cannot be trained on exactly (`unreproducible`, naming the first agent
        whose sample shows it), or None."""
        for i, agent in enumerate(self.agents):
            for s in group.samples[i]:
                reason = unreproducible(*sampling_of(s, self.cfg)[:2])
                if reason is not None:
                    return f"agent {agent}: {reason}"
        return None

    def _on_policy(self, agent: str, sample) -> bool:
        """Generated by the version the trainer holds now (None = the base model = version 0)."""
        return (sample.adapter_version or 0) == self.versions[agent]

    def _update_agent(self, agent: str, items: list[tuple[Any, float, float]]) -> dict:
        """Forward + backward over `items` = (sample, advantage, loss weight) in micro-batches,
        then one AdamW step on `agent`'s adapter. Returns the agent's metrics."""
        cfg, model, eos = self.cfg, self.model_of[agent], self.eos_of[agent]   # the agent's own base and adapter
        # A zero advantage contributes nothing to the policy term: skip it unless the KL term needs it.
        live = [(s, a, w) for s, a, w in items if abs(a) > ADV_TOL or cfg.kl_coef > 0]
        stats = {"samples": len(items), "trained_samples": len(live), "loss": 0.0, "clip_frac": 0.0,
                 "kl": 0.0, "ratio_mean": 1.0, "grad_norm": 0.0, "tokens": 0, "late_samples": 0,
                 "late_ratio_mean": math.nan, "late_ratio_min": math.nan, "late_ratio_max": math.nan,
                 "late_clip_frac": math.nan, "engine_logprob_gap": math.nan}
        if not live:
            return stats
        for s, _, _ in live:
            if len(s.logprobs) != len(s.token_ids):
                raise ValueError(f"agent {agent}: a sample has {len(s.token_ids)} tokens but "
                                 f"{len(s.logprobs)} behaviour log-probs; the engine must return one per token")
        # a micro-batch holds one prompt's samples (the siblings of a group) drawn at one
        # temperature: the prompt then goes through the decoder once (sequence_logprobs), and the
        # logits are divided by the temperature that sampled; longest first, so padding stays small
        by_prompt: dict[tuple, list] = {}
        for item in sorted(live, key=lambda x: -len(x[0].token_ids)):
            temperature = sampling_of(item[0], cfg)[0]
            by_prompt.setdefault((tuple(item[0].prompt_token_ids), temperature), []).append(item)
        batches = [(temp, rows[k:k + cfg.micro_batch_size]) for (_, temp), rows in by_prompt.items()
                   for k in range(0, len(rows), cfg.micro_batch_size)]
        model.set_adapter(agent)
        model.train()
        opt = self.optimizers[agent]
        opt.zero_grad(set_to_none=True)
        sums = dict.fromkeys(("loss", "clipped", "kl", "kl_tokens", "ratio", "tokens", "late_ratio", "late_clipped",
                              "late_tokens", "gap", "gap_tokens"), 0.0)
        late_min, late_max = math.inf, -math.inf
        # data parallel: this rank's share of the micro-batches, numbered over the whole step (so
        # micro-batch 0, which also logs the KL estimate, is rank 0's); world size 1: all of them
        for start, (temp, batch) in distributed.shard(list(enumerate(batches))):
            prompts = [list(s.prompt_token_ids) for s, _, _ in batch]
            completions = [list(s.token_ids) for s, _, _ in batch]
            logp, mask = sequence_logprobs(model, prompts, completions, eos, temp)              # (B, T)
            self._pause()
            engine_lp = _pad([list(s.logprobs) for s, _, _ in batch], logp.shape[1], logp.device)  # (B, T)
            on = torch.tensor([self._on_policy(agent, s) for s, _, _ in batch], device=logp.device)[:, None]  # (B, 1)
            behaviour = torch.where(on, logp.detach(), engine_lp)                              # (B, T)
            A = torch.tensor([a for _, a, _ in batch], device=logp.device)[:, None]            # (B, 1)
            W = torch.tensor([w for _, _, w in batch], device=logp.device)[:, None]            # (B, 1)
            # KL to the base (adapter off) costs another forward: on every micro-batch when it is in
            # the loss; else a logged estimate from KL_ESTIMATE_ROWS rows of the first micro-batch.
            ref = None
            if cfg.kl_coef > 0:
                with torch.no_grad(), model.disable_adapter():
                    ref, _ = sequence_logprobs(model, prompts, completions, eos, temp)          # (B, T)
            loss, t = magrpo_loss(logp, behaviour, A, W, mask, cfg.clip_epsilon, ref, cfg.kl_coef)
            loss.backward()
            self._pause()
            ratio, clipped = t["ratio"], t["clipped"]                                          # (B, T)
            if t["kl"] is not None:
                sums["kl"] += float((t["kl"] * mask).sum())
                sums["kl_tokens"] += float(mask.sum())
            elif start == 0:
                rows = min(len(batch), KL_ESTIMATE_ROWS)
                kl, kl_mask = self._kl_estimate(agent, prompts[:rows], completions[:rows], logp[:rows],
                                                temp)                                           # (rows, T')
                sums["kl"] += float((kl * kl_mask).sum())
                sums["kl_tokens"] += float(kl_mask.sum())
            with torch.no_grad():
                off = mask * ~on                                                                # (B, T) late tokens
                sums["loss"] += float(loss)
                sums["clipped"] += float(clipped.sum())
                sums["ratio"] += float((ratio * mask).sum())
                sums["tokens"] += float(mask.sum())
                sums["late_ratio"] += float((ratio * off).sum())
                sums["late_clipped"] += float((clipped * off).sum())
                sums["late_tokens"] += float(off.sum())
                if off.any():
                    late_min = min(late_min, float(ratio[off.bool()].min()))
                    late_max = max(late_max, float(ratio[off.bool()].max()))
                fresh = mask * on                                                               # (B, T)
                sums["gap"] += float(((logp - engine_lp).abs() * fresh).sum())
                sums["gap_tokens"] += float(fresh.sum())
        # data parallel: the loss is a weighted SUM over the step's samples (sample weights counted over
        # all its groups), so the one-process gradient is the SUM of the ranks' gradients (not their
        # mean); the logged sums add up the same way. From here every rank holds identical numbers.
        distributed.all_reduce_grads(self.params[agent])
        sums = dict(zip(sums, distributed.all_reduce(list(sums.values()))))
        late_max, neg_min = distributed.all_reduce([late_max, -late_min], "max")
        late_min = -neg_min
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params[agent], cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()
        tokens, late_tokens = max(sums["tokens"], 1.0), sums["late_tokens"]
        stats.update(loss=sums["loss"], clip_frac=sums["clipped"] / tokens, kl=sums["kl"] / max(sums["kl_tokens"], 1.0),
                     ratio_mean=sums["ratio"] / tokens, grad_norm=float(grad_norm), tokens=int(sums["tokens"]),
                     late_samples=sum(not self._on_policy(agent, s) for s, _, _ in live))
        if late_tokens:
            stats.update(late_ratio_mean=sums["late_ratio"] / late_tokens, late_ratio_min=late_min,
                         late_ratio_max=late_max, late_clip_frac=sums["late_clipped"] / late_tokens)
        if sums["gap_tokens"]:
            stats["engine_logprob_gap"] = sums["gap"] / sums["gap_tokens"]
        return stats

    @torch.no_grad()
    def _kl_estimate(self, agent, prompts, completions, logp,
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """k3 KL(adapter || base) per token on a few rows of `agent` (its own base), both at the
        rows' sampling temperature. `logp` (rows, T) is the adapter's side, the step's own forward
        of those rows (the adapter has not stepped yet): only the base's side costs a forward
        here. That forward was ~1/3 of a step while both sides were recomputed (tldr, 2 agents x
        G=4 x 64 tokens, fp32 on one core: 5.1-5.5 of 13.6-14.2 s). The two sides come from batches of different shapes (B rows
        vs `rows`): in bf16 that alone moves a log-prob by ~1e-3 (k3 ~ d^2/2 ~ 1e-6 a token), far
        below a KL worth reading; in fp32 ~1e-7."""
        model, eos = self.model_of[agent], self.eos_of[agent]
        with model.disable_adapter():
            ref, mask = sequence_logprobs(model, prompts, completions, eos, temperature)      # (rows, T')
        d = ref - logp.detach()[:, :ref.shape[1]]                                             # (rows, T')
        return torch.exp(d) - d - 1, mask


def group_metrics(groups: list[Group], level_names=()) -> dict[str, float]:
    """Return mean/std and level means over first-turn joint actions, reward std within groups,
    the share of groups whose returns are all equal (advantage 0: no learning signal)."""
    roots = [g for g in groups if g.parent is None] or groups
    returns = [R for g in roots for R in g.returns]
    m: dict[str, float] = {
        "return_mean": statistics.fmean(returns) if returns else math.nan,
        "return_std": statistics.pstdev(returns) if returns else math.nan,
        "group_return_std": statistics.fmean(statistics.pstdev(g.returns) for g in groups) if groups else math.nan,
        "zero_variance_frac": sum(is_flat(g.returns) for g in groups) / len(groups) if groups else math.nan,
    }
    for name in level_names:
        vals = [lv[name] for g in roots for lv in g.levels if name in lv]
        m[f"level/{name}"] = statistics.fmean(vals) if vals else math.nan
    turns = sorted({g.turn for g in groups})
    if len(turns) > 1:
        for t in turns:
            m[f"turn{t}/reward_mean"] = statistics.fmean(r for g in groups if g.turn == t for r in g.rewards)
    return m
