"""Which settings make a compiled vLLM engine's start miss inductor's cache (docs/results "A
person's first start"): builds the engine `collab serve` builds (bf16, compiled) with NUM_AGENTS
agent slots on the cores it is given and prints its start-up. Run one after another in a fresh
cache, each in its own process:

    export TORCHINDUCTOR_CACHE_DIR=/tmp/ind COLLAB_CALIBRATE=0; rm -rf /tmp/ind
    for spec in "2 0,1" "6 0" "2 0" "6 0" "6 0,1"; do set -- $spec
      taskset -c $2 .venv/bin/python docs/results/archive/compile_cache_keys.py $1; done

A start that finds its graph in the cache takes ~35 s on the Xeon of docs/results, one that
compiles ~100 s."""
import sys
import time

import collab_app  # noqa: F401 - first, as every entry point

import torch

from collab_app.engines.engine_vllm import VLLMEngine
from collab_app.engines.model import ensure_model

n = int(sys.argv[1])
t = time.perf_counter()
eng = VLLMEngine(ensure_model(None), dtype="bfloat16", num_agents=n, enforce_eager=False, max_lora_rank=8)
print(f"RESULT agents={n} threads={torch.get_num_threads()} startup_s={time.perf_counter() - t:.1f}", flush=True)
eng.close()
