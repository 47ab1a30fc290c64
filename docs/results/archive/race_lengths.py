"""The engine race at several round lengths: does the 32-token race round rank the engines as a
person's longer rounds do? Each engine in a child process as `collab models`' race builds it
(engines/engine_race.py), started one after the other; then PASSES passes, each asking every
child for one round of every length in turn (the order rotated each pass), so a drift of the
machine falls on all of them.

    python docs/results/archive/race_lengths.py PASSES LENGTH [LENGTH ...] [--engines vllm transformers] [--gap S]

Before each round it waits, as the race does, until no child uses the CPU (engine_race.wait_quiet:
a round right after another child's round shares the cores with that child's still-spinning
OpenMP workers); --no-wait turns that off, --gap S sleeps S seconds instead or as well.

Prints per engine and length the best and median round, and per length the ratio
vllm / transformers of the medians and of each pass's pair.
"""
import argparse
import statistics
import time

import collab_app  # noqa: F401  (before torch: the OpenMP wait setting)
from collab_app.engines.engine_race import _Child, wait_quiet
from collab_app.engines.model import ensure_model

p = argparse.ArgumentParser()
p.add_argument("passes", type=int)
p.add_argument("lengths", type=int, nargs="+")
p.add_argument("--engines", nargs="+", default=["vllm", "transformers"])
p.add_argument("--gap", type=float, default=0.0, help="seconds of sleep before each round")
p.add_argument("--no-wait", action="store_true", help="do not wait for the children to go quiet before a round")
a = p.parse_args()
model = ensure_model(None)
children = {}
try:
    for kind in a.engines:
        children[kind] = _Child(kind, model)
        print(kind, children[kind].start(), flush=True)
    times = {(k, n): [] for k in a.engines for n in a.lengths}
    waits = []
    for i in range(a.passes):
        order = a.engines[i % len(a.engines):] + a.engines[:i % len(a.engines)]
        for n in a.lengths:
            for kind in order:
                time.sleep(a.gap)
                waited = 0.0 if a.no_wait else wait_quiet(children.values())
                got = children[kind].round(n)
                times[kind, n].append(got.get("round_s", float("nan")))
                waits.append(waited)
        print("pass", i, {f"{k} {n}": v[-1] for (k, n), v in times.items()}, "waited", [round(w, 2) for w in waits[-len(a.engines) * len(a.lengths):]], flush=True)
    for (kind, n), v in times.items():
        print(f"{kind:14s} {n:4d} tokens: best {min(v):.2f} s, median {statistics.median(v):.2f} s", flush=True)
    if len(a.engines) == 2:
        x, y = a.engines
        for n in a.lengths:
            pairs = [round(u / w, 3) for u, w in zip(times[x, n], times[y, n])]
            print(f"{n:4d} tokens: {x} / {y} medians {statistics.median(times[x, n]) / statistics.median(times[y, n]):.3f},"
                  f" per pass {pairs}", flush=True)
finally:
    for child in children.values():
        child.close()
