"""The transformers engine on a CPU, two arms alternated in one process (paired A/B):

    python docs/results/archive/hf_engine_ab.py attention PAIRS   # trainer.dtypes._fp32_attention on / off, one bf16 engine
    python docs/results/archive/hf_engine_ab.py dtype PAIRS       # two engines: bf16, and fp32 on fp16-weight base GEMMs

Per arm: a rollout of tests/trainer/test_learning.py's shape (its one TL;DR text, 2 agents x G=8,
40 new tokens, version 0 adapters), a streamed round of 2 agents x 4 rows x 128 tokens (the
engine built as `collab serve` builds it, decode_thread=True), and for `attention` one MAGRPO
update of the trainer on the same groups (its bf16 forward and backward). Medians and every run.
"""
import os
import statistics
import sys
import tempfile
import time

import collab_app  # noqa: F401 - before torch (OpenMP's wait policy)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "trainer"))

import trainer.dtypes as dtypes  # noqa: E402
from collab_app.engines import make_engine  # noqa: E402
from collab_app.engines.engine_types import Request, Sampling  # noqa: E402
from collab_app.engines.model import ensure_model  # noqa: E402
from collab_app.engines.sampler import EngineSampler  # noqa: E402
from test_learning import OneTextTLDR, tldr_config  # noqa: E402
from trainer.magrpo import MAGRPOTrainer, rollout  # noqa: E402

ON = {"fp32 attention": True}
_rule = dtypes._fp32_attention
dtypes._fp32_attention = lambda q: ON["fp32 attention"] and _rule(q)


def main() -> None:
    mode, pairs = sys.argv[1], int(sys.argv[2])
    model = ensure_model(None)
    task = OneTextTLDR()
    cfg = tldr_config(model, num_steps=1)
    trainer = MAGRPOTrainer(cfg, task, tempfile.mkdtemp())
    if mode == "attention":
        arms = ("fp32 attention", "bf16 attention")
        engine = make_engine("transformers", model=model, seed=0, dtype="bfloat16", decode_thread=True)
        engines = dict.fromkeys(arms, engine)
    else:
        arms = ("bfloat16", "float32")
        engines = {d: make_engine("transformers", model=model, seed=0, dtype=d, decode_thread=True) for d in arms}
    for e in set(engines.values()):
        for role in task.roles:
            e.register_agent(role)
        trainer.load_into(EngineSampler(e))
    examples = task.examples("train")
    groups = rollout(EngineSampler(engines[arms[0]]), task, examples, cfg, seed=1)   # the update's data, and a warm-up
    requests = [Request(agent=r, prompt="Task: write a short story about a cat who learns to swim.") for r in task.roles]
    sampling = Sampling(max_new_tokens=128, temperature=0.8, seed=0)
    times = {(a, w): [] for a in arms for w in ("rollout", "round", "update")}
    for k in range(pairs):
        for arm in (arms if k % 2 == 0 else arms[::-1]):
            ON["fp32 attention"] = arm != "bf16 attention"
            e = engines[arm]
            t = time.perf_counter()
            rollout(EngineSampler(e), task, examples, cfg, seed=1 + k)
            times[arm, "rollout"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for _ in e.generate_stream(requests, 4, sampling):
                pass
            times[arm, "round"].append(time.perf_counter() - t)
            if mode == "attention":
                t = time.perf_counter()
                trainer.update(groups)
                times[arm, "update"].append(time.perf_counter() - t)
    print(f"load average at the end {os.getloadavg()}; {getattr(engines[arms[1]], 'quantize', None)=}")
    for (arm, what), xs in times.items():
        if xs:
            print(f"{arm:16s} {what:8s} median {statistics.median(xs):.3f} s  {[round(x, 2) for x in xs]}")
    for what in ("rollout", "round", "update"):
        a, b = times[arms[0], what], times[arms[1], what]
        if a:
            print(f"{what}: {arms[0]} / {arms[1]} = {statistics.median(a) / statistics.median(b):.3f}")


if __name__ == "__main__":
    main()
