"""Load test: N simulated users (own gradio_client sessions) generate and rate at the same time
against a launched app (real engine and store). No errors, no lost ratings (the store holds
exactly the ratings the app acknowledged), and generate latency p50/p95.

    python tests/e2e/test_ui_load.py [--users 8] [--rounds 2] [--max-new-tokens 24]

prints the latencies (embedded model); under pytest it is one slow test (8 users x 2 rounds on the
tiny base model, seconds).
Concurrent Generate presses are merged into shared engine calls (collab_app.web.context.
GenerationBatcher): `batches` in the output is the number of examples per engine call.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from collab_app.commands.bench_online import predict

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # script mode: tests/ (helpers)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_load(url: str, problems: list[str], users: int, rounds: int) -> dict:
    from gradio_client import Client

    gen_s, rate_s, errors, acked = [], [], [], []
    lock = threading.Lock()
    start = threading.Barrier(users)

    def user(u: int) -> None:
        client = Client(url, verbose=False, analytics_enabled=False, download_files=False)
        start.wait()   # everyone presses Generate at the same moment
        for r in range(rounds):
            try:
                t0 = time.monotonic()
                out = predict(client, task="humaneval", problem=problems[(u + r * users) % len(problems)],
                              api_name="/generate")
                t1 = time.monotonic()
                ids = []
                for i, cand in enumerate(out["candidates"]):
                    msg = predict(client, joint_sample_id=cand["joint_sample_id"], rating=1 + (u + i) % 5,
                                  api_name="/rate")   # the rater is this client's session
                    ids.append(int(msg.split("#")[1]))
                t2 = time.monotonic()
                with lock:
                    gen_s.append(t1 - t0)
                    rate_s.append((t2 - t1) / max(1, len(ids)))
                    acked.extend(ids)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(f"user{u} round{r}: {type(e).__name__}: {e}")

    t = time.monotonic()
    with ThreadPoolExecutor(users) as pool:
        list(pool.map(user, range(users)))
    return {"users": users, "rounds": rounds, "wall_s": time.monotonic() - t, "errors": errors,
            "acked_ratings": acked, "generate_p50_s": percentile(gen_s, 0.5) if gen_s else None,
            "generate_p95_s": percentile(gen_s, 0.95) if gen_s else None,
            "rate_p50_s": percentile(rate_s, 0.5) if rate_s else None,
            "rate_p95_s": percentile(rate_s, 0.95) if rate_s else None, "generations": len(gen_s)}


def run(users: int = 8, rounds: int = 2, max_new_tokens: int = 24, home: str | None = None,
        model: str | None = None) -> dict:
    from helpers.launch import start_app

    home = home or tempfile.mkdtemp(prefix="collab-load-")
    demo, url, ctx = start_app(home, max_new_tokens=max_new_tokens, model=model)
    # the users all come from this machine, one client network, where they stand for visitors on
    # as many networks: no per-network cap on rounds in flight (tests/web/test_network_shares.py has it)
    ctx.limits.rounds_in_flight_per_network = 0
    try:
        problems = [ex["id"] for ex in ctx.tasks["humaneval"].examples("eval")]
        res = run_load(url, problems, users, rounds)
        stored = ctx.store.ratings_for()
        res["stored_ratings"] = len(stored)
        res["lost_ratings"] = sorted(set(res["acked_ratings"]) - {r.id for r in stored})
        res["groups"] = sum(ctx.store.stats()["groups"].values())
        res["batches"] = list(ctx.batcher().batches)
        res["raters"] = len({r.rater for r in stored})
        return res
    finally:
        demo.close()
        ctx.engine.close()


@pytest.mark.slow
def test_eight_users_generate_and_rate(tmp_path, tiny_model_path):
    """On the tiny base (tests/helpers/tiny_model.py): what is under test is the app's concurrency
    (sessions, batching, the store), not what the model writes; the embedded model made this test
    ~2 min of prefill on an AVX2 CPU (script mode above still runs it)."""
    import torch

    threads = torch.get_num_threads()
    try:
        res = run(users=8, rounds=2, home=str(tmp_path), model=tiny_model_path)
    finally:
        torch.set_num_threads(threads)
    print({k: v for k, v in res.items() if k != "acked_ratings"})
    assert res["errors"] == []
    assert res["generations"] == 16 and res["groups"] == 16
    assert res["stored_ratings"] == len(res["acked_ratings"]) == 32 and res["lost_ratings"] == []
    assert res["raters"] == 8               # one rater id per client session, none typed
    assert max(res["batches"]) > 1          # concurrent presses did share engine calls


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    a = ap.parse_args()
    r = run(a.users, a.rounds, a.max_new_tokens)
    print(f"users {r['users']} x rounds {r['rounds']}: {r['generations']} generations in {r['wall_s']:.1f} s, "
          f"errors {len(r['errors'])}, ratings acknowledged {len(r['acked_ratings'])} / stored "
          f"{r['stored_ratings']} (lost {len(r['lost_ratings'])})")
    print(f"generate latency p50 {r['generate_p50_s']:.1f} s, p95 {r['generate_p95_s']:.1f} s; "
          f"rate p50 {r['rate_p50_s'] * 1000:.0f} ms, p95 {r['rate_p95_s'] * 1000:.0f} ms; "
          f"examples per engine call {r['batches']}")
    for e in r["errors"]:
        print("error:", e)
    sys.exit(1 if r["errors"] or r["lost_ratings"] else 0)
