"""First words of a lone person's round with the batcher's old fixed window and with the company
rule (engines/batcher.py), paired: the same engine (as `collab serve` builds it, engine auto, G=2 x
2 agents x <= 256 tokens, TL;DR texts), rounds alternating old / new, through the handler
(H.generate: the page's and the API's path, without Gradio and the browser). Prints JSON lines and
a summary. The engine is seeded per call where it can be (vLLM), so a text's two rounds are alike.

    python docs/results/archive/first_words_window.py HOME PAIRS     # from the repository root

HOME: a new folder (its store); the model and this machine's calibration come from COLLAB_HOME as
`make run` left them (no calibration or engine race inside the figures)."""
import json, os, statistics, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from collab_app.commands.bench_online import use_home

home = use_home(sys.argv[1])   # before the app's modules read COLLAB_HOME
from collab_app.engines.batcher import GenerationBatcher
from collab_app.web import handlers as H
from collab_app.web.access import Caller
from collab_app.web.context import build_context
from tasks import load_task

pairs = int(sys.argv[2])
ctx = build_context(engine="auto", home=home, task_names=("tldr",), decode_thread=True,
                    limits={"max_rounds_per_minute": 0, "max_rounds_per_minute_per_network": 0})
texts = [ex["text"] for ex in load_task("tldr").examples("train")]
forms = {"window (old)": dict(company_s=None), "company (new)": dict()}
res = {k: [] for k in forms}
for k in range(-1, pairs):                       # k = -1: a warm-up pair, not counted
    order = list(forms) if k % 2 == 0 else list(forms)[::-1]
    for name in order:
        ctx._batcher = GenerationBatcher(ctx.engine, ctx.engine_lock, lambda: ctx.adapter_watcher().poll_once(),
                                         max_examples=max(ctx.generate_concurrency, 1), **forms[name])
        ep = H.start_writing(ctx, "tldr", texts[max(k, 0) % len(texts)])
        t0, first = time.perf_counter(), None
        for ev in H.generate(ctx, ep, Caller(f"web:first-words-{name}-{k}")):
            if first is None and ev["kind"] == "progress" and any(p["text"] for c in ev["candidates"] for p in c["parts"]):
                first = time.perf_counter() - t0
        total = time.perf_counter() - t0
        if k >= 0:
            res[name].append({"pair": k, "first_s": round(first, 3), "round_s": round(total, 2)})
            print(json.dumps({"form": name, **res[name][-1]}), flush=True)
summary = {name: {"first_s_median": statistics.median(r["first_s"] for r in rs),
                  "first_s_mean": round(statistics.mean(r["first_s"] for r in rs), 3),
                  "round_s_median": statistics.median(r["round_s"] for r in rs)} for name, rs in res.items()}
diffs = [a["first_s"] - b["first_s"] for a, b in zip(res["window (old)"], res["company (new)"])]
summary["paired old - new first_s"] = {"median": round(statistics.median(diffs), 3), "min": round(min(diffs), 3),
                                       "max": round(max(diffs), 3), "n": len(diffs)}
summary["machine"] = {"load_avg": os.getloadavg(), "engine": ctx.engine.name}
print(json.dumps(summary, indent=1))
ctx.engine.close()
