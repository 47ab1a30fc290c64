"""A step's pause for a person's round (ServiceConfig.yield_share, pause_credit): `collab bench
online` with the same rater and trainer flags, the trainer's pause flags varied (an ARM is a
string of `collab trainer` flags: "--yield-share 0.5 --no-pause-credit", "--yield-share 0", ""
for the defaults), runs alternated, one server at a time. Per run: rounds and steps in the time given, the rounds'
generate time (the person's wait), the steps' working time and pauses, the time from a rating to
its step and to the first round served from that step's version, and the mean rating of the last
window of rounds (how far the team got).

    python docs/results/yield_share_online.py OUT.json PAIRS ARM_A ARM_B [bench online flags ...]
    e.g. python docs/results/yield_share_online.py /tmp/y.json 1 "" "--no-pause-credit" --minutes 3 --eval-points 0 \
             --min-groups 1 --trainer-args "--max-wait-s 0 --human-timeout-s 3600 --learning-rate 4e-3 --return-mode human_first"
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


def one(arm: str, flags: list[str]) -> dict:
    out = tempfile.mkdtemp(prefix="yield-")
    flags = list(flags)
    k = flags.index("--trainer-args") if "--trainer-args" in flags else None
    if k is None:
        flags += ["--trainer-args", f"--max-wait-s 0 --human-timeout-s 3600 {arm}"]
    else:
        flags[k + 1] += f" {arm}"
    load = open("/proc/loadavg").read().split()[:3]
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "collab_app.cli", "bench", "online", "--out-dir", os.path.join(out, "b"),
                    *flags], check=True, stdout=subprocess.DEVNULL)
    res = json.load(open(os.path.join(out, "b", "bench_online.json")))
    steps = [s for s in res["steps"] if s["update_s"] is not None]
    work = [s["update_s"] - (s["paused_s"] or 0.0) for s in steps]
    lat = res["latency"]
    rounds = res["rounds"]
    last = [w for ws in res["windows"].values() for w in ws][-1:] if res["windows"] else []
    return {"arm": arm, "out": out, "loadavg_start": load, "loadavg_end": res["loadavg_end"],
            "wall_s": round(time.time() - t0, 1), "rounds": len(rounds), "steps": len(steps),
            "groups_per_step": med([s["groups"] for s in steps]),
            "generate_s_median": med([r["generate_s"] for r in rounds]),
            "generate_s_mean": round(statistics.fmean(r["generate_s"] for r in rounds), 2) if rounds else None,
            "step_update_s_median": med([s["update_s"] for s in steps]),
            "step_work_s_median": med(work),
            "step_paused_s_median": med([s["paused_s"] for s in steps]),
            "step_pause_credit_s_median": med([s.get("pause_credit_s") for s in steps]),
            "step_work_s_per_group": round(sum(work) / max(1, sum(s["groups"] for s in steps)), 2),
            "rating_to_step_s_median": med([x["rating_to_step_s"] for x in lat]),
            "rating_to_served_s_median": med([x["rating_to_served_s"] for x in lat]),
            "last_window": last,
            "versions_served": res["summary"]["versions_served"][-1:] if res["summary"]["versions_served"] else []}


def main() -> None:
    path, pairs, a, b, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
    runs = []
    for k in range(pairs):
        for arm in [x for x in ((a, b) if k % 2 == 0 else (b, a)) if x != "-"]:   # "-": no second arm
            runs.append(one(arm, flags))
            print(json.dumps(runs[-1]), flush=True)
            json.dump({"flags": flags, "runs": runs}, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
