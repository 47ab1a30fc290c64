"""Start-up of a compiled vLLM engine (bf16, enforce_eager=False) built in a process where another
vLLM engine (fp32, eager, as the test suite's session engine) is alive, was built and closed, or
was never built; then three short generations. docs/results "vLLM's cached environment":

    python docs/results/archive/second_engine_start.py alive|closed|alone
"""
import sys
import time

from collab_app.engines.engine_types import Request, Sampling
from collab_app.engines.engine_vllm import VLLMEngine
from collab_app.engines.model import ensure_model

if __name__ == "__main__":
    path, mode = ensure_model(), sys.argv[1]
    if mode != "alone":
        first = VLLMEngine(path, dtype="float32", num_agents=8, seed=0)
        first.register_agent("base")
        first.generate([Request("base", "Hello")], 2, Sampling(max_new_tokens=8, temperature=0.5))
        if mode == "closed":
            first.close()
    t = time.time()
    eng = VLLMEngine(path, dtype="bfloat16", enforce_eager=False, num_agents=3, seed=0)
    start = time.time() - t
    eng.register_agent("base")
    for _ in range(3):
        t = time.time()
        eng.generate([Request("base", "Hello there")], 2, Sampling(max_new_tokens=24, temperature=0.5))
        print(f"generate {time.time() - t:.2f} s", flush=True)
    print(f"{mode}: compiled engine start-up {start:.1f} s", flush=True)
