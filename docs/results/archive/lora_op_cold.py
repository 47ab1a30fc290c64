"""The LoRA op's body (vllm_team.TeamLoRA._collab_add: two stacked keys, rank 8 each, 8 rows, on one
thread) outside the engine, warm and cold: the 30 layers' own A/B in turn, and "cold" streams 9 MB
through the caches before each call, as a decode step's base GEMMs do between two LoRA ops.

    python docs/results/archive/lora_op_cold.py

Prints µs per call (median of 5 passes over 120 calls) for:
- as served: `h = x.float() @ a; h *= mask; out += h @ b` (bf16 x/out, as a bf16 engine; and fp32);
- tiny: the same five calls on 8-wide shapes (what the calls cost without their data);
- bmm: the two keys' rows as two groups of 4, `bmm(bmm(x, A), B)`, no mask (bf16 and fp32);
- addmm_: fp32 only, `out.addmm_(h, b)` in place of `out += h @ b`.
docs/results "Where a round's time goes, timed in the engine" has the figures.
"""
import statistics
import time

import torch

T, KEYS, RANK = 8, 2, 8
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]   # qkv, o, gate_up, down of SmolLM2-135M
torch.manual_seed(0)
torch.set_num_threads(2)
junk = torch.ones(9 * 2**20 // 4)
mask = torch.zeros(T, KEYS * RANK)
mask[: T // 2, :RANK] = 1
mask[T // 2:, RANK:] = 1


def layers(dtype, width=None):
    out = []
    for _ in range(30):
        for k, n in SHAPES:
            k, n = (width, width) if width else (k, n)
            out.append(dict(a=torch.randn(k, KEYS * RANK), b=torch.randn(KEYS * RANK, n),
                            A=torch.randn(KEYS, k, RANK), B=torch.randn(KEYS, RANK, n),
                            x=torch.randn(T, k).to(dtype), out=torch.zeros(T, n).to(dtype)))
    return out


def served(d):
    h = d["x"].float() @ d["a"]
    h *= mask
    d["out"] += h @ d["b"]


def bmm(d):
    h = torch.bmm(d["x"].float().view(KEYS, T // KEYS, -1), d["A"])
    d["out"] += torch.bmm(h, d["B"]).view(T, -1)


def addmm(d):
    h = d["x"] @ d["a"]
    h *= mask
    d["out"].addmm_(h, d["b"])


def per_call_us(fn, calls, cold):
    passes = []
    for _ in range(5):
        total = 0.0
        for d in calls:
            if cold:
                junk.add_(1.0)
            t = time.perf_counter()
            torch.set_num_threads(1)          # as SERIAL_LORA_ROWS does
            fn(d)
            torch.set_num_threads(2)
            total += time.perf_counter() - t
        passes.append(total / len(calls) * 1e6)
    return round(statistics.median(passes), 1)


bf16, fp32, tiny = layers(torch.bfloat16), layers(torch.float32), layers(torch.bfloat16, width=8)
for _ in range(2):
    row = {"bf16 served warm": per_call_us(served, bf16, False), "bf16 served cold": per_call_us(served, bf16, True),
           "bf16 bmm cold": per_call_us(bmm, bf16, True),
           "fp32 served cold": per_call_us(served, fp32, True), "fp32 bmm cold": per_call_us(bmm, fp32, True),
           "fp32 addmm_ cold": per_call_us(addmm, fp32, True)}
    row["tiny (no data) cold"] = per_call_us(served, tiny, True)   # (8 x 8) @ (8 x 16) @ (16 x 8)
    print(row, flush=True)
