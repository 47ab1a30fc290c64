"""Issue 22: what the held-out cooperation of a trained team is made of. Loads each agent's newest
adapter version from a `collab train` run's adapters/ folder, answers the 32 held-out HumanEval
problems greedily (128 tokens, as the trainer's eval), and counts per answer from the reward's own
run-time probe (tasks/coding.py `cooperation`): main calls aux, aux's result reaches main's return,
main is only a thin wrapper around aux, and the cooperation level.

    COLLAB_CALIBRATE=0 .venv/bin/python docs/results/archive/issue22_coop_trained.py runs/he-team-g8-s3-amx/adapters out.json
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from collab_app.commands.evaluate import generate_joint  # noqa: E402
from collab_app.engines import make_engine  # noqa: E402
from collab_app.engines.engine_types import Sampling  # noqa: E402
from collab_app.engines.model import ensure_model  # noqa: E402
from tasks import load_task  # noqa: E402
from trainer.adapters import latest_version  # noqa: E402

adapters_dir, out_path = sys.argv[1], sys.argv[2]
task = load_task("humaneval")
engine = make_engine("auto", model=ensure_model(None), num_agents=2)
versions = {}
for role in task.roles:
    engine.register_agent(role)
    versions[role], path = latest_version(adapters_dir, role)
    engine.load_adapter(role, path, versions[role])
examples = task.examples("eval")
texts = generate_joint(engine, list(task.roles), [task.agent_prompts(ex, []) for ex in examples],
                       Sampling(max_new_tokens=128, temperature=0.0, seed=0))
engine.close()
rows = []
for ex, t in zip(examples, texts):
    helper, main = t[0][0], t[1][0]
    r = task.reward(ex, [helper, main])
    d = r.details or {}
    rows.append({"id": ex["id"], "return": r.total, "tests": r.levels["tests"], "cooperation": r.levels["cooperation"],
                 "calls_aux": d.get("calls_aux"), "aux_reaches_return": d.get("aux_reaches_return"),
                 "thin_wrapper": d.get("thin_wrapper"), "helper": helper, "main": main})
n = len(rows)
summary = {"adapters": adapters_dir, "versions": versions, "problems": n,
           "return_mean": round(sum(r["return"] for r in rows) / n, 3),
           "cooperation_level_mean": round(sum(r["cooperation"] for r in rows) / n, 3),
           "main_calls_aux": sum(bool(r["calls_aux"]) for r in rows),
           "aux_reaches_return": sum(bool(r["aux_reaches_return"]) for r in rows),
           "of_those_thin_wrappers": sum(bool(r["aux_reaches_return"] and r["thin_wrapper"]) for r in rows),
           "of_those_some_test_passes": sum(bool(r["aux_reaches_return"] and r["tests"] > 0) for r in rows)}
print(json.dumps(summary))
with open(out_path, "w") as f:
    json.dump({"summary": summary, "rows": rows}, f, indent=1)
