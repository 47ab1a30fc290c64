"""RemoteVLLMEngine against a fake vLLM server that can restart, go down and drop streams.

The fake speaks the part of vLLM's OpenAI API the engine uses, with vLLM 0.32.0's messages: a
name it does not know is `404 The model `x` does not exist.`; a restart forgets every adapter
name, as the real server does. It answers in milliseconds, so the recovery logic (reload the lost
names, retry once; back off on connection errors) is covered in seconds; tests/engines/test_engine_remote.py
restarts a real vLLM server.
"""
from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from collab_app.engines.engine_remote import RemoteVLLMEngine
from collab_app.engines.engine_types import EngineError, Request, Sampling

BASE = "fake-base"
SAMPLING = Sampling(max_new_tokens=3, temperature=0.7)
TOKENS = (101, 102, 103)


class FakeVLLM:
    """A vLLM OpenAI server stand-in on one loopback port that survives its own restarts."""

    def __init__(self):
        self.loaded: dict[str, str] = {}     # adapter name -> path
        self.loads: list[str] = []           # every name loaded, in order
        self.served: list[str] = []          # the model of every completion answered with 200
        self.forget_on_load = False          # accept loads but keep nothing (a 404 that persists)
        self.drop_streams = 0                # the next k streams end after one chunk, without [DONE]
        self.logprobs_mode = "processed_logprobs"   # the engine's start-up check asks (non-streamed)
        self._lock = threading.Lock()
        self._httpd = None
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):   # quiet
                pass

            def _send(self, status: int, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    with fake._lock:
                        names = list(fake.loaded)
                    self._send(200, {"data": [{"id": BASE, "parent": None, "max_model_len": 512}] +
                                     [{"id": n, "parent": BASE, "max_model_len": 512} for n in names]})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/load_lora_adapter":
                    with fake._lock:
                        fake.loads.append(body["lora_name"])
                        if not fake.forget_on_load:
                            fake.loaded[body["lora_name"]] = body["lora_path"]
                    self._send(200, {"message": "Success"})
                elif self.path == "/v1/unload_lora_adapter":
                    with fake._lock:
                        known = fake.loaded.pop(body["lora_name"], None) is not None
                    if known:
                        self._send(200, {"message": "Success"})
                    else:
                        self._send(404, {"error": {"message": f"The lora adapter '{body['lora_name']}' cannot be "
                                                   f"found.", "type": "NotFoundError", "code": 404}})
                elif self.path == "/v1/completions":
                    self._complete(body)
                else:
                    self._send(404, {"detail": "Not Found"})

            def _complete(self, body):
                model = body["model"]
                if not body.get("stream"):   # the log-prob mode probe: one token's top log-probs
                    t = 1.0 if fake.logprobs_mode == "raw_logprobs" else body["temperature"]
                    logits = [0.0, -1.0, -2.0, -3.0, -4.0]
                    norm = math.log(sum(math.exp(x / t) for x in logits))
                    top = {f"token_id:{tok}": x / t - norm for tok, x in zip(TOKENS + (104, 105), logits)}
                    self._send(200, {"choices": [{"index": 0, "text": ".", "logprobs": {"top_logprobs": [top]},
                                                  "finish_reason": "length"}]})
                    return
                with fake._lock:
                    known = model == BASE or model in fake.loaded
                    drop = fake.drop_streams > 0 and known
                    fake.drop_streams -= drop
                    if known and not drop:
                        fake.served.append(model)
                if not known:
                    self._send(404, {"error": {"message": f"The model `{model}` does not exist. Valid aliases: "
                                               f"{BASE}.", "type": "NotFoundError", "param": "model", "code": 404}})
                    return
                self.send_response(200)   # HTTP/1.0, no length: the body ends when the connection closes
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                k = len(body["prompt"]) if isinstance(body["prompt"][0], list) else body["n"]
                for t, tok in enumerate(TOKENS[:body["max_tokens"]]):
                    last = t == min(len(TOKENS), body["max_tokens"]) - 1
                    for j in range(k):
                        choice = {"index": j, "text": f"[{model}]" if t == 0 else ".", "token_ids": [tok],
                                  "logprobs": {"token_logprobs": [-0.5], "tokens": [f"token_id:{tok}"]},
                                  "finish_reason": "length" if last else None}
                        self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                    self.wfile.flush()
                    if drop:
                        return   # the server "dies" after its first chunk
                self.wfile.write(b"data: [DONE]\n\n")

        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        """The process is gone: connections are refused until start()."""
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            self.loaded.clear()   # a restarted server knows no adapter names

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def fake():
    server = FakeVLLM()
    yield server
    server.stop()


def _engine(fake, model_path, **kw) -> RemoteVLLMEngine:
    eng = RemoteVLLMEngine(model_path, fake.url, **kw)
    eng.register_agent("base")
    eng.load_adapter("a1", "/adapters/a1/v000001", 1)
    eng.load_adapter("a2", "/adapters/a2/v000001", 1)
    return eng


def _served(out) -> list[tuple[str, str, int | None]]:
    """(agent, the adapter name the fake served, version) per request."""
    rows = []
    for row in out:
        assert len({s.text for s in row}) == 1 and all(s.token_ids == list(TOKENS) for s in row)
        rows.append((row[0].agent, row[0].text.split("]")[0][1:], row[0].adapter_version))
    return rows


REQS = [Request("a1", "Hi"), Request("a2", "Hi"), Request("a1", "Hello"), Request("base", "Hi")]


def test_restart_reloads_lost_adapter_names_and_retries(fake, model_path):
    """After a restart the server answers 404 for the old names: every agent's adapter is loaded
    again once (same path and version, new name) and each request retried: the round is served.
    A version swapped in afterwards is served too."""
    eng = _engine(fake, model_path)
    try:
        before = _served(eng.generate(REQS, 2, SAMPLING))
        fake.restart()
        loads = len(fake.loads)
        after = _served(eng.generate(REQS, 2, SAMPLING))
        assert [(a, v) for a, _, v in after] == [(a, v) for a, _, v in before] == \
               [("a1", 1), ("a2", 1), ("a1", 1), ("base", None)]
        reloaded = fake.loads[loads:]
        assert sorted(n.split("@")[0] for n in reloaded) == ["a1", "a2"], "one reload per agent, not per row"
        assert {n for _, n, _ in after} == {*reloaded, BASE} and not {n for _, n, _ in before} & set(reloaded)
        assert sorted(fake.loaded.values()) == ["/adapters/a1/v000001", "/adapters/a2/v000001"]

        eng.load_adapter("a1", "/adapters/a1/v000002", 2)    # versions advance after the restart
        assert _served(eng.generate(REQS[:1], 1, SAMPLING))[0][2] == 2
        assert sorted(fake.loaded.values()) == ["/adapters/a1/v000002", "/adapters/a2/v000001"]
    finally:
        eng.close()
    assert fake.loaded == {}, "close() unloads the reloaded names"


def test_a_404_that_persists_after_the_reload_is_an_error(fake, model_path):
    eng = _engine(fake, model_path)
    try:
        fake.restart()
        fake.forget_on_load = True
        with pytest.raises(EngineError, match="The model `a1@v1~.*` does not exist.*again after reloading"):
            eng.generate([Request("a1", "Hi")], 1, SAMPLING)
        assert fake.served == []
    finally:
        eng.close()


def test_server_back_within_retry_s_serves_the_request(fake, model_path):
    """Connection refused while the server restarts: retried with back-off; once it is back the
    request gets the restarted server's 404, reloads, and is served."""
    eng = _engine(fake, model_path, retry_s=10)
    try:
        fake.stop()
        threading.Timer(0.8, fake.start).start()
        t0 = time.monotonic()
        out = _served(eng.generate(REQS, 1, SAMPLING))
        assert time.monotonic() - t0 < 8
        assert [(a, v) for a, _, v in out] == [("a1", 1), ("a2", 1), ("a1", 1), ("base", None)]
    finally:
        eng.close()


def test_server_down_longer_than_retry_s_is_a_clear_error_then_recovers(fake, model_path):
    eng = _engine(fake, model_path, retry_s=1)
    try:
        fake.stop()
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=f"lost the vLLM server at {fake.url}.*did not come back within"):
            eng.generate(REQS, 1, SAMPLING)
        with pytest.raises(EngineError, match="did not come back within"):
            eng.load_adapter("a1", "/adapters/a1/v000002", 2)
        assert time.monotonic() - t0 < 6
        assert eng.adapter_version("a1") == 1, "a failed load keeps the version served"
        fake.start()
        assert [v for _, _, v in _served(eng.generate(REQS, 1, SAMPLING))] == [1, 1, 1, None]
        eng.load_adapter("a1", "/adapters/a1/v000002", 2)
        assert _served(eng.generate(REQS[:1], 1, SAMPLING))[0][2] == 2
    finally:
        eng.close()


def test_a_stream_dropped_mid_way_starts_its_row_over(fake, model_path):
    eng = _engine(fake, model_path)
    try:
        want = eng.generate(REQS, 2, SAMPLING)
        fake.drop_streams = 2
        snaps = list(eng.generate_stream(REQS, 2, SAMPLING))
        got = snaps[-1].result()
        assert [[(s.text, s.token_ids, s.logprobs, s.adapter_version) for s in row] for row in got] == \
               [[(s.text, s.token_ids, s.logprobs, s.adapter_version) for s in row] for row in want]
        assert fake.drop_streams == 0
    finally:
        eng.close()


def test_a_server_with_untempered_logprobs_is_refused_and_samples_record_their_sampling(fake, model_path):
    """vLLM's default --logprobs-mode (raw_logprobs) gives untempered log-probs at any temperature:
    the trainer's ratio would be off by the temperature, so the engine refuses the server at start
    and names the flag. A processed_logprobs server's samples record the sampling that drew them."""
    fake.logprobs_mode = "raw_logprobs"
    with pytest.raises(EngineError, match="--logprobs-mode processed_logprobs"):
        RemoteVLLMEngine(model_path, fake.url)
    fake.logprobs_mode = "processed_logprobs"
    eng = _engine(fake, model_path)
    try:
        (row,) = eng.generate(REQS[:1], 2, SAMPLING)
        assert [s.meta["sampling"] for s in row] == [{"temperature": 0.7, "top_p": 1.0}] * 2
    finally:
        eng.close()


# -- wiring: make_engine and `collab serve` pass retry_s through --------------------------------

def test_remote_kw_are_the_engines_keywords():
    """make_engine passes exactly RemoteVLLMEngine's keywords through: a new one cannot be dropped."""
    import inspect

    from collab_app.engines.choose import REMOTE_KW

    params = set(inspect.signature(RemoteVLLMEngine.__init__).parameters) - {"self", "model_path"}
    assert set(REMOTE_KW) == params


def test_make_engine_passes_retry_s(fake, model_path):
    from collab_app.engines import make_engine

    eng = make_engine(fake.url, model_path, retry_s=0.5, num_agents=3, dtype="auto")   # in-process-only keys dropped
    try:
        assert isinstance(eng, RemoteVLLMEngine) and eng.retry_s == 0.5
        eng.load_adapter("a1", "/adapters/a1/v000001", 1)
        fake.stop()
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="did not come back within"):
            eng.generate([Request("a1", "Hi")], 1, SAMPLING)
        assert time.monotonic() - t0 < 4
        fake.start()
        assert _served(eng.generate([Request("a1", "Hi")], 1, SAMPLING))[0][2] == 1
    finally:
        eng.close()


def test_serve_sets_retry_s_only_for_a_remote_engine(monkeypatch):
    from collab_app.web.serve import ServeConfig, engine_kwargs
    from trainer.configcli import parse_config

    monkeypatch.delenv("COLLAB_ENGINE", raising=False)
    cfg, _ = parse_config(ServeConfig, ["--engine-url", "http://127.0.0.1:8000", "--engine-retry-s", "2.5"],
                          description="x")
    assert cfg.engine_retry_s == 2.5 and engine_kwargs(cfg) == {"retry_s": 2.5}
    # in-process engines: no retry window; the transformers engine's decode thread (vLLM drops it)
    assert engine_kwargs(ServeConfig()) == {"decode_thread": True, "max_lora_rank": 8}
    assert engine_kwargs(ServeConfig(engine="transformers")) == {"decode_thread": True, "max_lora_rank": 8}
    monkeypatch.setenv("COLLAB_ENGINE", "http://127.0.0.1:8000")      # auto -> the URL, as make_engine reads it
    assert engine_kwargs(ServeConfig(engine_retry_s=0)) == {"retry_s": 0}
    assert engine_kwargs(ServeConfig(engine="vllm")) == {"decode_thread": True, "max_lora_rank": 8}
    # the same rule decides that serve does not split the cores for its trainer child: the
    # generating engine is elsewhere (before, COLLAB_ENGINE=URL still split them)
    from collab_app.web.serve import remote_engine_url
    assert remote_engine_url(ServeConfig()) == "http://127.0.0.1:8000" and remote_engine_url(ServeConfig(engine="vllm")) == ""
    with pytest.raises(ValueError, match="engine_retry_s must be >= 0"):
        ServeConfig(engine_retry_s=-1)
