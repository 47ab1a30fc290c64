"""One contestant of the engine race (engine_race.py), in a process of its own: builds its engine
as `collab serve` would, warms it up, then times one round per line it reads on stdin and answers
with JSON lines on stdout. `python -m collab_app.engines.race_child KIND MODEL_PATH`."""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from collab_app.engines.engine_race import NEW_TOKENS, NUM_GENERATIONS, ROLES, TASK, child_engine_kwargs

def _child(kind: str, model_path: str) -> None:
    """In the child: build `kind` as `collab serve` does and warm it up, print its start-up, then
    one timed round for each "round" line on stdin until stdin closes (module doc)."""
    from collab_app.engines.choose import make_engine
    from collab_app.engines.engine_types import Sampling
    from collab_app.engines.model import make_random_lora
    from collab_app.engines.team import Agent, Team

    t = time.perf_counter()
    engine = make_engine(kind.removesuffix("-compiled"), model_path, **child_engine_kwargs(kind))
    startup = time.perf_counter() - t
    try:
        team = Team([Agent(name, role) for name, role in ROLES.items()])
        with tempfile.TemporaryDirectory() as tmp:
            for k, agent in enumerate(team.agents):
                engine.register_agent(agent.name)
                engine.load_adapter(agent.name, make_random_lora(model_path, Path(tmp) / f"lora{k}", k, scale=2.0), 1)
        prompt = [[TASK] * 2]
        team.generate(engine, prompt, 1, Sampling(max_new_tokens=8, temperature=0.8, seed=0))   # warm-up
        print(json.dumps({"startup_s": round(startup, 1), "dtype": getattr(engine, "dtype", None),
                          "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                          "peak_mb": _peak_rss_mb()}),
              flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] != "round":
                continue
            new_tokens = int(words[1]) if len(words) > 1 else NEW_TOKENS
            t = time.perf_counter()
            for _ in team.generate_stream(engine, prompt, NUM_GENERATIONS,
                                          Sampling(max_new_tokens=new_tokens, temperature=0.8, seed=0)):
                pass
            print(json.dumps({"round_s": round(time.perf_counter() - t, 2)}), flush=True)
    finally:
        engine.close()


def _peak_rss_mb() -> float:
    """This process's peak resident memory so far, MB (vLLM's engine core runs in it, engine_vllm;
    inductor's compile workers, a pool of their own processes, are not counted)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss          # KiB on Linux, bytes on macOS
    return round(peak / 2 ** 20 if sys.platform == "darwin" else peak / 2 ** 10)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _child(sys.argv[1], sys.argv[2])
