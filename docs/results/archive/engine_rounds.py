"""Rounds of one engine in this process, as `collab serve` builds it under its CPU split: 2 agents
with random rank-8 LoRA adapters (scale 2), 1 prompt x G=4 x 128 tokens, printed one per line.
The A/B of docs/results "LoRA deltas in fp32" ran this alternately before and after the change
(`git stash` between processes), one process at a time under `flock`:

    python docs/results/archive/engine_rounds.py vllm 8 bfloat16
    python docs/results/archive/engine_rounds.py transformers 6 bfloat16

NEW_TOKENS (default 128), LONG (the task text repeated, default 1) and PROMPTS (default 1; 16 =
`collab bench generate`'s rollout workload, 128 rows a step) shape the round.
EAGER=0 builds the vLLM engine compiled (`enforce_eager=False`, bf16 CPUs only); NOSPLIT=1 keeps
every core (no serve split); BORROW=1 keeps the split and lends the (idle) trainer's cores to the
decoding thread, as serve does between the trainer child's steps. The compiled-step profile and the op-registration A/B of docs/results
"What is left of a compiled step" ran

    EAGER=0 VLLM_USE_AOT_COMPILE=0 [NOSPLIT=1] python docs/results/archive/engine_rounds.py vllm 5 bfloat16
    py-spy record -r 40 --native -f raw -o prof.txt -- python docs/results/archive/engine_rounds.py vllm 4 bfloat16   # EAGER=0

GRADIO=1 serves an idle Gradio app (queue on) in this process, as `collab serve` does beside its
in-process engine; GRADIO_FREE_S sets its queue's idle poll (Gradio's own is 0.001 s; the A/B of
docs/results "Gradio's idle queue polls beside the engine").

With `stdin` for the count it runs one round per line it reads (docs/results/archive/ab_rounds.py drives two
of them, one per code version, round by round).
"""
import os
import sys
import time

from collab_app.cpu.cores import apply_to_serving, plan

split = plan(0)
if split is not None and os.environ.get("NOSPLIT") != "1":
    apply_to_serving(split)   # the engine on its share of the cores, as serve with its trainer child

from collab_app.commands.bench import ROLES, TASKS, make_random_lora  # noqa: E402
from collab_app.engines.engine_types import Sampling  # noqa: E402
from collab_app.engines.model import ensure_model  # noqa: E402
from collab_app.engines.team import Agent, Team  # noqa: E402

kind, rounds, dtype = sys.argv[1], sys.argv[2], sys.argv[3]   # rounds: a count, or "stdin" (one per line read)
quantize = sys.argv[4] if len(sys.argv) > 4 else None
path = ensure_model(None)
if kind == "vllm":
    from collab_app.engines.engine_vllm import VLLMEngine

    # NUM_AGENTS: the engine's agent slots (2 = one team; `collab serve` sizes them by every served
    # team's agents: 6 for make run's three tasks, as the race and the bench); LANES: a compiled
    # engine's in-graph LoRA lanes (default NUM_AGENTS; serve: its largest team, 2)
    lanes = {"lora_lanes": int(os.environ["LANES"])} if os.environ.get("LANES") else {}
    eng = VLLMEngine(path, dtype=dtype, max_model_len=1024, num_agents=int(os.environ.get("NUM_AGENTS", 2)), quantize=quantize,
                     enforce_eager=os.environ.get("EAGER", "1") == "1", **lanes)
else:
    from collab_app.engines.engine_hf import TransformersEngine

    eng = TransformersEngine(path, dtype=dtype, max_model_len=1024, decode_thread=True, quantize=quantize)
if split is not None and os.environ.get("NOSPLIT") != "1" and os.environ.get("BORROW") == "1":
    # as `collab serve` between the trainer child's steps: the decoding thread widens onto the
    # trainer's cores (a lease nobody else holds: the trainer is idle)
    import tempfile

    from collab_app.cpu.lending import lend_trainer_cores

    lend_trainer_cores(eng, split, os.path.join(tempfile.mkdtemp(prefix="engine-rounds-"), "trainer-cores.lock"))
if os.environ.get("GRADIO") == "1":
    import gradio as gr

    with gr.Blocks() as demo:
        box = gr.Textbox()
        gr.Button().click(lambda x: x, box, box)
    demo.queue()
    demo.launch(prevent_thread_lock=True, _frontend=False, quiet=True)
    if os.environ.get("GRADIO_FREE_S"):
        demo._queue.sleep_when_free = float(os.environ["GRADIO_FREE_S"])
team = Team([Agent(n, r) for n, r in ROLES.items()])
for i, a in enumerate(team.agents):
    eng.register_agent(a.name)
    eng.load_adapter(a.name, make_random_lora(path, f"/tmp/engine_rounds/{kind}-lora{i}", i, scale=2.0), 1)
sampling = Sampling(max_new_tokens=int(os.environ.get("NEW_TOKENS", 128)), temperature=0.8, seed=0)
# LONG=N: the task text repeated N times (a prefill-heavy round: LONG=130 is ~780 prompt
# tokens; the round's number leads the prompt, so no round reuses another's prefix cache)
task = " ".join([TASKS[0]] * int(os.environ.get("LONG", 1)))
prompts = int(os.environ.get("PROMPTS", 1))   # PROMPTS=16: the rollout workload's 16 prompts x G=4 a round
team.generate(eng, [[f"Task: {TASKS[0]}."] * 2], 1, Sampling(max_new_tokens=8, temperature=0.8))   # warm-up
print("pid", os.getpid(), "load", os.getloadavg()[0], flush=True)
for k, _ in enumerate(sys.stdin if rounds == "stdin" else range(int(rounds))):
    t, cpu = time.perf_counter(), os.times()
    text = f"Round {k}. Task: {task}." if os.environ.get("LONG") else f"Task: {task}."
    out = team.generate(eng, [[f"{text} ({i})"] * 2 for i in range(prompts)] if prompts > 1 else [[text] * 2], 4, sampling)
    used = os.times()
    print("round", round(time.perf_counter() - t, 2), sum(len(s.token_ids) for prompt in out for per in prompt for s in per),
          "cpu", round(used.user + used.system - cpu.user - cpu.system, 2), flush=True)   # this process's CPU seconds
eng.close()
