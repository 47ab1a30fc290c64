"""Paired in-process A/B of the transformers engine's KV cache: written in place
(`engine_hf.preallocated_cache`, B) against transformers' DynamicCache (A, `torch.cat` every layer and
step), round by round alternating, on test_learning's rollout (its TL;DR text, 2 agents x G, sampled):

    python docs/results/archive/kv_cache_ab.py PAIRS [DTYPE [NEW_TOKENS [G]]]   # DTYPE auto | float32 | bfloat16; G=8
    STREAM=1 python docs/results/archive/kv_cache_ab.py ...                      # rounds through generate_stream

(STREAM=1: the way a person's round runs, and `collab bench generate`'s interactive rounds: the
engine's generate in a thread of its own, a streamer handed each step's tokens.)

G=4 and 128 tokens is a person's round (8 rows), G=16 the rollout's 32 rows. Prints each arm's
median round, its ratio to A (median and per pair), the tokens a round generated (rows may stop
at EOS) and whether it gave A's tokens and log-probs (to 4 decimals). (Tried and dropped: a 16-bit engine's cache kept in fp32, so
that its fp32 decode attention converts nothing: bf16, 128 tokens, 8 pairs, 0.987 against 1.054
kept in bf16, within this VM's noise.)
"""
import os
import statistics
import sys
import tempfile
import time

import collab_app  # noqa: F401  (before torch: the OpenMP wait setting)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "trainer"))
from test_learning import OneTextTLDR
from transformers.cache_utils import DynamicCache
from collab_app.engines import make_engine, engine_hf
from collab_app.engines.model import ensure_model
from collab_app.engines.engine_types import Request, Sampling
from trainer.config import MAGRPOConfig
from trainer.magrpo import MAGRPOTrainer
from collab_app.engines.sampler import EngineSampler
mp = ensure_model(None)
task = OneTextTLDR()
prompts = task.agent_prompts(task.examples("train")[0], [])
dtype = sys.argv[2] if len(sys.argv) > 2 else "auto"
new = int(sys.argv[3]) if len(sys.argv) > 3 else 40
G = int(sys.argv[4]) if len(sys.argv) > 4 else 8
eng = make_engine("transformers", model=mp, seed=0, dtype=dtype)
for r in task.roles: eng.register_agent(r)
cfg = MAGRPOConfig(task="tldr", model=mp, num_generations=8, joint_mode="cross", prompts_per_step=1, max_new_tokens=40, num_steps=1, keep_versions=0)
MAGRPOTrainer(cfg, task, tempfile.mkdtemp()).load_into(EngineSampler(eng))
reqs = [Request(agent=r, prompt=p) for r, p in zip(task.roles, prompts)]
samp = Sampling(max_new_tokens=new, temperature=0.8, top_p=1.0, seed=1)
inplace = engine_hf.preallocated_cache
stream = os.environ.get("STREAM") == "1"


def run(G):
    if not stream:
        return eng.generate(reqs, G, samp)
    last = None
    for last in eng.generate_stream(reqs, G, samp):
        pass
    return last.done


arms = {"A dynamic": lambda room: DynamicCache(), "B in place": inplace}
res = {k: [] for k in arms}; toks = {}
for k in arms:
    engine_hf.preallocated_cache = arms[k]; run(G)
for i in range(int(sys.argv[1])):
    for k in (list(arms) if i % 2 == 0 else list(arms)[::-1]):   # AB BA ...
        engine_hf.preallocated_cache = arms[k]
        t = time.perf_counter(); out = run(G); res[k].append(time.perf_counter() - t)
        toks[k] = [(x.token_ids, [round(l, 4) for l in x.logprobs]) for o in out for x in o]
a = statistics.median(res["A dynamic"])
print("streamed" if stream else "generate", "dtype", eng.dtype, "quantize", eng.quantize, "new tokens", new, "rows", 2 * G,
      "tokens a round", sum(len(t) for t, _ in toks["A dynamic"]))
for k, v in res.items():
    print(f"{k:20s} median {statistics.median(v):.3f} s, /A {statistics.median(v) / a:.3f}, paired",
          [round(y / x, 3) for x, y in zip(res["A dynamic"], v)], "same tokens and log-probs as A:", toks[k] == toks["A dynamic"])
