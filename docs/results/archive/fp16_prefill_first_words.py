"""First words of the transformers engine (fp32, fp16-weight base GEMMs as the calibration picks
them where fp16 wins a decode step) on TL;DR prompts, two agents x G=2 with random LoRA adapters,
two threads: fbgemm's fp16 GEMM at every row count (A) against torch's fp32 GEMM for inputs of
ROWS rows or more (B: the prefill), alternated per text.

    python docs/results/archive/fp16_prefill_first_words.py PAIRS     # from the repository root
"""
import os, sys, time, functools, statistics, json
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import torch, torch.nn.functional as F
torch.set_num_threads(2)
from collab_app.commands.bench import ROLES, make_random_lora
from collab_app.engines.engine_types import Sampling, Request
from collab_app.engines.model import ensure_model
from collab_app.engines.engine_hf import TransformersEngine
from tasks import load_task
path = ensure_model(None)
eng = TransformersEngine(path, dtype="float32", max_model_len=2048, quantize="fp16", decode_thread=True)
names = list(ROLES)
for i, a in enumerate(names):
    eng.register_agent(a); eng.load_adapter(a, make_random_lora(path, f"/tmp/fp16-prefill-lora{i}", i, scale=2.0), 1)
ROWS = int(os.environ.get("ROWS", 64))
lin = [m for m in eng.model.modules() if isinstance(m, torch.nn.Linear)]
packed = {m: m.forward for m in lin}
def fallback(m, x):
    return F.linear(x, m.weight, m.bias) if x.numel() // x.shape[-1] >= ROWS else packed[m](x)
def use(side):
    for m in lin:
        if side == "B": m.forward = functools.partial(fallback, m)
        else: m.forward = packed[m]
task = load_task("tldr")
exs = task.examples("train")
def first_words(ex):
    prompts = task.agent_prompts(ex, [])
    reqs = [Request(a, p, r) for a, p, r in zip(names, prompts, ROLES.values())]
    t = time.perf_counter()
    for prog in eng.generate_stream(reqs, 2, Sampling(max_new_tokens=6, temperature=0.8, seed=0)):
        if any(t_ for row in prog.texts for t_ in row):
            return time.perf_counter() - t
    return None
ntok = [len(eng.tokenizer(p)["input_ids"]) for p in task.agent_prompts(exs[0], [])]
print("prompt tokens (ex 0)", ntok, "threads", torch.get_num_threads(), flush=True)
first_words(exs[0])  # warm-up
res = {"A": [], "B": []}
for k in range(int(sys.argv[1])):
    ex = exs[k % len(exs)]
    for side in (("A", "B") if k % 2 == 0 else ("B", "A")):
        use(side); res[side].append(first_words(ex))
    print(k, round(res["A"][-1], 3), round(res["B"][-1], 3), flush=True)
r = [b / a for a, b in zip(res["A"], res["B"])]
print(json.dumps({"median_A": statistics.median(res["A"]), "median_B": statistics.median(res["B"]),
                  "median_ratio": statistics.median(r), "rows": ROWS}))
