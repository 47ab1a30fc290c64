"""A paired A/B of two code versions' engine rounds: both engines alive at once (one process per
version, each `engine_rounds.py ... stdin` from its own tree), rounds alternated A B B A A B ..., so
the two sides share every minute of the VM's hour. Why: on the 2-vCPU VMs used here a round moves by
up to 40% within an hour (docs/results "What is left of a compiled step"), which swamped A/Bs of
whole processes run one after the other; what a pair shares (the minute's level) cancels in its
ratio. Back-to-back rounds still differ by up to ~30% (the same CPU seconds: the cores themselves
run slower), so a 3-10% difference needs 20-50 pairs. Only one side runs at a time (the other
waits on its stdin), so two torch processes never spin together.

    python docs/results/archive/ab_rounds.py TREE_A TREE_B PAIRS [engine_rounds args: vllm bfloat16]
    e.g. EAGER=0 python docs/results/archive/ab_rounds.py /work/main /tmp/wt-b 30 vllm bfloat16

Prints each pair, then the median round of each side and the paired ratio B/A (geometric mean of
the pairs' ratios with a 95% bootstrap interval), and a line if the sides' rounds generated
different numbers of tokens (an early EOS); JSON on the last line.

GAP_S (default 0) sleeps that long before each round: a side whose OpenMP workers keep spinning
after its round (a large GOMP_SPINCOUNT) would otherwise take a core from the other side's next
round; a gap longer than the spin lets both start from parked workers, as a person's rounds do.
"""
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time


def start(tree: str, args: list[str], side: str) -> subprocess.Popen:
    own = dict(kv.split("=", 1) for kv in os.environ.get(f"ENV_{side}", "").split())
    env = dict(os.environ, PYTHONPATH=tree, **own)
    proc = subprocess.Popen([sys.executable, f"{tree}/docs/results/archive/engine_rounds.py", args[0], "stdin", *args[1:]],
                            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:                      # warm-up done when it prints its pid
        if line.startswith("pid"):
            return proc
    raise RuntimeError(f"the engine from {tree} exited before its first round (rc {proc.wait()})")


def one_round(proc: subprocess.Popen) -> tuple[float, int]:
    """(seconds, tokens generated) of one round."""
    proc.stdin.write("go\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("round"):
            return float(line.split()[1]), int(line.split()[2])
    raise RuntimeError(f"an engine exited mid-round (rc {proc.wait()})")


def main() -> None:
    tree_a, tree_b, pairs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    args = sys.argv[4:] or ["vllm", "bfloat16"]
    gap = float(os.environ.get("GAP_S", 0))
    load0 = os.getloadavg()
    sides = {"A": start(tree_a, args, "A"), "B": start(tree_b, args, "B")}
    times, tokens = {"A": [], "B": []}, {"A": [], "B": []}
    t0 = time.time()
    for k in range(pairs):
        for side in ("AB" if k % 2 == 0 else "BA"):   # counterbalanced: neither side always goes first
            time.sleep(gap)
            seconds, n = one_round(sides[side])
            times[side].append(seconds)
            tokens[side].append(n)
        print(f"pair {k}: A {times['A'][-1]:.2f} s  B {times['B'][-1]:.2f} s", flush=True)
    for proc in sides.values():
        proc.stdin.close()
        proc.wait()
    logs = [math.log(b / a) for a, b in zip(times["A"], times["B"])]
    mean = statistics.fmean(logs)
    rng = random.Random(0)                        # bootstrap of the mean log-ratio: no t-table needed
    boot = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(10000))
    low, high = boot[250], boot[9749]
    out = {"A": tree_a, "B": tree_b, "args": args, "pairs": pairs, "eager": os.environ.get("EAGER", "1"),
           "nosplit": os.environ.get("NOSPLIT", "0"), "gap_s": gap,
           "env_A": os.environ.get("ENV_A", ""), "env_B": os.environ.get("ENV_B", ""),
           "median_A_s": round(statistics.median(times["A"]), 3), "median_B_s": round(statistics.median(times["B"]), 3),
           "ratio_B_over_A": round(math.exp(mean), 4),
           "ratio_95": [round(math.exp(low), 4), round(math.exp(high), 4)],
           "rounds_A": times["A"], "rounds_B": times["B"], "tokens_A": tokens["A"], "tokens_B": tokens["B"],
           "minutes": round((time.time() - t0) / 60, 1),
           "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()]}
    print(f"median A {out['median_A_s']} s, B {out['median_B_s']} s; B/A {out['ratio_B_over_A']} "
          f"(95% {out['ratio_95'][0]}-{out['ratio_95'][1]}) over {pairs} pairs")
    if tokens["A"] != tokens["B"]:   # a side that stops early (EOS) does less work: say so
        print(f"tokens per round differ: A {statistics.fmean(tokens['A']):.0f}, B {statistics.fmean(tokens['B']):.0f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
