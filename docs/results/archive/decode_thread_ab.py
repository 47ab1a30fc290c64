import sys, time, json
sys.path.insert(0, ".")
from collab_app.engines.engine_hf import TransformersEngine
from collab_app.engines.engine_types import Request, Sampling
from collab_app.engines.model import ensure_model
mp = ensure_model()
dt = sys.argv[1] == "1"
eng = TransformersEngine(mp, seed=0, decode_thread=dt)
for k in (1, 2):
    eng.register_agent(f"a{k}"); eng.load_adapter(f"a{k}", f"/tmp/pf_a{k}", 1)
P = "Write a short story about a robot who learns to paint."
reqs = [Request("a1", P), Request("a2", P)]
s = Sampling(max_new_tokens=128, temperature=0.8, seed=1)
eng.generate(reqs, 1, Sampling(max_new_tokens=4))
ts = []
for _ in range(2):
    t = time.perf_counter(); list(eng.generate_stream(reqs, 4, s)); ts.append(round(time.perf_counter() - t, 2))
print(json.dumps({"decode_thread": dt, "stream_s": ts}))
