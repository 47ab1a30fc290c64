"""The run of tests/trainer/test_learning.py with its learning rate, step count and seed as
arguments: prints the mean return of every step (each step's first rollout) and their spreads.
A learning rate of 1e-9 is the no-learning control (the config refuses 0): its steps are version
0's draws at each step's seed, which the test now rolls out directly. The figures in that test's
docstring came from

    python docs/results/learning_runs.py 2e-3 8 1      # trained, seed 1
    python docs/results/learning_runs.py 1e-9 8 1      # the control at the same seeds

(COLLAB_CALIBRATE=0 as in the suite; the AVX2 column under the emulation's variables.)
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "trainer"))

from collab_app.engines import make_engine  # noqa: E402
from collab_app.engines.model import ensure_model  # noqa: E402
from collab_app.engines.sampler import EngineSampler  # noqa: E402
from test_learning import OneTextTLDR, tldr_config  # noqa: E402
from trainer.magrpo import MAGRPOTrainer  # noqa: E402

lr, steps, seed = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0
model = ensure_model(None)
cfg = tldr_config(model, learning_rate=lr, num_steps=steps, seed=seed)
task = OneTextTLDR()
trainer = MAGRPOTrainer(cfg, task, tempfile.mkdtemp())
engine = make_engine("transformers", model=model, seed=seed)
for role in task.roles:
    engine.register_agent(role)
history = trainer.train(EngineSampler(engine))
print("lr", lr, "seed", seed, "returns", [round(m["return_mean"], 3) for m in history], flush=True)
print(json.dumps({k: [round(m[k], 3) for m in history] for k in ("return_mean", "return_std", "zero_variance_frac")}))
