"""What both backends share about a request: the prompt as the model sees it (the tokenizer's chat
template, the role prompt as system), the checks that need no tokens and the length check, and a
stream for an engine without one."""
from __future__ import annotations

from collab_app.engines.engine_types import Progress, Request, Sampling, EngineError


def chat_prompt_ids(tokenizer, request: Request) -> list[int]:
    """The prompt as the model sees it: the tokenizer's chat template, system = role prompt if any.
    Both backends tokenize here so they see identical token ids."""
    messages = [{"role": "system", "content": request.system}] if request.system.strip() else []
    messages.append({"role": "user", "content": request.prompt})
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(enc["input_ids"])


def check_requests(engine, requests: list[Request], n: int, sampling: Sampling, known_agents) -> None:
    """Checks that need no tokens (run before tokenizing anything)."""
    if n < 1:
        raise EngineError(f"n (samples per request) must be >= 1, got {n}")
    if not requests:
        raise EngineError("no requests: pass at least one Request")
    for i, r in enumerate(requests):
        if not r.prompt or not r.prompt.strip():
            raise EngineError(f"request {i} (agent {r.agent!r}) has an empty prompt: give it some text")
        if r.agent not in known_agents:
            raise EngineError(
                f"request {i}: unknown agent {r.agent!r} (known: {sorted(known_agents)}); "
                f"call engine.register_agent({r.agent!r}) or engine.load_adapter({r.agent!r}, path, version) first"
            )
    if not isinstance(sampling, Sampling):
        raise EngineError(f"sampling must be a Sampling, got {type(sampling).__name__}")


def check_lengths(prompt_ids: list[list[int]], sampling: Sampling, max_model_len: int) -> None:
    for i, ids in enumerate(prompt_ids):
        if len(ids) + sampling.max_new_tokens > max_model_len:
            raise EngineError(
                f"request {i}: prompt ({len(ids)} tokens after the chat template) + max_new_tokens "
                f"({sampling.max_new_tokens}) > max_model_len ({max_model_len}); shorten the prompt, "
                f"lower max_new_tokens, or start the engine with a larger max_model_len"
            )


def stream(engine, requests: list[Request], n: int, sampling: Sampling):
    """`engine.generate_stream(...)`, or for an engine without one (a test's scripted engine) a
    stream of one snapshot: `generate`'s result."""
    if hasattr(engine, "generate_stream"):
        yield from engine.generate_stream(requests, n, sampling)
        return
    out = engine.generate(requests, n, sampling)
    yield Progress([[s.text for s in row] for row in out], [list(row) for row in out])
