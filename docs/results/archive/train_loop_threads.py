"""`collab train`'s loop with the vLLM engine on a thread of its own (DT=1, as before 2026-11-30)
or on the trainer's thread (DT=0, `VLLMEngine(decode_thread=False)`, what `collab train` builds now):
test_learning's set-up (one TLDR text, G=8 per agent, cross joint actions, 40 new tokens) for
STEPS steps (default 4); prints each step's time/update_s and time/rollout_s, the returns (equal
for both: same seeds, same tokens) and the loop's seconds. docs/results "An idle engine's thread
slowed the rest of its process" ran DT=1, 0, 1, 0, one process at a time under one lock:

    COLLAB_CALIBRATE=0 DT=0 python docs/results/archive/train_loop_threads.py [vllm|transformers]
"""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "trainer"))

from collab_app.engines import make_engine  # noqa: E402
from collab_app.engines.model import ensure_model  # noqa: E402
from collab_app.engines.sampler import EngineSampler  # noqa: E402
from test_learning import OneTextTLDR, tldr_config  # noqa: E402
from trainer.magrpo import MAGRPOTrainer  # noqa: E402

kind = sys.argv[1] if len(sys.argv) > 1 else "vllm"
model_path = ensure_model()
cfg = tldr_config(model_path, num_steps=int(os.environ.get("STEPS", 4)))
task = OneTextTLDR()
trainer = MAGRPOTrainer(cfg, task, os.path.join(tempfile.mkdtemp(), "adapters"))
engine = make_engine(kind, model=model_path, seed=0, num_agents=2, decode_thread=os.environ.get("DT", "1") == "1")
for role in task.roles:
    engine.register_agent(role)
t = time.time()
history = trainer.train(EngineSampler(engine))
loop = time.time() - t
for m in history:
    print({k: round(v, 2) for k, v in m.items() if k in ("time/update_s", "time/rollout_s")}, round(m["return_mean"], 3))
print("loop", round(loop, 1), "s; returns", [round(m["return_mean"], 2) for m in history], "; load", os.getloadavg()[0])
engine.close()
