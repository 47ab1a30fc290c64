"""Where a round's time goes inside the vLLM engine, by wall-clock timers instead of a sampling
profiler: docs/results/archive/engine_rounds.py with timers around the engine's Python-level calls, summed
per round and printed as one JSON line after each round line.

    EAGER=0 BORROW=1 python docs/results/archive/engine_op_times.py vllm 3 bfloat16      # Xeon, compiled bf16
    BORROW=1 python docs/results/archive/engine_op_times.py vllm 3 float32 fp16           # AVX2 (eager fp32)

Timed (seconds per round, calls per round): `execute_model` (the model's forward and the LM head),
`sample_tokens` (vLLM's sampling step) and inside it `sampler` (vLLM's Sampler: log-probs, our
inverse-CDF draw; its pieces `s_logprobs`, `s_sample` with our draw `s_rows` in it, `s_gather`), and inside the forward `lora` (vllm_team.TeamLoRA._collab_add, the deltas of
every linear layer), `attn` (CPUAttentionBackendImpl.forward), `kv` (its do_kv_cache_update). The
base GEMMs and inductor's fused kernels are the rest of `execute_model`. The timers cost ~1 µs a
call (~0.5 ms a step), a py-spy `--native` profile more than half the round (docs/results "What is
left of a compiled step"), which also slows every thread it samples unevenly, so the barrier share it
reports is not to be trusted.

SER=kv / SER=attn (or both, comma-separated) try one lever each for decode batches (<= 128 tokens):
`kv` writes the key/value cache on one OpenMP thread; `attn` runs vLLM's CPU attention on one thread
(its work plan, `cpu_attn_get_scheduler_metadata`, records the thread count and the kernel refuses
to run under another, so the plan is made and run under the same count: the metadata builder marks
the batch and the forward follows the mark). docs/results "Where a round's time goes, timed in the
engine" has the figures; neither was kept.
"""
import collections
import json
import os
import sys
import time

import torch

SERIAL_TOKENS = 128
SER = set(filter(None, os.environ.get("SER", "").split(",")))
TOTAL, CALLS = collections.Counter(), collections.Counter()


def timed(owner, name: str, key: str, threads_one=lambda *a, **k: False):
    """Wrap owner.name with a wall-clock timer under `key`; on one thread where threads_one says so."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        one = threads_one(*args, **kwargs)
        n = torch.get_num_threads()
        if one:
            torch.set_num_threads(1)
        try:
            return inner(*args, **kwargs)
        finally:
            if one:
                torch.set_num_threads(n)
            TOTAL[key] += time.perf_counter() - t
            CALLS[key] += 1

    import inspect

    static = isinstance(inspect.getattr_static(owner, name), staticmethod)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


from vllm.v1.attention.backends import cpu_attn  # noqa: E402
from vllm.v1.sample import sampler  # noqa: E402
from vllm.v1.worker import gpu_model_runner  # noqa: E402

from collab_app.engines import cpu_sampler, vllm_team  # noqa: E402

Impl = cpu_attn.CPUAttentionBackendImpl
timed(Impl, "do_kv_cache_update", "kv",
      lambda self, layer, key, *a, **k: "kv" in SER and key.shape[0] <= SERIAL_TOKENS)
timed(Impl, "forward", "attn",
      lambda self, layer, q, k, v, cache, metadata, *a, **kw: getattr(metadata, "collab_one_thread", False))
Builder = cpu_attn.CPUAttentionMetadataBuilder
vllm_build = Builder.build


def build(self, common_prefix_len, common, *args, **kwargs):
    """The attention plan for a decode batch made for one thread (SER=attn), and marked so."""
    one = "attn" in SER and common.num_actual_tokens <= SERIAL_TOKENS
    n = torch.get_num_threads()
    if one:
        torch.set_num_threads(1)
    try:
        metadata = vllm_build(self, common_prefix_len, common, *args, **kwargs)
    finally:
        if one:
            torch.set_num_threads(n)
    metadata.collab_one_thread = one
    return metadata


Builder.build = build
timed(vllm_team.TeamLoRA, "_collab_add", "lora")
timed(sampler.Sampler, "forward", "sampler")
# inside it: the raw log-probs (log_softmax), the draw (temperature, top-k/p, softmax, and in it our
# inverse CDF `rows`), the gather of the sampled token's log-prob and rank (vLLM's compiled count)
timed(sampler.Sampler, "compute_logprobs", "s_logprobs")
timed(sampler.Sampler, "sample", "s_sample")
timed(sampler.Sampler, "gather_logprobs", "s_gather")
timed(cpu_sampler, "sample_rows", "s_rows")
timed(gpu_model_runner.GPUModelRunner, "execute_model", "execute_model")
timed(gpu_model_runner.GPUModelRunner, "sample_tokens", "sample_tokens")

import builtins  # noqa: E402

_print = builtins.print


def print_with_times(*args, **kwargs):
    _print(*args, **kwargs)
    if args and args[0] == "round":   # engine_rounds.py's line for one round: the timers' sums follow
        _print(json.dumps({"ser": sorted(SER), **{k: [round(TOTAL[k], 3), CALLS[k]] for k in sorted(TOTAL)}}), flush=True)
        TOTAL.clear()
        CALLS.clear()


builtins.print = print_with_times
here = os.path.dirname(os.path.abspath(__file__))
sys.argv = [os.path.join(here, "engine_rounds.py")] + sys.argv[1:]
exec(compile(open(sys.argv[0]).read(), sys.argv[0], "exec"))
