"""The trainer's side of huge pages: forward + backward of the embedded model with rank-8 LoRA on
q/k/v/o (peft), 4 rows x 280 tokens (about a TLDR group's micro-batch), one thread, 6 iterations;
prints the median and best of the last 5 and how much of the process sits in huge pages. Huge pages
per process through the environment, run alternately (docs/results "Huge pages for torch's tensors"):

    for i in 1 2 3; do for v in 0 1; do THP_MEM_ALLOC_ENABLE=$v python docs/results/archive/thp_train_check.py; done; done

DTYPE=float32 for the AVX2 engines' dtype (default bfloat16).
"""
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
from collab_app.engines.model import ensure_model
torch.manual_seed(0)
dtype = os.environ.get("DTYPE", "bfloat16")
torch.set_num_threads(1)
m = AutoModelForCausalLM.from_pretrained(ensure_model(None), dtype=getattr(torch, dtype))
m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
m.train()
ids = torch.randint(0, 49152, (4, 280))
times = []
for i in range(6):
    t = time.perf_counter()
    out = m(input_ids=ids, labels=ids)
    out.loss.backward()
    m.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t)
huge = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")][0].split()[1]
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), dtype, "median", round(statistics.median(times[1:]), 3), "best", round(min(times[1:]), 3), "hugeKB", huge)
