"""The transformers engine's decode thread (engine_hf's doc, "Threads"): built with
decode_thread=True (as `collab serve` builds it), every batch and adapter load runs on the
process's one decode thread, whichever thread calls; the tokens are the caller-thread engine's;
an adapter load that arrives during a stream waits for it and deadlocks nothing."""
from __future__ import annotations

import threading

import pytest

from collab_app.engines.engine_types import EngineError, Request, Sampling
from helpers.engines import PROMPT, setup_agents

GREEDY = Sampling(max_new_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def threaded(model_path):
    from collab_app.engines.engine_hf import TransformersEngine

    # fp32: the tests compare tokens across batch shapes (n=1 against a shared prefill for n=2),
    # which bf16's rounding may tip at a near-tie; what they check is the threads
    eng = TransformersEngine(model_path, seed=0, decode_thread=True, dtype="float32")
    yield eng
    eng.close()


def _forward_threads(engine) -> list[int]:
    """Thread ids of every forward of the engine's base model from now on (a hook on its embedding)."""
    seen: list[int] = []
    engine.model.get_input_embeddings().register_forward_pre_hook(lambda *a: seen.append(threading.get_ident()))
    return seen


def test_every_batch_runs_on_the_one_decode_thread_with_the_callers_tokens(threaded, adapters, model_path):
    from collab_app.engines.engine_hf import TransformersEngine, decoder_thread

    caller = TransformersEngine(model_path, seed=0, dtype="float32")   # generates on the caller's thread
    reqs = [Request("a1", PROMPT), Request("base", PROMPT), Request("a2", PROMPT)]
    try:
        setup_agents(caller, adapters)
        want = [o[0].token_ids for o in caller.generate(reqs, 1, GREEDY)]
    finally:
        caller.close()
    setup_agents(threaded, adapters)
    seen = _forward_threads(threaded)
    assert [o[0].token_ids for o in threaded.generate(reqs, 1, GREEDY)] == want      # from this thread
    other: dict = {}
    t = threading.Thread(target=lambda: other.update(out=threaded.generate(reqs, 2, GREEDY)))
    t.start()
    t.join(120)
    assert [[s.token_ids for s in o] for o in other["out"]] == [[w, w] for w in want]   # from another thread
    last = list(threaded.generate_stream(reqs, 1, GREEDY))[-1]                             # a stream
    assert [d[0].token_ids for d in last.done] == want
    assert seen and set(seen) == {decoder_thread().ident} != {threading.get_ident()}
    # a daemon: stopping the process mid-round does not wait for the round
    assert next(t for t in threading.enumerate() if t.ident == decoder_thread().ident).daemon


def test_an_adapter_load_during_a_stream_waits_for_it(threaded, adapters, tmp_path):
    setup_agents(threaded, adapters)
    stream = threaded.generate_stream([Request("a1", "Tell me a long story about a cat.")], 2,
                                      Sampling(max_new_tokens=48, temperature=0.0))
    first = next(stream)          # the batch is running on the decode thread, on version 1
    assert not first.finished
    loaded = threading.Event()
    t = threading.Thread(target=lambda: (threaded.load_adapter("a1", adapters[2], 2), loaded.set()))
    t.start()
    assert not loaded.wait(0.5), "the new version went in under a running batch"
    rest = list(stream)
    t.join(120)
    assert loaded.is_set(), "the adapter load never finished (deadlock with the stream?)"
    assert {s.adapter_version for s in rest[-1].done[0]} == {1}
    (after,) = threaded.generate([Request("a1", PROMPT)], 1, GREEDY)
    assert after[0].adapter_version == 2
    threaded.load_adapter("a1", adapters[1], 1)   # back to what setup_agents expects
    with pytest.raises(EngineError, match="cannot load adapter"):   # an error on the decode thread reaches the caller
        threaded.load_adapter("a1", str(tmp_path), 3)
    assert threaded.adapter_version("a1") == 1
