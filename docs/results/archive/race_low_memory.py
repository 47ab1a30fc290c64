"""The engine race (engine_race.race) with the machine's free memory reported as `sys.argv[1]` MB
(psutil patched): which groups form, and the peaks the real children report. Run it with a
scratch COLLAB_HOME (a copy of calibration.json): the race's entry is cached there.

    COLLAB_HOME=/tmp/racehome python docs/results/archive/race_low_memory.py 3500 [MODEL_DIR]

MODEL_DIR defaults to the embedded model as `make run` provisioned it (~/.cache/collab/models/...).
"""
import json, logging, os, sys, time
from types import SimpleNamespace
import psutil
from collab_app.engines import engine_race

free_mb = float(sys.argv[1])
real = psutil.virtual_memory
psutil.virtual_memory = lambda: SimpleNamespace(available=free_mb * 2 ** 20)
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
t = time.perf_counter()
model = sys.argv[2] if len(sys.argv) > 2 else os.path.expanduser("~/.cache/collab/models/smollm2-135m-instruct")
entry = engine_race.race(model, refresh=True)
print(json.dumps({k: entry.get(k) for k in ("engine", "compile", "groups", "why", "took_s")}, indent=1))
print(json.dumps(entry["engines"], indent=1))
print("real available now MB", round(real().available / 2**20))
