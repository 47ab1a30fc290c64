"""What vLLM's CPU sampler path costs a decode step, piece by piece, at ROWS rows (the rollout's
128 by default; a round's 8), with logprobs=0 as the engine asks (engines/engine_vllm.py): the raw
log-probs (log_softmax to fp32), the fp32 copy of the logits, the tempered softmax our sampler
draws from (engines/cpu_sampler.py), the draw itself, and the sampled token's rank (vLLM's
compiled `batched_count_greater_than`). Medians of 40 calls after 5 warm-ups.

    THP_MEM_ALLOC_ENABLE=1 python docs/results/archive/sampler_rows_cost.py THREADS [ROWS ...]

KEEP=0 skips huge_pages.keep_freed_memory (glibc then hands each step's freed temporaries back to
the kernel, as before 2026-11-30: the same ops then time page faults; docs/results "Issue 19's
command after the malloc change").
"""
import os
import sys
import time

import torch

from collab_app.engines.cpu_sampler import sample_rows
from collab_app.cpu.huge_pages import keep_freed_memory

VOCAB = 49_152   # the embedded model's


def median_ms(fn, calls: int = 40) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[calls // 2] * 1e3, 2)


def main() -> None:
    kept = os.environ.get("KEEP", "1") == "1" and keep_freed_memory()
    torch.set_num_threads(int(sys.argv[1]))
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    for rows in [int(a) for a in sys.argv[2:]] or [8, 128]:
        logits = (torch.randn(rows, VOCAB) * 3).to(torch.bfloat16)      # (R, V), as compute_logits returns them
        temperature = torch.full((rows, 1), 0.8)
        raw = logits.log_softmax(-1, dtype=torch.float32)               # (R, V)
        probs = (logits.float() / temperature).softmax(-1)              # (R, V)
        token_lp = raw.gather(-1, sample_rows(probs).unsqueeze(-1))     # (R, 1)
        pieces = {
            "raw log-probs": lambda: logits.log_softmax(-1, dtype=torch.float32),
            "fp32 copy + temperature": lambda: logits.to(torch.float32).div_(temperature),
            "softmax": lambda: raw.softmax(-1),
            "draw": lambda: sample_rows(probs),
            "rank": lambda: batched_count_greater_than(raw, token_lp),
        }
        costs = {name: median_ms(fn) for name, fn in pieces.items()}
        print(f"{rows} rows, {torch.get_num_threads()} threads, freed memory kept: {kept}:",
              ", ".join(f"{k} {v} ms" for k, v in costs.items()), f"(sum {sum(costs.values()):.2f} ms)")


if __name__ == "__main__":
    main()
