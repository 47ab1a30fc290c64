"""The engine's cores lent to the trainer child between rounds: `collab bench online` with a rater
who reads for a while before rating (--think-s), serve's default (--lend-engine-cores) against
--no-lend-engine-cores, runs alternated, one server at a time. Per run: the steps' working time
(update minus pauses for rounds), the share of it spent on both sides' cores, the time from a
rating to the step that took it and to the first round served from that step's version, and the
rounds' generate time (the person's wait, which must not grow).

    python docs/results/lend_engine_cores.py OUT.json PAIRS [bench online flags ...]
    e.g. python docs/results/lend_engine_cores.py /tmp/lend.json 2 --minutes 4 --think-s 10 --eval-points 0
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


def one(lend: bool, flags: list[str]) -> dict:
    out = tempfile.mkdtemp(prefix="lend-")
    serve = "--serve-args=" + ("" if lend else "--no-lend-engine-cores")
    load = open("/proc/loadavg").read().split()[:3]
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "collab_app.cli", "bench", "online", "--out-dir", os.path.join(out, "b"),
                    serve, *flags], check=True, stdout=subprocess.DEVNULL)
    res = json.load(open(os.path.join(out, "b", "bench_online.json")))
    steps = [s for s in res["steps"] if s["update_s"] is not None]
    work = [s["update_s"] - (s["paused_s"] or 0.0) for s in steps]
    wide = [s["wide_s"] or 0.0 for s in steps]
    lat = res["latency"]
    return {"lend": lend, "out": out, "loadavg_start": load, "loadavg_end": res["loadavg_end"],
            "wall_s": round(time.time() - t0, 1), "rounds": len(res["rounds"]), "steps": len(steps),
            "groups_per_step": med([s["groups"] for s in steps]),
            "step_work_s_median": med(work), "step_work_s_per_group": round(sum(work) / max(1, sum(s["groups"] for s in steps)), 2),
            "wide_share": round(sum(wide) / sum(work), 3) if work else None,
            "rating_to_step_s_median": med([x["rating_to_step_s"] for x in lat]),
            "rating_to_served_s_median": med([x["rating_to_served_s"] for x in lat]),
            "generate_s_median": med([r["generate_s"] for r in res["rounds"]]),
            "versions_served": res["summary"]["versions_served"][-1:] if res["summary"]["versions_served"] else []}


def main() -> None:
    path, pairs, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    runs = []
    for k in range(pairs):
        for lend in ((True, False) if k % 2 == 0 else (False, True)):
            runs.append(one(lend, flags))
            print(json.dumps(runs[-1]), flush=True)
            json.dump({"flags": flags, "runs": runs}, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
