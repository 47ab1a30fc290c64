"""vLLM's CPU decode attention alone, by micro-kernel ("isa") and dtype, at the shapes of a round.

    python docs/results/archive/vllm_attention_isa.py THREADS [ROWS] [KEYS]

One decode step of one layer of the embedded model (9 query heads, 3 KV heads, head size 64): ROWS
requests (default 128 = `collab bench generate`'s rollout workload; 8 = a person's round), each one
query against KEYS cached positions (default 200), block size 128 (vLLM's CPU default). vLLM picks
the micro-kernel in `cpu_attn._get_attn_isa`: "amx" where AMX tiles exist (bf16), else "vec" for a
block size divisible by 32, "vec16" otherwise. Prints ms per call (median of 200 after 20 warm-up
calls) and the largest |difference| from a float64 reference, per isa, dtype and KV split.
"""
import itertools
import statistics
import sys
import time

import torch
from vllm import _custom_ops as ops

threads = int(sys.argv[1])
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 128
keys = int(sys.argv[3]) if len(sys.argv) > 3 else 200
torch.set_num_threads(threads)
heads, kv_heads, head_dim, block = 9, 3, 64, 128
blocks_per_row = (keys + block - 1) // block
scale = head_dim ** -0.5

torch.manual_seed(0)
q64 = torch.randn(rows, heads, head_dim, dtype=torch.float64)
k64 = torch.randn(rows, keys, kv_heads, head_dim, dtype=torch.float64)
v64 = torch.randn(rows, keys, kv_heads, head_dim, dtype=torch.float64)
# reference: each row's query against its own keys (GQA: query head h reads KV head h // 3)
kk = k64.repeat_interleave(heads // kv_heads, dim=2)           # (R, L, H, D)
vv = v64.repeat_interleave(heads // kv_heads, dim=2)
att = torch.einsum("rhd,rlhd->rhl", q64, kk) * scale           # (R, H, L)
ref = torch.einsum("rhl,rlhd->rhd", att.softmax(-1), vv)      # (R, H, D)


def run(dtype, isa, split):
    num_blocks = rows * blocks_per_row
    kv = torch.zeros(num_blocks, kv_heads, block * 2, head_dim, dtype=dtype)
    key_cache, value_cache = kv.chunk(2, dim=2)
    block_table = torch.arange(num_blocks, dtype=torch.int32).view(rows, blocks_per_row)
    slots = (block_table[:, :, None] * block + torch.arange(block, dtype=torch.int32)).view(rows, -1)[:, :keys]
    ops.cpu_attn_reshape_and_cache(k64.to(dtype).reshape(-1, kv_heads, head_dim), v64.to(dtype).reshape(-1, kv_heads, head_dim),
                                   key_cache, value_cache, slots.reshape(-1).to(torch.int64), isa)
    seq_lens = torch.full((rows,), keys, dtype=torch.int32)
    qsl = torch.arange(rows + 1, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=rows, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                               seq_lens=seq_lens, dtype=dtype, query_start_loc=qsl, causal=True,
                                               sliding_window_size=-1, isa=isa, enable_kv_split=split)
    q = q64.to(dtype).contiguous()
    out = torch.empty_like(q)

    def call():
        ops.cpu_attention_with_kv_cache(query=q, key_cache=key_cache, value_cache=value_cache, output=out,
                                        query_start_loc=qsl, seq_lens=seq_lens, scale=scale, causal=True,
                                        alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
                                        scheduler_metadata=meta, s_aux=None)
    for _ in range(20):
        call()
    times = []
    for _ in range(200):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, (out.double() - ref).abs().max().item()


print(f"threads {threads}, rows {rows}, keys {keys}, torch capability {torch.backends.cpu.get_cpu_capability()}")
for dtype, isa, split in itertools.product((torch.bfloat16, torch.float32), ("vec", "vec16"), (True, False)):
    try:
        ms, err = run(dtype, isa, split)
        print(f"{str(dtype):15s} {isa:6s} split={split!s:5s} {ms:7.3f} ms  err {err:.2e}")
    except Exception as e:   # a kernel this build does not have for the dtype
        print(f"{str(dtype):15s} {isa:6s} split={split!s:5s} failed: {str(e).splitlines()[0][:100]}")
