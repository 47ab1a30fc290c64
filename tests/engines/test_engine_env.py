"""An engine built in a process where another vLLM engine already started gets ITS OWN settings.

vLLM caches its environment variables per process once an engine core has started
(`vllm.envs.enable_envs_cache`). Before engine_vllm dropped that cache for each build, a compiled
engine built next to an eager one (the suite's session engine, a team on two bases) missed its
VLLM_USE_AOT_COMPILE=0 and took vLLM's AOT path: 80-93 s to start instead of 18-23 s (Xeon with
AMX, docs/results "vLLM's cached environment"). These tests build VLLMEngine around a recording
stand-in for `vllm.LLM` (no model is loaded), with the cache filled with the opposite values.
"""
from __future__ import annotations

import os
import types

import pytest

from helpers.engines import vllm_importable

pytestmark = pytest.mark.skipif(not vllm_importable(), reason="vllm is not importable")


@pytest.fixture
def cached_env(monkeypatch):
    """vLLM's env cache filled as an earlier engine in this process left it: multiprocessing on
    and AOT compile on. Restored (cache off, variables back) after the test."""
    from vllm import envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    envs.disable_envs_cache()
    envs.enable_envs_cache()
    assert envs.VLLM_ENABLE_V1_MULTIPROCESSING and envs.VLLM_USE_AOT_COMPILE
    yield envs
    envs.disable_envs_cache()


@pytest.fixture
def recording_llm(monkeypatch):
    """`vllm.LLM` replaced by a stand-in that records what vLLM's envs say while it is built."""
    import vllm
    from vllm import envs

    seen = {}

    class RecordingLLM:
        def __init__(self, **kwargs):
            seen.update(multiprocessing=envs.VLLM_ENABLE_V1_MULTIPROCESSING, aot=envs.VLLM_USE_AOT_COMPILE,
                        enforce_eager=kwargs["enforce_eager"])
            self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: None))

        def collective_rpc(self, method, args=()):   # the engine's worker calls (the sampler, on CPU)
            return [f"{method}: not run (RecordingLLM)"]

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    return seen


def test_an_in_process_engine_is_built_in_one_process_whatever_vllm_cached(model_path, cached_env, recording_llm):
    from collab_app.engines.engine_vllm import VLLMEngine

    eng = VLLMEngine(model_path, dtype="float32", enforce_eager=True, in_process=True)
    eng.close()
    assert recording_llm["multiprocessing"] is False, recording_llm     # the cache said True
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"          # restored for other engines


def test_a_compiled_engine_is_built_without_aot_whatever_vllm_cached(model_path, cached_env, recording_llm, monkeypatch):
    from collab_app.engines.engine_vllm import VLLMEngine, cpu_compile_unfit

    if cpu_compile_unfit("bfloat16", None):
        pytest.skip(cpu_compile_unfit("bfloat16", None))
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")        # monkeypatch puts the variable back after
    eng = VLLMEngine(model_path, dtype="bfloat16", enforce_eager=False, in_process=True)
    eng.close()
    assert recording_llm == {"multiprocessing": False, "aot": False, "enforce_eager": False}, recording_llm
    # process-wide: a compiled engine's every forward asserts it through the cache the next build refills
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
