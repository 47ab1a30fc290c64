"""One decode step's linear layers of the embedded model (SmolLM2-135M: 30 layers of q, k, v, o,
gate, up, down; no LM head) at M activation rows: torch's fp32 GEMM (`F.linear`) against fbgemm's
fp16-weight GEMM (`vllm_team.fp16_linear`), best of 3, on THREADS threads. fbgemm picks its kernels
from the CPU's flags, not from torch's ATEN_CPU_CAPABILITY: under the AVX2 emulation it runs its
AVX-512 kernels unless FBGEMM_ENABLE_INSTRUCTIONS=AVX2 (docs/results "fbgemm ignores
ATEN_CPU_CAPABILITY").

    python docs/results/archive/fp16_gemm_rows.py THREADS       # from the repository root
"""
import os, sys, time, torch, torch.nn.functional as F
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from collab_app.engines.vllm_team import fp16_linear
torch.set_num_threads(int(sys.argv[1]))
print("cap", torch.backends.cpu.get_cpu_capability(), "threads", torch.get_num_threads())
# SmolLM2-135M: hidden 576, q 576, kv 192, mlp 1536, 30 layers
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
layers = [[torch.randn(o, i) * 0.02 for o, i in shapes] for _ in range(30)]
packed = [[fp16_linear(w) for w in L] for L in layers]
for M in [1, 8, 32, 64, 128, 256, 512, 900]:
    x = {i: torch.randn(M, i) for i in (576, 1536)}
    res = {}
    for name in ("fp32", "fp16"):
        ts = []
        for rep in range(3):
            t = time.perf_counter()
            for L, P in zip(layers, packed):
                for w, p in zip(L, P):
                    (F.linear(x[w.shape[1]], w) if name == "fp32" else p(x[w.shape[1]]))
            ts.append(time.perf_counter() - t)
        res[name] = min(ts)
    print(f"M={M:4d} fp32 {res['fp32']*1000:8.1f} ms  fp16 {res['fp16']*1000:8.1f} ms  fp16/fp32 {res['fp16']/res['fp32']:.2f}", flush=True)
