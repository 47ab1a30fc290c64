"""What the engine tests can start here, and what the engine test modules share."""
from __future__ import annotations

import importlib.util

import pytest

from collab_app.engines.engine_types import EngineError

# a prompt the base model answers with confidence ("The capital of France is Paris."), so that bf16
# rounding differences between batch shapes do not flip its greedy tokens
PROMPT = "What is the capital of France?"
VLLM = pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow])


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def setup_agents(engine, adapters):
    """Agents: `base` (no adapter), `a1`/`a2` (adapters seed 1 / 2). Idempotent across tests."""
    engine.register_agent("base")
    for k in (1, 2):
        try:
            loaded = engine.adapter_version(f"a{k}") == 1
        except EngineError:
            loaded = False
        if not loaded:
            engine.load_adapter(f"a{k}", adapters[k], 1)
