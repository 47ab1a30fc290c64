"""The in-graph LoRA deltas of one decode step of the embedded model (vllm_team._graph_deltas on
q|k|v and o of 30 layers, fp32, eager here: the compiled graph runs the same two GEMMs per layer
through MKL), by lane count and rows: what every forward pays for lanes, used or not.

    python docs/results/archive/lora_lanes_cost.py THREADS        # ROWS="8 128" LANES="2 6" by default

Prints the median ms of a step's 60 deltas (20 passes after 3 warm-ups) per (lanes, rows).
docs/results "In-graph LoRA lanes" has the figures.
"""
import os
import statistics
import sys
import time

import torch

torch.set_num_threads(int(sys.argv[1]))
RANK, LAYERS = 8, 30
SHAPES = ((576, 576 + 2 * 192, 3), (576, 576, 1))   # (in, out, shards): SmolLM2-135M's q|k|v and o


def layers(lanes: int, rows: int):
    return [(torch.randn(i, lanes * s * RANK), torch.randn(lanes * s * RANK, o), torch.zeros(rows, lanes))
            for _ in range(LAYERS) for i, o, s in SHAPES]


for rows in [int(r) for r in os.environ.get("ROWS", "8 128").split()]:
    x = torch.randn(rows, 576)
    for lanes in [int(n) for n in os.environ.get("LANES", "2 6").split()]:
        ls = layers(lanes, rows)

        def step():
            for a, b, mask in ls:
                h = (x @ a).view(rows, lanes, -1) * mask[:, :, None]
                h.view(rows, -1) @ b

        for _ in range(3):
            step()
        times = []
        for _ in range(20):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        print(f"{torch.get_num_threads()} threads, {rows:4d} rows, {lanes} lanes: "
              f"{statistics.median(times) * 1000:7.2f} ms a step", flush=True)
