"""transformers + peft backend: the fallback engine and the fast test backend.

One base model, one peft LoRA adapter per agent (agents without one use the base). A batch that
mixes agents runs as ONE `generate` call with peft's mixed-batch `adapter_names=[...]` (one
name per row, "__base__" for base rows), left-padded. Log-probs (`SampledLogprobs`): a logits
processor that transformers runs before its temperature / top-p warpers takes each step's
log_softmax and keeps only the entry of the token sampled from it, the untempered convention
of engine_types. It replaces `output_logits=True`, which held every step's float32 logits
until the end (rows x steps x 49152 x 4 bytes: 3.2 GB for the bench's 128 x 128).

Thread safety: one lock around `generate` and around adapter loading. peft's mixed batch works
through forward hooks registered on the shared modules, so two forwards must not overlap, and
an adapter must not be deleted under a running batch. A `load_adapter` during a `generate`
therefore waits for that batch (which finishes on the versions it started with); the old
version is deleted right after the new one is in.

Left out: KV-cache reuse across calls (a prompt's G samples each prefill it again).
"""
from __future__ import annotations

import itertools
import re
import threading

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from collab_app.engines import chat_prompt_ids, check_lengths, check_requests
from collab_app.engines.engine_types import EngineError, Request, Sample, Sampling

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch


class SampledLogprobs(LogitsProcessor):
    """log pi(sampled token) per step without keeping the logits: step t's log_softmax waits
    until step t+1's call, whose input_ids end with the token sampled at t; `finish` takes the
    last step's from the final sequences. Changes no scores. Memory: one (rows, vocab) tensor.
    It sees the scores after the processors the model's generation_config asks for (none for
    SmolLM2: no repetition penalty or suppressed tokens), before temperature and top-p."""

    def __init__(self):
        self.pending: torch.Tensor | None = None   # (rows, vocab) log_softmax of the last step
        self.taken: list[torch.Tensor] = []         # (rows,) per finished step

    def _take(self, tokens: torch.Tensor) -> None:
        if self.pending is not None:
            self.taken.append(self.pending.gather(1, tokens[:, -1:]).squeeze(1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._take(input_ids)
        self.pending = torch.log_softmax(scores.float(), -1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(rows, new tokens) log-probs, given generate's output sequences."""
        self._take(sequences)
        self.pending = None
        return torch.stack(self.taken, 1)


class TransformersEngine:
    name = "transformers"

    def __init__(self, model_path: str, dtype: str = "bfloat16", max_model_len: int = 2048,
                 seed: int | None = None, device: str | None = None, num_threads: int | None = None):
        if dtype not in ("bfloat16", "float32"):
            raise EngineError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
        if num_threads:
            # torch's intra-op threads for this process. On a box whose cores other processes also
            # use, fewer threads can be much faster (`collab bench generate` measured 1 thread at
            # 27 tok/s vs 2 threads at 3 tok/s with load avg 8 on 2 cores: OpenMP barriers spin).
            torch.set_num_threads(num_threads)
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"  # decoder-only batched generate needs left padding
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self.eos_ids.discard(None)
        self._peft = None  # PeftModel, created on the first adapter (it wraps self.model in place)
        self._agents: dict[str, tuple[str | None, int | None]] = {}  # agent -> (peft adapter name, version)
        self._names = itertools.count(1)
        self._lock = threading.Lock()
        if seed is not None:
            torch.manual_seed(seed)

    # -- adapters ---------------------------------------------------------------------------
    def register_agent(self, agent: str) -> None:
        with self._lock:
            self._agents.setdefault(agent, (None, None))

    def adapter_version(self, agent: str) -> int | None:
        if agent not in self._agents:
            raise EngineError(f"unknown agent {agent!r}; known: {sorted(self._agents)}")
        return self._agents[agent][1]

    def load_adapter(self, agent: str, path: str | None, version: int | None) -> None:
        from peft import PeftModel

        with self._lock:
            old = self._agents.get(agent, (None, None))[0]
            if path is None:
                self._agents[agent] = (None, None)
            else:
                # A fresh peft name per load: the new weights never mix with the old ones.
                name = f"v{next(self._names)}_{re.sub(r'[^0-9A-Za-z_]', '_', agent)}"
                try:
                    if self._peft is None:
                        self._peft = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
                    else:
                        self._peft.load_adapter(path, adapter_name=name)
                except (OSError, ValueError) as e:
                    raise EngineError(f"cannot load adapter {path!r} for agent {agent!r}: {e}; "
                                      f"pass a peft LoRA directory (adapter_config.json + weights)") from e
                self._agents[agent] = (name, version)
            if old is not None:
                # Make some other adapter active first: deleting the active one makes peft warn
                # ("... was active which is now deleted") on every hot-swap.
                others = [n for n in self._peft.peft_config if n != old]
                if others and self._peft.active_adapter == old:
                    self._peft.set_adapter(others[-1])
                self._peft.delete_adapter(old)
                if not self._peft.peft_config:  # no adapter left: peft cannot run with none, go back to the base
                    self.model = self._peft.unload()
                    self._peft = None

    # -- generation -------------------------------------------------------------------------
    def generate(self, requests: list[Request], n: int, sampling: Sampling) -> list[list[Sample]]:
        check_requests(self, requests, n, sampling, self._agents)
        prompt_ids = [chat_prompt_ids(self.tokenizer, r) for r in requests]
        check_lengths(prompt_ids, sampling, self.max_model_len)
        with self._lock:
            agents = {r.agent: self._agents[r.agent] for r in requests}  # versions this batch runs on
            rows = [(i, ids) for i, ids in enumerate(prompt_ids) for _ in range(n)]
            batch = self.tokenizer.pad({"input_ids": [ids for _, ids in rows]}, padding=True, return_tensors="pt")
            logprobs = SampledLogprobs()
            kw = dict(
                input_ids=batch["input_ids"].to(self.device), attention_mask=batch["attention_mask"].to(self.device),
                max_new_tokens=sampling.max_new_tokens, do_sample=sampling.temperature > 0,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=sorted(self.eos_ids),
                return_dict_in_generate=True, logits_processor=LogitsProcessorList([logprobs]),
            )
            if sampling.temperature > 0:
                # top_k=0: the model's generation_config may carry a default top-k (HF's is 50); vLLM has none.
                kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
            else:
                kw.update(temperature=None, top_p=None, top_k=None)
            model = self.model
            if self._peft is not None:  # once peft wrapped the model every forward must name its adapters
                model = self._peft
                kw["adapter_names"] = [agents[requests[i].agent][0] or BASE for i, _ in rows]
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            with torch.inference_mode():
                out = model.generate(**kw)
            new = out.sequences[:, batch["input_ids"].shape[1]:]
            lp = logprobs.finish(out.sequences)                                  # (rows, new tokens)
            if lp.shape != new.shape:
                raise EngineError(f"log-probs for {tuple(lp.shape)} tokens but {tuple(new.shape)} generated: "
                                  f"transformers changed how logits processors are called")
        return self._samples(requests, rows, new.tolist(), lp.tolist(), prompt_ids, agents, n)

    def _samples(self, requests, rows, seqs, lps, prompt_ids, agents, n) -> list[list[Sample]]:
        result: list[list[Sample]] = [[] for _ in requests]
        for (i, _), toks, lp in zip(rows, seqs, lps):
            end = next((t + 1 for t, tok in enumerate(toks) if tok in self.eos_ids), None)
            toks, lp = toks[:end], lp[:end]  # up to and including EOS; pad after it dropped
            result[i].append(Sample(
                agent=requests[i].agent, adapter_version=agents[requests[i].agent][1],
                prompt_token_ids=prompt_ids[i], text=self.tokenizer.decode(toks, skip_special_tokens=True),
                token_ids=toks, logprobs=lp, finish_reason="stop" if end else "length",
                meta={"engine": self.name},
            ))
        return result

    def close(self) -> None:
        self._peft = self.model = None
