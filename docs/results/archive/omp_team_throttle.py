"""Which thread layouts make libgomp throttle its spinning (docs/results "An idle engine's thread
slowed the rest of its process"). Each case in a fresh process; times one small parallel op
(F.linear rows x 576 -> 1536, then relu, the embedded model's MLP width) on the thread that
computes, in microseconds:

    A  the main thread alone
    B  another thread computes; the main thread never ran a parallel op
    C  the main thread ran one parallel op (its OpenMP team lives on), another thread computes
    D  the main thread computes while another thread's team is alive and idle
    E  as C, with the main thread's team shrunk to one thread before

libgomp lets idle workers spin for GOMP_SPINCOUNT between parallel regions only while the live
teams hold no more threads than the process has cores; past that every region wakes its workers
with a futex. collab_app sets GOMP_SPINCOUNT (imported first, as the app does).

    python docs/results/archive/omp_team_throttle.py
"""
import os, subprocess, sys
CASE = r'''
import os, sys, threading, time
import collab_app
import torch
rows = int(sys.argv[2]); case = sys.argv[1]
x = torch.randn(rows, 576); w = torch.randn(1536, 576)
def bench():
    for _ in range(100): torch.nn.functional.linear(x, w).relu_()
    t = time.perf_counter(); n = 3000
    for _ in range(n): torch.nn.functional.linear(x, w).relu_()
    return (time.perf_counter() - t) / n * 1e6
def on_thread(fn):
    out = []
    th = threading.Thread(target=lambda: out.append(fn())); th.start(); th.join(); return out[0]
stop = threading.Event()
def idle_team():
    torch.nn.functional.linear(x, w); stop.wait()
if case == "A":       # main thread only
    us = bench()
elif case == "B":     # a worker thread computes, main never ran a parallel op
    us = on_thread(bench)
elif case == "C":     # main ran a parallel op once (its team exists), a worker thread computes
    torch.nn.functional.linear(x, w); us = on_thread(bench)
elif case == "D":     # main computes while another thread's team is alive and idle
    threading.Thread(target=idle_team, daemon=True).start(); time.sleep(0.3); us = bench()
elif case == "E":     # as C, main's team shrunk to 1 thread first
    torch.nn.functional.linear(x, w); torch.set_num_threads(1); torch.nn.functional.linear(x, w); torch.set_num_threads(2); us = on_thread(bench)
print(f"{us:.1f}")
stop.set()
'''
for rows in (8, 64):
    for case in "ABCDE":
        r = subprocess.run([sys.executable, "-c", CASE, case, str(rows)], capture_output=True, text=True)
        print(rows, case, r.stdout.strip() or r.stderr[-300:], flush=True)
