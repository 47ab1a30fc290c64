"""Paired in-process A/B of a MAGRPO update's forward layout (issue 19, the trainer on CPU). The same
rolled-out groups (tldr, 2 agents x G, aligned, NEW_TOKENS new tokens; the untrained team's
answers, some ending early at EOS) are updated again and again, arms alternating A B B A ...:

    THREADS=1 python docs/results/archive/passes_ab.py OLD_MAGRPO_PY [PAIRS [G [NEW_TOKENS]]]   # 4, 4, 64
    FLOPS=1 THREADS=1 python docs/results/archive/passes_ab.py OLD_MAGRPO_PY 0                  # the work instead

A: the layout of OLD_MAGRPO_PY (a trainer/magrpo.py from before `length_passes`, e.g.
`git show c47235d:trainer/magrpo.py > /tmp/old.py`): every row of a prompt padded to its longest
completion in one pass, the LM head over every padded position. B: this checkout's (rows in passes
of similar length, the LM head over real positions only). Only the two helpers differ; the
update, its loss and its optimizer are the same code.

Prints each agent's completion lengths and its passes, each update's seconds, then each arm's
median and B / A. FLOPS=1 (with PAIRS 0) profiles one update per arm instead (torch.profiler):
its GEMM work in GFLOP, its `aten::mm` seconds and its seconds, which do not move with the VM's
hour as a wall clock does. (max_staleness is lifted so the groups never go stale; the adapters move every
update.)
"""
import importlib.util
import os
import statistics
import sys
import tempfile
import time

import collab_app  # noqa: F401  (before torch: the OpenMP wait setting)
import torch

import trainer.magrpo as magrpo
from update_ab import rolled_out   # this folder: a script's own folder is on sys.path


def main(old_path: str, pairs: int = 4, G: int = 4, new_tokens: int = 64) -> None:
    spec = importlib.util.spec_from_file_location("magrpo_old", old_path)
    old = sys.modules["magrpo_old"] = importlib.util.module_from_spec(spec)   # (dataclasses look it up)
    spec.loader.exec_module(old)
    arms = {"A": (old._shared_prompt_hidden, old._completion_logprobs),
            "B": (magrpo._shared_prompt_hidden, magrpo._completion_logprobs)}
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    with tempfile.TemporaryDirectory() as tmp:
        trainer, groups = rolled_out(os.path.join(tmp, "adapters"), G, new_tokens)
        for g in groups:
            for i, a in enumerate(trainer.agents):
                lengths = [len(s.token_ids) for s in g.samples[i]]
                print(a, "prompt", len(g.samples[i][0].prompt_token_ids), "tokens", lengths,
                      "passes", [[lengths[b] for b in p] for p in magrpo.length_passes(lengths)])
        seconds = {"A": [], "B": []}
        for order in ("AB" if k % 2 == 0 else "BA" for k in range(pairs)):
            for arm in order:
                magrpo._shared_prompt_hidden, magrpo._completion_logprobs = arms[arm]
                t = time.perf_counter()
                m = trainer.update(groups)
                seconds[arm].append(time.perf_counter() - t)
                print(arm, f"{seconds[arm][-1]:.2f} s", "loss", [f"{m[f'{a}/loss']:.4g}" for a in trainer.agents],
                      flush=True)
        if os.environ.get("FLOPS") == "1":
            from torch.profiler import ProfilerActivity, profile

            for arm in "AB":
                magrpo._shared_prompt_hidden, magrpo._completion_logprobs = arms[arm]
                with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
                    t = time.perf_counter()
                    trainer.update(groups)
                    t = time.perf_counter() - t
                ev = prof.key_averages()
                mm = sum(e.self_cpu_time_total for e in ev if e.key == "aten::mm") / 1e6
                print(arm, f"{sum(e.flops for e in ev) / 1e9:.0f} GFLOP, aten::mm {mm:.2f} s, update {t:.2f} s")
        magrpo._shared_prompt_hidden, magrpo._completion_logprobs = arms["B"]
    if not pairs:
        return
    for arm, s in seconds.items():
        print(arm, "median", round(statistics.median(s), 2), [round(x, 2) for x in s])
    print("B / A", round(statistics.median(seconds["B"]) / statistics.median(seconds["A"]), 3))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:5]))
