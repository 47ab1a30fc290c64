"""Types shared by the inference engines (docs/ARCHITECTURE.md "Contracts", Engine).

Kept apart from the backends so that importing them costs nothing (no torch, no vllm).

Log-prob convention (every backend, and the trainer): `Sample.logprobs[t]` is the log-prob of
token_ids[t] under the distribution that drew it, log softmax(logits_t / T)[token_ids[t]] at the
sampling temperature T > 0 with top_p = 1, i.e. log π_T(a_t | h, a_<t) under the adapter that
produced the sample; with top_p < 1, that of the nucleus, renormalised. Greedy rows (T = 0) draw
from no distribution: theirs are the untempered log softmax(logits_t). Every sample records its
sampling, `Sample.meta["sampling"] = {"temperature": T, "top_p": p}` (`sampling_meta`). The
trainer's teacher-forced log-probs divide the logits by the same T, so the importance ratio is
exactly 1 when the adapter has not moved and the gradient is that of the tempered objective; it
refuses greedy and top_p < 1 samples (their log-probs it cannot reproduce).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol


class EngineError(ValueError):
    """A bad request (empty prompt, unknown agent, prompt longer than the context, ...)."""


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise EngineError("max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise EngineError("temperature must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise EngineError("top_p must be in (0, 1]")


def sampling_meta(sampling: Sampling) -> dict:
    """What a Sample records of the sampling that drew it (meta["sampling"]; the trainer reads it)."""
    return {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p)}


@dataclass(frozen=True)
class Request:
    """One prompt for one agent. `agent` picks the adapter (its current version); `system` is the
    agent's role prompt (may be empty). The engine applies the chat template."""

    agent: str
    prompt: str
    system: str = ""


@dataclass
class Sample:
    agent: str
    adapter_version: int | None       # None = base model, no adapter
    prompt_token_ids: list[int]       # the chat-templated prompt, as the model saw it
    text: str
    token_ids: list[int]              # generated tokens (EOS included if one was produced)
    logprobs: list[float]             # one per token_ids entry, see module doc
    finish_reason: str = "length"     # "stop" | "length"
    meta: dict = field(default_factory=dict)   # {"engine": its name, "model": the base it ran on, "sampling": ..., ...}


@dataclass
class Progress:
    """A snapshot of a streaming generation (`Engine.generate_stream`), indexed like
    `generate`'s result: [request i][sample j].

    `texts[i][j]` is the text decoded so far (grows monotonically; final = the sample's text),
    `done[i][j]` the finished `Sample` or None while it is still running. The last snapshot a
    stream yields has every `done` entry set; `result()` then equals what `generate` returns."""

    texts: list[list[str]]
    done: list[list["Sample | None"]]

    @property
    def finished(self) -> bool:
        return all(s is not None for row in self.done for s in row)

    def result(self) -> list[list[Sample]]:
        if not self.finished:
            raise EngineError("generation still running: result() only on the last snapshot")
        return [list(row) for row in self.done]  # type: ignore[arg-type]


class Engine(Protocol):
    name: str             # "vllm" | "transformers"
    model_path: str
    max_model_len: int

    def register_agent(self, agent: str) -> None:
        """Make `agent` known (serves the base model until an adapter is loaded)."""

    def load_adapter(self, agent: str, path: str | None, version: int | None) -> None:
        """Serve adapter directory `path` (peft format) as `agent`'s version `version` from now
        on; `path=None` means the base model. Requests already running finish on what they
        started with."""

    def adapter_version(self, agent: str) -> int | None: ...

    def generate(self, requests: list[Request], n: int, sampling: Sampling) -> list[list[Sample]]:
        """For each request, `n` samples (result[i][j] = sample j of request i), all requests
        in one batched call. Raises EngineError for bad requests before generating anything."""

    def generate_stream(self, requests: list[Request], n: int, sampling: Sampling) -> Iterator[Progress]:
        """`generate`, streamed: yields a `Progress` snapshot whenever some sample's text grew or
        finished (at most one per decode step), the last one with every sample done. Bad requests
        raise EngineError before the first snapshot. `generate` is the last snapshot's result."""

    def close(self) -> None: ...
