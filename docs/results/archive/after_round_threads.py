"""Which threads of an engine-race child use CPU after its round: per-thread CPU-s every 0.25 s for 5 s.

    python docs/results/archive/after_round_threads.py vllm|transformers
"""
import sys, time, psutil
import collab_app  # noqa
from collab_app.engines.engine_race import _Child
from collab_app.engines.model import ensure_model
kind = sys.argv[1]
c = _Child(kind, ensure_model(None))
print(c.start(), flush=True)
try:
    for r in range(2):
        time.sleep(6)
        print("round", c.round(), flush=True)
        p = psutil.Process(c._proc.pid)
        last = {t.id: t.user_time + t.system_time for t in p.threads()}
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 5:
            time.sleep(0.25)
            now = {t.id: t.user_time + t.system_time for t in p.threads()}
            busy = {tid: round(v - last.get(tid, 0), 2) for tid, v in now.items() if v - last.get(tid, 0) > 0.01}
            names = {}
            for tid in busy:
                try:
                    names[tid] = open(f"/proc/{c._proc.pid}/task/{tid}/comm").read().strip()
                except OSError:
                    names[tid] = "?"
            print(f"{time.perf_counter() - t0:4.2f}", {f"{names[t]}:{t}": v for t, v in busy.items()}, flush=True)
            last = now
finally:
    c.close()
