"""An OpenAI-compatible door to the team, so that other apps use it and teach it.

Routes (JSON; errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`):
- `GET /v1/models`, `GET /v1/models/{model}`: the teams, one "model" per task of the app, with a
  `collab` object (roles, agents, adapter versions, reward levels, the server's G);
- `POST /v1/chat/completions`: `model` (a task), the last user message as the prompt, `n` joint
  answers (= G), sampling, `stream`; a coding prompt is a HumanEval prompt as shipped or the
  caller's own problem with tests in the `"collab"` extension. Each choice carries its joint
  answer and a `collab` object (ids, reward, parts); streaming sends progress chunks, then each
  choice's whole joint answer;
- `POST /v1/ratings` (alias `/v1/feedback`): stars, a reward in [0, 1], a ranking or a pick of
  the best; the answer says whether the rating will train (`trains`, `late`, `notes`);
- the blind arena (web/arena.py): `POST /v1/arena/pairs` {task, text?, example_id?} two unnamed
  team states' answers, `POST /v1/arena/votes` {match_id, winner a | b | tie} the reveal,
  `GET /v1/arena/leaderboard?task=` the board.

One core, two doors: this module only translates requests into `core.play_round`,
`core.store_feedback` and web/arena.py's `arena_pair` / `arena_vote` / `arena_board`, and their
results into OpenAI's shapes; the core's refusals (access.UserError) map to statuses in
`_from_user_error` (429 with Retry-After for limits).

Keys: `Authorization: Bearer <key>` from $COLLAB_API_KEYS and/or a file (`load_api_keys`); no key
configured = every route answers 404 (never open by default). A key's id (`api:` + a SHA-256
prefix) is its session and its rater, so only the key that generated a group may rate it; the
per-key limits are access.Limits, as the app's per session. Bodies are bounded in size and JSON
depth; a stream whose client stops reading ends after `stream_stall_s` (`_RoundStream`).

Mounting: `openai_routes(ctx, cfg)` for `ui.launch(..., app_kwargs={"routes": ...})`;
`mount_openai(app, ctx, cfg)` for any FastAPI app. The full request and response shapes, the
limits and what is left out on purpose: docs/ARCHITECTURE.md "The OpenAI-compatible door".
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import numbers
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from collab_app.web import core
from collab_app.web.access import API, AdminGuard, Caller, Quota, UserError, admin_token_problem, api_caller

log = logging.getLogger(__name__)

KEYS_ENV = "COLLAB_API_KEYS"
KEY_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logprobs",
               "top_logprobs", "stop", "logit_bias", "audio", "modalities", "prediction")
"""request fields a team round cannot honour: refused when set (not null / false / empty)."""
NEUTRAL_ZERO = ("frequency_penalty", "presence_penalty")
"""accepted only at 0 (what clients send by default)."""


# --------------------------------------------------------------------------- config and keys

@dataclass(frozen=True)
class OpenAIConfig:
    """Settings of the OpenAI-compatible endpoint (`collab serve --api-*` flags)."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """accepted Bearer keys (never in repr / logs); empty = the endpoint is off (every route answers 404 saying so)."""
    max_rounds_per_minute: int = 10
    """chat completions (rounds) one key may start per minute (0 = no limit)."""
    max_ratings_per_minute: int = 60
    """ratings one key may store per minute; a ranking or pick of G counts G (0 = no limit)."""
    max_rounds_in_flight: int = 2
    """rounds one key may have generating at once (0 = no limit); more get 429."""
    max_concurrent_rounds: int = 8
    """API rounds running at once over all keys (each holds a worker thread); more get 429."""
    max_n: int = 4
    """largest `n` (joint answers per request)."""
    max_tokens: int = 1024
    """largest `max_tokens` (new tokens per agent) a request may ask for."""
    max_body_bytes: int = 1_000_000
    """largest request body; bigger ones get 413 before they are read in full."""
    max_json_depth: int = 32
    """deepest nesting of arrays / objects in a request body (a chat request needs about 5); deeper gets 400."""
    stream_stall_s: float = 30.0
    """a streamed round whose client takes longer than this to accept one chunk (stopped reading,
    or gone without a close) is ended: its slot and the key's round in flight are given back."""

    def __post_init__(self):
        keys = tuple(self.api_keys)
        for k, key in enumerate(keys):
            if not isinstance(key, str) or any(c.isspace() or c == "," for c in key):
                problem = "it must be text without spaces or commas"
            else:
                problem = admin_token_problem(key) if key else "it is empty"
            if problem:   # never the key itself in the message: it ends up in logs
                raise ValueError(f"API key #{k + 1} is too weak or malformed: {problem}; make one with `{KEY_HINT}`")
        object.__setattr__(self, "api_keys", tuple(dict.fromkeys(keys)))
        for name in ("max_rounds_per_minute", "max_ratings_per_minute", "max_rounds_in_flight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a whole number >= 0 (0 = no limit), got {v!r}")
        for name in ("max_concurrent_rounds", "max_n", "max_tokens", "max_body_bytes", "max_json_depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
        if isinstance(self.stream_stall_s, bool) or not (isinstance(self.stream_stall_s, (int, float))
                                                         and 0 < self.stream_stall_s < math.inf):
            raise ValueError(f"stream_stall_s must be a number of seconds > 0, got {self.stream_stall_s!r}")


def load_api_keys(keys_file: str = "", environ: dict | None = None) -> tuple[str, ...]:
    """The keys in $COLLAB_API_KEYS (comma-separated) and in `keys_file` (one per line, blank lines and
    `#` comments skipped). A missing or unreadable file is an error: a typo must not turn the
    endpoint off silently."""
    environ = os.environ if environ is None else environ
    keys = [k.strip() for k in environ.get(KEYS_ENV, "").split(",") if k.strip()]
    if keys_file:
        try:
            with open(keys_file, encoding="utf-8") as f:
                keys += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
        except OSError as e:
            raise ValueError(f"API keys file {keys_file!r} cannot be read ({e.strerror}): give an existing "
                             "file with one key per line") from None
    return tuple(keys)


def key_id(key: str) -> str:
    """The server's id for a key: `api:` + 16 hex digits of its SHA-256 (session id and rater)."""
    return "api:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _last(events, first: dict | None) -> dict:
    """core.play_round to its end: the "done" event (its last)."""
    ev = first
    for ev in events:
        pass
    if ev is None or ev["kind"] != "done":
        raise RuntimeError("generate ended without a result")
    return ev


@dataclass(frozen=True)
class _Round:
    """One checked chat request, ready to run."""

    episode: dict
    model: str
    n: int
    sampling: Any
    """engine_types.Sampling of this request (max_tokens, temperature, top_p)."""
    notes: list
    trains: bool
    stream: bool
    include_usage: bool


# --------------------------------------------------------------------------- errors

class ApiError(Exception):
    """A request refused with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_STATUS = {"rate_limit_exceeded": (429, "rate_limit_error"), "rounds_in_flight": (429, "rate_limit_error"),
           "server_busy": (429, "rate_limit_error"), "not_entitled": (403, "permission_error"),
           "not_found": (404, "not_found_error"), "store_busy": (503, "server_error"),
           "busy": (503, "server_error")}
_KEPT_CODES = ("nothing_to_compare", "engine_refused")
"""400s whose own code the answer keeps (a client can tell them apart without the message)."""


def _from_user_error(e: UserError, param: str | None = None) -> ApiError:
    """The core's refusal as an ApiError, by its code: limits 429 (Retry-After when it can fit
    later), another session's group 403, an unknown id 404, a busy store or busy arena slots 503
    (Retry-After: nothing was stored, send it again), anything else 400 invalid_value (or its own
    code where it is one of _KEPT_CODES: e.g. nothing_to_compare, an arena with one team state)."""
    status, type_ = _STATUS.get(e.code, (400, "invalid_request_error"))
    code = e.code if e.code in _STATUS or e.code in _KEPT_CODES else "invalid_value"
    headers = ({"Retry-After": str(max(1, math.ceil(e.retry_after)))}
               if status in (429, 503) and e.retry_after else None)
    return ApiError(status, str(e), type_, code, param, headers)


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def _int(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"{name} must be a whole number from {lo} to {hi}, got {v!r:.40}", name)
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v)
    if not ok or not (lo < v if lo_open else lo <= v) or v > hi:
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _bad(f"{name} must be a number in {rng}, got {v!r:.40}", name)
    return float(v)


def _id(body: dict, name: str, source: str = "a chat completion's collab object") -> int:
    v = body.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _bad(f"{name} must be a positive whole number (an id from {source}), got {v!r:.40}", name)
    return v


def _text(body: dict, name: str) -> str:
    v = body.get(name)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise _bad(f"{name} must be a string, got {type(v).__name__}", name)
    return v


def _fields(body: dict, allowed: tuple[str, ...], what: str) -> None:
    extra = sorted(set(body) - set(allowed))
    if extra:
        raise _bad(f"{what} takes {', '.join(allowed)}; unknown field(s) {extra!r:.200}", extra[0], "unknown_parameter")


def _too_deep(value: Any, limit: int) -> bool:
    """Whether parsed JSON nests lists / dicts more than `limit` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            if d > limit:
                return True
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


# --------------------------------------------------------------------------- the API

class OpenAIApi:
    """The endpoint's state (keys, limiters, slots) over one AppContext; `router()` has the routes."""

    def __init__(self, ctx, cfg: OpenAIConfig):
        self.ctx, self.cfg = ctx, cfg
        self._keys = {hashlib.sha256(k.encode()).hexdigest(): key_id(k) for k in cfg.api_keys}
        # the API's quota in the app's one limits policy (the global rating budget stays shared)
        ctx.limits.set_quota(API, Quota(cfg.max_rounds_per_minute, cfg.max_ratings_per_minute,
                                        cfg.max_rounds_in_flight, cfg.max_concurrent_rounds, scope="API key"))
        self.key_guard = AdminGuard()   # wrong keys per client network: 5 free, then 2, 4, 8 ... s locked
        self._problems: dict[str, dict[str, tuple[str, str]]] = {}   # coding task -> {prompt as shipped: (split, id)}
        self._problems_lock = threading.Lock()
        self.created = int(time.time())

    # -- checks --------------------------------------------------------------------------

    def caller(self, request) -> Caller:
        if not self._keys:
            raise ApiError(404, "the OpenAI-compatible API is off on this server: no API key is configured. "
                                f"Set {KEYS_ENV}=<key>[,<key>...] or `collab serve --api-keys-file FILE` and "
                                "restart.", "invalid_request_error", "api_disabled")
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "missing API key: send `Authorization: Bearer <key>`", "authentication_error",
                           "missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        from collab_app.web.identity import STATE_NETWORK

        network = (request.scope.get("state") or {}).get(STATE_NETWORK)
        guard = f"net:{network}" if network else "no-network"
        wait = self.key_guard.locked(guard)
        if wait:   # every key from there is refused while locked, a right one too: else guessing is not slowed
            secs = max(1, math.ceil(wait))
            raise ApiError(429, f"too many invalid API keys from your network: try again in {secs} s",
                           "rate_limit_error", "too_many_invalid_keys", headers={"Retry-After": str(secs)})
        kid = self._keys.get(hashlib.sha256(key.strip().encode()).hexdigest())
        if kid is None:   # a right key does not clear the count: a guesser holding one key could reset it
            self.key_guard.failed(guard)
            raise ApiError(401, "invalid API key", "authentication_error", "invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return api_caller(kid, network)

    async def json_body(self, request) -> dict:
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {int(declared):,} bytes; the limit is {limit:,}",
                           "invalid_request_error", "body_too_large")
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise ApiError(413, f"request body is over the limit of {limit:,} bytes",
                               "invalid_request_error", "body_too_large")
        depth = self.cfg.max_json_depth
        try:
            body = json.loads(bytes(buf))
        except RecursionError:   # the parser's own stack ran out: "[" * 100000
            raise _bad(f"the request body nests arrays / objects deeper than {depth} levels", None,
                       "invalid_json") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
        if _too_deep(body, depth):   # parsed, but nothing here needs it, and recursive code would choke
            raise _bad(f"the request body nests arrays / objects deeper than {depth} levels", None, "invalid_json")
        return body

    # -- models --------------------------------------------------------------------------

    def model_card(self, name: str) -> dict:
        ctx = self.ctx
        task, team = ctx.tasks[name], ctx.team_for(name)
        return {"id": name, "object": "model", "created": self.created, "owned_by": "collab",
                "collab": {"kind": task.kind,
                           "roles": list(task.roles), "agents": [a.name for a in team.agents],
                           "adapter_versions": {a.name: ctx.engine.adapter_version(a.name) for a in team.agents},
                           "levels": list(task.level_names), "max_reward": task.max_reward,
                           "num_generations": ctx.num_generations,
                           "prompt": (f"a function signature + docstring: a {task.title} problem as shipped, or your "
                                      "own with collab.tests") if task.kind == "coding" else "the text to work on"}}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card(n) for n in self.ctx.tasks]}

    def _model(self, name: Any) -> str:
        if not isinstance(name, str) or name not in self.ctx.tasks:
            raise ApiError(404, f"model {name!r:.80} does not exist: use one of {sorted(self.ctx.tasks)} "
                                "(GET /v1/models)", "invalid_request_error", "model_not_found", "model")
        return name

    # -- a round ---------------------------------------------------------------------------

    def _problem_index(self, model: str) -> dict[str, tuple[str, str]]:
        """{prompt as shipped: (split, id)} of a coding task that lists its problems."""
        with self._problems_lock:
            if model not in self._problems:
                task = self.ctx.tasks[model]
                self._problems[model] = {ex["prompt"].strip(): (split, ex["id"])
                                         for split in ("eval", "train") for ex in task.examples(split)}
            return self._problems[model]

    @staticmethod
    def _prompt(messages: Any) -> tuple[Any, int]:
        if not isinstance(messages, list) or not messages:
            raise _bad("messages must be a non-empty list of {role, content}; the last one (role 'user') "
                       "is the prompt", "messages")
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{k}] must be an object with a 'role' and a 'content'", "messages")
        last = messages[-1]
        if last["role"] != "user":
            raise _bad(f"the last message must be the user's prompt (role 'user'), got role {last['role']!r:.20}",
                       "messages")
        content = last.get("content")
        if isinstance(content, list):   # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise _bad(f"only text content is supported, got a {kind!r:.30} part", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        return content, len(messages) - 1

    def _episode(self, model: str, prompt: str, extra: dict) -> dict:
        ctx = self.ctx
        for k in extra:
            if k not in ("tests", "entry_point"):
                raise _bad(f"collab.{k:.40} is not known: collab accepts tests and entry_point (coding teams)",
                           "collab")
        if ctx.tasks[model].kind != "coding":
            if extra:
                raise _bad(f"collab.tests / entry_point apply to coding teams only; {model!r} is a writing team",
                           "collab")
            return core.start_writing(ctx, model, prompt)
        if extra.get("tests") is not None:
            return core.start_coding(ctx, core.OWN_PROBLEM, "eval", "", prompt, extra["tests"],
                                  extra.get("entry_point") or "")
        if extra.get("entry_point") is not None:
            raise _bad("collab.entry_point needs collab.tests (your own problem)", "collab")
        task = ctx.tasks[model]
        found = self._problem_index(model).get(prompt.strip()) if task.lists_problems else None
        if found is None:
            raise _bad(f"model {model!r} scores code with tests: send a {task.title} problem's prompt as shipped, or "
                       "your own signature + docstring with its tests in collab.tests (openai client: "
                       "extra_body={'collab': {'tests': 'assert f(1) == 2'}})", "messages", "tests_required")
        split, example_id = found
        return core.start_coding(ctx, core.problem_source(task), split, example_id, "", "", "")

    def prepare_round(self, body: dict) -> "_Round":
        """A chat request, checked (ApiError says what is wrong), as the round to run."""
        from collab_app.engines.engine_types import Sampling
        from collab_app.online.returns import PRIVATE_TASKS

        ctx = self.ctx
        for name in UNSUPPORTED:
            if body.get(name) not in (None, False, [], {}, ""):
                raise _bad(f"{name} is not supported: a team round returns text joint answers only", name,
                           "unsupported_parameter")
        for name in NEUTRAL_ZERO:
            if body.get(name) not in (None, 0, 0.0):
                raise _bad(f"{name} is not supported (only 0)", name, "unsupported_parameter")
        model = self._model(body.get("model"))
        content, earlier = self._prompt(body.get("messages"))
        try:
            prompt = core.clean_text(content, "the prompt (last user message)", ctx.max_prompt_chars)
        except UserError as e:
            raise _bad(str(e), "messages") from None
        extra = body.get("collab") or {}
        if not isinstance(extra, dict):
            raise _bad("collab must be an object, e.g. {\"tests\": \"assert f(1) == 2\"}", "collab")
        n = _int(body, "n", ctx.num_generations, 1, self.cfg.max_n)
        tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_new = _int(body, tokens_name, min(ctx.sampling.max_new_tokens, self.cfg.max_tokens), 1, self.cfg.max_tokens)
        temperature = _number(body, "temperature", ctx.sampling.temperature, 0.0, 2.0)
        top_p = _number(body, "top_p", ctx.sampling.top_p, 0.0, 1.0, lo_open=True)
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise _bad("stream must be true or false", "stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise _bad("stream_options must be an object", "stream_options")
        try:
            episode = self._episode(model, prompt, extra)
        except UserError as e:
            raise _bad(str(e), "collab" if extra else "messages") from None
        notes = []
        if n == 1:
            notes.append("n=1: a group of 1 has no siblings, so it does not train the team (MAGRPO compares "
                         "the joint answers of a group); ask for n >= 2 to teach it")
        elif temperature == 0:
            notes.append("temperature 0 (greedy): the n answers are alike, so the group carries little or no "
                         "learning signal")
        if earlier:
            notes.append(f"{earlier} earlier message(s) ignored: a round takes one prompt, the last user message "
                         "(the team's role prompts are the server's)")
        private = episode["task"] in PRIVATE_TASKS and not core.custom_training_allowed(ctx)
        if private:
            notes.append("your own problem's groups are kept but train the shared team only if an admin allows it")
        sampling = Sampling(max_new_tokens=max_new, temperature=temperature, top_p=top_p, seed=ctx.sampling.seed)
        return _Round(episode, model, n, sampling, notes, n >= 2 and not private, stream, bool(opts.get("include_usage")))

    @property
    def running_rounds(self) -> int:
        """API rounds in progress (a streamed one ends when its response ends, client gone or not)."""
        return self.ctx.limits.running(API)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no API round runs (shutdown, tests); False if `timeout` s passed first."""
        return self.ctx.limits.wait_idle(API, timeout)

    def completion(self, rnd: "_Round", done: dict, cid: str, created: int) -> dict:
        """The chat.completion object of a finished round, read back from the store."""
        ep = done["episode"]
        grp = self.ctx.store.group(ep["group_id"])
        task = core.task_of(self.ctx, ep)
        choices, per_choice = [], []
        for j in sorted(grp.joints, key=lambda j: j.joint_index):
            smp = [grp.samples[a][g] for a, g in enumerate(j.joint)]
            finish = "length" if any(s.finish_reason == "length" for s in smp) else "stop"
            reward = None if j.auto_total is None else {"total": j.auto_total, "max_total": j.auto_max,
                                                         "levels": j.auto_levels, "details": j.auto_details}
            details = {"joint_sample_id": j.id, "reward": reward, "check_error": j.auto_error,
                       "parts": [{"role": task.roles[a], "agent": s.agent, "adapter_version": s.adapter_version,
                                  "text": s.text, "finish_reason": s.finish_reason,
                                  "completion_tokens": len(s.token_ids)} for a, s in enumerate(smp)]}
            per_choice.append(details)
            choices.append({"index": j.joint_index, "message": {"role": "assistant", "content": j.combined},
                            "finish_reason": finish, "logprobs": None, "collab": details})
        prompt_tokens = sum(len(row[0].prompt_token_ids) for row in grp.samples)
        completion_tokens = sum(len(s.token_ids) for row in grp.samples for s in row)
        return {"id": cid, "object": "chat.completion", "created": created, "model": rnd.model, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens},
                "collab": {"group_id": grp.id, "joint_sample_ids": [c["joint_sample_id"] for c in per_choice],
                           "task": grp.task, "example_id": grp.example_id, "num_generations": grp.num_generations,
                           "session": grp.session_id, "trains": rnd.trains, "notes": rnd.notes,
                           "rate": "POST /v1/ratings {joint_sample_id, rating 1..5 | reward 0..1} or "
                                   "{group_id, ranks | best}"}}

    # -- ratings ---------------------------------------------------------------------------

    FORMS = {("joint_sample_id", "rating"): "stars", ("joint_sample_id", "reward"): "reward",
             ("group_id", "ranks"): "rank", ("group_id", "best"): "pick_best"}

    def rate(self, body: dict, caller: Caller) -> dict:
        """One feedback form (module doc), translated for core.store_feedback; returns the rating object."""
        keys = set(body) - {"comment"}
        (target_field, answer_field), form = next(((ks, f) for ks, f in self.FORMS.items() if keys == set(ks)),
                                                  ((None, None), None))
        if form is None:
            raise _bad(f"give exactly one form (and optionally comment): {{joint_sample_id, rating 1..5}}, "
                       f"{{joint_sample_id, reward 0..1}}, {{group_id, ranks}} or {{group_id, best}}; got "
                       f"fields {sorted(body)!r:.200}", None, "invalid_form")
        target = _id(body, target_field)
        try:
            fb = core.store_feedback(self.ctx, caller, form, target, body[answer_field], body.get("comment"))
        except UserError as e:
            raise _from_user_error(e, target_field if e.code in ("not_found", "not_entitled") else answer_field) from None
        out = {"object": "collab.rating", "form": form, "rater": fb.rater}
        if fb.group_id is not None:
            out["group_id"] = fb.group_id
        notes = [f"saved, but it will not train the team: {fb.why_not}; your rating is kept for the export"
                 ] if not fb.trains else []
        notes += [fb.note] if fb.note else []
        return out | {"rating_ids": fb.rating_ids, "joint_sample_ids": fb.joint_sample_ids, "values": fb.values,
                      "trains": fb.trains, "late": fb.late, "notes": notes}

    # -- the blind arena (web/arena.py) ----------------------------------------------------

    PAIR_FIELDS = ("task", "text", "example_id")
    VOTE_FIELDS = ("match_id", "winner")

    def _arena_task(self, task: Any) -> str:
        if not isinstance(task, str) or not task:
            raise _bad("task must be the name of a task the arena compares (GET /v1/models lists the tasks)", "task")
        return task

    def arena_pair(self, body: dict, caller: Caller) -> dict:
        """{task, text?, example_id?} -> the public pair (arena.public_match): two team states'
        answers to one prompt, a and b in random order, nothing naming either. Runs the generation
        (blocking: call it in a worker thread)."""
        from collab_app.web.arena import arena_pair

        _fields(body, self.PAIR_FIELDS, "an arena pair request")
        task = self._arena_task(body.get("task"))
        text, example_id = _text(body, "text"), _text(body, "example_id")
        try:
            pair = arena_pair(self.ctx, caller, task, text, example_id or None)
        except UserError as e:   # the task, the text, the example, the limits: the message says which
            raise _from_user_error(e) from None
        return {"object": "collab.arena.pair", **pair,
                "vote": "POST /v1/arena/votes {match_id, winner: 'a' | 'b' | 'tie'}"}

    def arena_vote(self, body: dict, caller: Caller) -> dict:
        """{match_id, winner} -> the reveal: which team state each side was (arena.arena_vote)."""
        from collab_app.web.arena import arena_vote

        _fields(body, self.VOTE_FIELDS, "an arena vote")
        match_id = _id(body, "match_id", "POST /v1/arena/pairs")
        if "winner" not in body:
            raise _bad("winner is missing: 'a', 'b' or 'tie'", "winner")
        try:
            return {"object": "collab.arena.vote", **arena_vote(self.ctx, caller, match_id, body["winner"])}
        except UserError as e:
            raise _from_user_error(e, "match_id" if e.code in ("not_found", "not_entitled") else "winner") from None

    def arena_board(self, task: Any) -> dict:
        """The task's leaderboard from its stored votes (arena.arena_board; a bootstrap: CPU work,
        call it in a worker thread)."""
        from collab_app.web.arena import arena_board

        task = self._arena_task(task)
        try:
            return {"object": "collab.arena.leaderboard", **arena_board(self.ctx, task)}
        except UserError as e:
            raise _from_user_error(e, "task") from None

    # -- routes ----------------------------------------------------------------------------

    def router(self):
        """A FastAPI APIRouter with every route of the module doc."""
        def error(e: ApiError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        def internal(where: str) -> JSONResponse:
            log.exception("OpenAI API: %s failed", where)
            return error(ApiError(500, f"{where} failed on the server (its log has the details); nothing was "
                                       "stored for this request unless its response said so", "server_error",
                                  "internal_error"))

        router = APIRouter()

        @router.get("/v1/models")
        async def list_models(request: Request):
            try:
                self.caller(request)
                return JSONResponse(self.models())
            except ApiError as e:
                return error(e)

        @router.get("/v1/models/{model}")
        async def get_model(model: str, request: Request):
            try:
                self.caller(request)
                return JSONResponse(self.model_card(self._model(model)))
            except ApiError as e:
                return error(e)

        @router.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            try:
                caller = self.caller(request)
                body = await self.json_body(request)
                rnd = await run_in_threadpool(self.prepare_round, body)
            except ApiError as e:
                return error(e)
            except Exception:  # noqa: BLE001 - a bug answers 500 in OpenAI's shape, the app stays up
                return internal("preparing the round")
            cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
            # the core's round, step by step; its limits (and their 429s) come with the first event
            events = core.play_round(self.ctx, rnd.episode, caller, rnd.n, rnd.sampling)
            streaming = False

            def finish() -> None:
                events.close()   # play_round's finally: the ticket is cancelled, the round's place given back

            try:   # the first event before the headers: early refusals get a proper status
                first = await run_in_threadpool(next, events, None)
                if rnd.stream:
                    resp = _RoundStream(self._sse(events, first, rnd, cid, created), finish, self.cfg.stream_stall_s)
                    streaming = True
                    return resp
                done = await run_in_threadpool(_last, events, first)
                return JSONResponse(await run_in_threadpool(self.completion, rnd, done, cid, created))
            except UserError as e:
                return error(_from_user_error(e))
            except Exception:  # noqa: BLE001
                return internal("the round")
            finally:
                if not streaming:
                    finish()

        async def ratings(request: Request):
            try:
                caller = self.caller(request)
                body = await self.json_body(request)
                return JSONResponse(await run_in_threadpool(self.rate, body, caller))
            except ApiError as e:
                return error(e)
            except Exception:  # noqa: BLE001
                return internal("storing the rating")

        router.add_api_route("/v1/ratings", ratings, methods=["POST"])
        router.add_api_route("/v1/feedback", ratings, methods=["POST"])

        @router.post("/v1/arena/pairs")
        async def arena_pairs(request: Request):
            try:
                caller = self.caller(request)
                body = await self.json_body(request)
                # the whole pair in a worker thread (its limits and their 429s come before the engine runs)
                return JSONResponse(await run_in_threadpool(self.arena_pair, body, caller))
            except ApiError as e:
                return error(e)
            except Exception:  # noqa: BLE001
                return internal("the arena pair")

        @router.post("/v1/arena/votes")
        async def arena_votes(request: Request):
            try:
                caller = self.caller(request)
                body = await self.json_body(request)
                return JSONResponse(await run_in_threadpool(self.arena_vote, body, caller))
            except ApiError as e:
                return error(e)
            except Exception:  # noqa: BLE001
                return internal("storing the vote")

        @router.get("/v1/arena/leaderboard")
        async def arena_leaderboard(request: Request, task: str | None = None):
            try:
                self.caller(request)
                return JSONResponse(await run_in_threadpool(self.arena_board, task))
            except ApiError as e:
                return error(e)
            except Exception:  # noqa: BLE001
                return internal("the arena leaderboard")

        return router

    async def _sse(self, events, first, rnd: "_Round", cid: str, created: int) -> AsyncIterator[str]:
        """SSE chunks of a streamed round (module doc). The response's on_close ends the round."""

        def chunk(choices: list, **extra) -> str:
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": rnd.model,
                   "choices": choices, **extra}
            return f"data: {json.dumps(obj)}\n\n"

        try:
            yield chunk([{"index": g, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                          "logprobs": None} for g in range(rnd.n)])
            ev = first
            while ev is not None:
                if ev["kind"] == "progress":
                    cands = [{"index": g, "state": c["state"],
                              "parts": [{"role": p["role"], "agent": p["agent"], "text": p["text"], "done": p["done"]}
                                        for p in c["parts"]],
                              "reward": c["reward"]} for g, c in enumerate(ev["candidates"])]
                    yield chunk([], collab={"event": "progress", "message": ev["message"], "candidates": cands})
                elif ev["kind"] == "done":
                    full = await run_in_threadpool(self.completion, rnd, ev, cid, created)
                    for c in full["choices"]:
                        yield chunk([{"index": c["index"], "delta": {"content": c["message"]["content"]},
                                      "finish_reason": None, "logprobs": None}])
                    yield chunk([{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"],
                                  "logprobs": None, "collab": c["collab"]} for c in full["choices"]],
                                collab={"event": "done", **full["collab"]})
                    if rnd.include_usage:
                        yield chunk([], usage=full["usage"])
                ev = await run_in_threadpool(next, events, None)
            yield "data: [DONE]\n\n"
        except UserError as e:
            yield f"data: {json.dumps(_from_user_error(e).body())}\n\n"
        except Exception:  # noqa: BLE001 - the stream ends with an error event, the app stays up
            log.exception("OpenAI API: streamed round failed")
            err = ApiError(500, "the round failed on the server (its log has the details)", "server_error",
                           "internal_error")
            yield f"data: {json.dumps(err.body())}\n\n"


class _StreamStalled(Exception):
    """The client took longer than stream_stall_s to accept one chunk."""


class _RoundStream(StreamingResponse):
    """SSE of one round; `on_close` runs once when the response ends, however it ends (for a
    client that left mid-stream Starlette raises out of __call__, and the body generator alone
    would be closed only when garbage-collected).

    A client that stops reading without closing its connection never sends a disconnect: the
    server's send then waits for the socket to drain (uvicorn's flow control), forever, and the
    round would keep its slot and the key's round in flight. So every send must complete within
    `stall_s`; past that the response is given up: the round ends here, and the server closes
    the connection (the response is incomplete)."""

    def __init__(self, content, on_close, stall_s: float = 30.0):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close
        self._stall_s = stall_s

    async def __call__(self, scope, receive, send):
        async def bounded_send(message):
            try:
                await asyncio.wait_for(send(message), self._stall_s)
            except asyncio.TimeoutError:
                raise _StreamStalled from None

        try:
            await super().__call__(scope, receive, bounded_send)
        except _StreamStalled:
            log.info("OpenAI API: a streaming client accepted nothing for %.0f s: round ended, connection closed",
                     self._stall_s)
        finally:
            await self.body_iterator.aclose()
            self._on_close()


def openai_routes(ctx, cfg: OpenAIConfig) -> list:
    """The routes, for `ui.launch(ctx, ..., app_kwargs={"routes": openai_routes(ctx, cfg)})`."""
    return OpenAIApi(ctx, cfg).router().routes


def mount_openai(app, ctx, cfg: OpenAIConfig) -> OpenAIApi:
    """Add the routes to a FastAPI app; returns the API object (its limiters, for tests / logs)."""
    api = OpenAIApi(ctx, cfg)
    app.include_router(api.router())
    if cfg.api_keys:
        log.info("OpenAI-compatible API on: %d key(s), %d rounds / %d ratings per minute per key",
                 len(cfg.api_keys), cfg.max_rounds_per_minute, cfg.max_ratings_per_minute)
    return api
