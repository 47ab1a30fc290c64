"""The issue-19 check of an AVX2 emulation: one `F.linear` 576 -> 2304 (fp32) and fbgemm's
fp16-weight GEMM of the same weight at 1-256 rows, one thread, weights out of cache (40 copies
cycled), best of 5, ms per call. Issue 19's AVX2 EPYC: fp32 0.67 / 1.46 / 1.68 ms at 1 / 4 / 8 rows.

    python docs/results/archive/flinear_576x2304.py       # from the repository root
"""
import os, sys, time, torch, torch.nn.functional as F
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from collab_app.engines.vllm_team import fp16_linear
torch.set_num_threads(1)
# weights out of cache: 40 copies (~212 MB) cycled
ws = [torch.randn(2304, 576) for _ in range(40)]
ps = [fp16_linear(w) for w in ws]
for M in (1, 4, 8, 64, 256):
    x = torch.randn(M, 576)
    out = []
    for name in ("fp32", "fp16"):
        best = 1e9
        for rep in range(5):
            t = time.perf_counter()
            for w, p in zip(ws, ps):
                F.linear(x, w) if name == "fp32" else p(x)
            best = min(best, (time.perf_counter() - t) / len(ws))
        out.append(f"{name} {best*1000:.3f} ms")
    print(f"M={M}", *out, flush=True)
