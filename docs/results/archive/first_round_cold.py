"""A person's first rounds after the server starts: first words and round time of ROUNDS TL;DR
rounds in turn through the handler (H.generate: the page's and the API's path), the engine built
as `collab serve` builds it (engine auto, G=2 x 2 agents x <= 256 tokens, no trainer). Is the first
round after start-up slower than the next ones (kernels made or code paths run for the first
time), and by how much?

    python docs/results/archive/first_round_cold.py HOME ROUNDS     # from the repository root

HOME: a new folder (its store); the model and this machine's calibration come from COLLAB_HOME as
`make run` left them."""
import json, os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from collab_app.commands.bench_online import use_home

home = use_home(sys.argv[1])   # before the app's modules read COLLAB_HOME
from collab_app.web import handlers as H
from collab_app.web.access import Caller
from collab_app.web.context import build_context
from tasks import load_task

t0 = time.perf_counter()
ctx = build_context(engine="auto", home=home, task_names=("tldr",), decode_thread=True,
                    limits={"max_rounds_per_minute": 0, "max_rounds_per_minute_per_network": 0})
print(json.dumps({"built_s": round(time.perf_counter() - t0, 2), "engine": ctx.engine.name,
                  "load": os.getloadavg()[0]}), flush=True)
texts = [ex["text"] for ex in load_task("tldr").examples("train")]
if os.environ.get("WARM"):   # WARM=1: one short batch of a long prompt before the rounds (a start-up warm-up)
    from collab_app.engines.engine_types import Sampling
    team = ctx.team_for("tldr")
    t0 = time.perf_counter()
    team.generate(ctx.engine, [[texts[-1]] * len(team.agents)], 2, Sampling(max_new_tokens=2, temperature=0.8))
    print(json.dumps({"warm_up_s": round(time.perf_counter() - t0, 2)}), flush=True)
for k in range(int(sys.argv[2])):
    ep = H.start_writing(ctx, "tldr", texts[k % len(texts)])
    t0, first = time.perf_counter(), None
    for ev in H.generate(ctx, ep, Caller(f"web:first-round-{k}")):
        if first is None and ev["kind"] == "progress" and any(p["text"] for c in ev["candidates"] for p in c["parts"]):
            first = time.perf_counter() - t0
    print(json.dumps({"round": k, "first_s": round(first, 3), "round_s": round(time.perf_counter() - t0, 2),
                      "load": os.getloadavg()[0]}), flush=True)
ctx.engine.close()
