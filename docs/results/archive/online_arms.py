"""`collab bench online` arms side by side: the same rater and flags, one thing varied, runs
alternated (A B, B A, ...), one server at a time. An ARM is a string of flags added to the
bench's `--serve-args` ("serve: ...") or `--trainer-args` ("trainer: ..."; a bare string is
trainer flags); "" = the defaults, "-" = no second arm. Used for serve's --lend-engine-cores
("The engine's cores lent to a step between rounds") and the trainer's --yield-share /
--no-pause-credit ("A step's pause paid from the trainer's idle time").

Per run: rounds and steps in the time given, the rounds' generate time (the person's wait), the
steps' working time (update minus pauses for rounds), pauses and pause credit, the share of the
working time on both sides' cores, the time from a rating to its step and to the first round
served from that step's version, and the mean rating of the last window of rounds.

    python docs/results/archive/online_arms.py OUT.json PAIRS ARM_A ARM_B [bench online flags ...]
    e.g. python docs/results/archive/online_arms.py /tmp/y.json 1 "" "--no-pause-credit" --minutes 3 --eval-points 0 \
             --min-groups 1 --trainer-args "--max-wait-s 0 --human-timeout-s 3600 --learning-rate 4e-3 --return-mode human_first"
         python docs/results/archive/online_arms.py /tmp/lend.json 2 "serve:" "serve:--no-lend-engine-cores" --minutes 4 \
             --think-s 10 --eval-points 0
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


def with_arm(arm: str, flags: list[str]) -> list[str]:
    """The bench's flags with the arm's flags appended to --serve-args or --trainer-args (the
    trainer's default --max-wait-s 0 --human-timeout-s 3600 where the flags name no trainer args:
    a step as soon as a group is rated, ratings never expire)."""
    side, _, extra = arm.partition(":") if arm.startswith(("serve:", "trainer:")) else ("trainer", "", arm)
    option = f"--{side}-args"
    flags = list(flags)
    if option in flags:
        k = flags.index(option)
        flags[k + 1] = f"{flags[k + 1]} {extra}".strip()
    else:
        base = "--max-wait-s 0 --human-timeout-s 3600 " if side == "trainer" else ""
        flags += [option, f"{base}{extra}".strip()]
    return _joined(flags)


def _joined(flags: list[str]) -> list[str]:
    """`--serve-args VALUE` as one `--serve-args=VALUE` (a value that starts with -- would be read as an option)."""
    out, k = [], 0
    while k < len(flags):
        if flags[k] in ("--serve-args", "--trainer-args") and k + 1 < len(flags):
            out.append(f"{flags[k]}={flags[k + 1]}")
            k += 2
        else:
            out.append(flags[k])
            k += 1
    return out


def one(arm: str, flags: list[str]) -> dict:
    out = tempfile.mkdtemp(prefix="arms-")
    load = open("/proc/loadavg").read().split()[:3]
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "collab_app.cli", "bench", "online", "--out-dir", os.path.join(out, "b"),
                    *with_arm(arm, flags)], check=True, stdout=subprocess.DEVNULL)
    res = json.load(open(os.path.join(out, "b", "bench_online.json")))
    steps = [s for s in res["steps"] if s["update_s"] is not None]
    work = [s["update_s"] - (s["paused_s"] or 0.0) for s in steps]
    wide = [s.get("wide_s") or 0.0 for s in steps]
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
            "wide_share": round(sum(wide) / sum(work), 3) if work and sum(work) else None,
            "rating_to_step_s_median": med([x["rating_to_step_s"] for x in lat]),
            "rating_to_served_s_median": med([x["rating_to_served_s"] for x in lat]),
            "last_window": last,
            "versions_served": res["summary"]["versions_served"][-1:] if res["summary"]["versions_served"] else []}


def main() -> None:
    path, pairs, a, b, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
    runs = []
    for k in range(pairs):
        for arm in [x for x in ((a, b) if k % 2 == 0 else (b, a)) if x != "-"]:
            runs.append(one(arm, flags))
            print(json.dumps(runs[-1]), flush=True)
            json.dump({"flags": flags, "runs": runs}, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
