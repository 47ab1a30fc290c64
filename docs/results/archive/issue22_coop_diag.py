"""Issue 22 item 4: what keeps cooperation near 0 with the untrained team (default prompts,
greedy, 128 tokens): per answer, does main's code call aux, does main define aux itself (it is
told not to), does any test pass, and does the cooperation level reward it. Prints the counts for
every 4th train problem and the 32 held-out ones; writes diag.json (texts and flags) to the
current folder.     .venv/bin/python docs/results/archive/issue22_coop_diag.py
"""
import os
import sys, json, re
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from collab_app.commands.evaluate import generate_joint
from collab_app.engines import make_engine
from collab_app.engines.engine_types import Sampling
from collab_app.engines.model import ensure_model
from tasks import load_task
task = load_task("humaneval")
out = {}
engine = make_engine("auto", model=ensure_model(None), num_agents=2)
for role in task.roles:
    engine.register_agent(role)
for split in ("train", "eval"):
    examples = task.examples(split)[::4] if split == "train" else task.examples(split)
    prompts = [task.agent_prompts(ex, []) for ex in examples]
    texts = generate_joint(engine, list(task.roles), prompts, Sampling(max_new_tokens=128, temperature=0.0, seed=0))
    rows = []
    for ex, t in zip(examples, texts):
        helper, main = t[0][0], t[1][0]
        r = task.reward(ex, [helper, main])
        rows.append({"id": ex["id"], "main_calls_aux_text": bool(re.search(r"\baux\s*\(", main.split("def aux")[0] if "def aux" in main else main)),
                     "main_defines_aux": "def aux" in main, "tests": r.levels["tests"], "coop": r.levels["cooperation"],
                     "details": {k: (r.details or {}).get(k) for k in ("calls_aux", "aux_reaches_return", "thin_wrapper")}})
    n = len(rows)
    print(split, n, "main text calls aux:", sum(x["main_calls_aux_text"] for x in rows), "main defines aux:", sum(x["main_defines_aux"] for x in rows),
          "some test passes:", sum(x["tests"] > 0 for x in rows), "calls aux AND some test passes:", sum(x["main_calls_aux_text"] and x["tests"] > 0 for x in rows),
          "coop>0:", sum(x["coop"] > 0 for x in rows))
    out[split] = {"rows": rows, "texts": [[t[0][0], t[1][0]] for t in texts]}
json.dump(out, open("diag.json", "w"), indent=1)
engine.close()
