"""An engine built in a process where another vLLM engine already started gets ITS OWN settings.

vLLM caches its environment variables per process once an engine core has started
(`vllm.envs.enable_envs_cache`). Before engine_vllm dropped that cache for each build, a compiled
engine built next to an eager one (the suite's session engine, a team on two bases) missed the
VLLM_USE_AOT_COMPILE=0 it then ran with and took vLLM's AOT path: 80-93 s to start instead of
18-23 s (Xeon with AMX, docs/results "vLLM's cached environment"). These tests build VLLMEngine
around a recording stand-in for `vllm.LLM` (no model is loaded), with the cache filled with the
opposite values. The last test checks vLLM's AOT cache key for a compiled CPU engine
(cpu_kernels.compiled_model_kept_on_disk) on a real VllmConfig.
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
                        enforce_eager=kwargs["enforce_eager"], additional_config=kwargs.get("additional_config"))
            self.llm_engine = types.SimpleNamespace(
                engine_core=types.SimpleNamespace(shutdown=lambda: None),
                vllm_config=types.SimpleNamespace(compilation_config=types.SimpleNamespace(local_cache_dir=None)))

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


def test_a_compiled_engine_is_built_with_vllms_aot_cache_whatever_vllm_cached(model_path, recording_llm, monkeypatch):
    """An earlier engine's cache said AOT off (as every compiled engine ran before it was mended):
    the build reads the environment afresh, where vLLM's default (on) holds, and passes its LoRA
    lanes (default: one per agent) into vLLM's key."""
    from vllm import envs

    from collab_app.engines import cpu_kernels
    from collab_app.engines.engine_vllm import VLLMEngine, cpu_compile_unfit

    if cpu_compile_unfit("bfloat16", None):
        pytest.skip(cpu_compile_unfit("bfloat16", None))
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")
    envs.disable_envs_cache()
    envs.enable_envs_cache()
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE")
    try:
        assert envs.VLLM_USE_AOT_COMPILE is False          # what the cache says
        eng = VLLMEngine(model_path, dtype="bfloat16", enforce_eager=False, in_process=True, num_agents=3)
        eng.close()
    finally:
        envs.disable_envs_cache()
    # the bf16 GEMM this process serves: sgl-kernel's where torch runs as a native-bf16 CPU, vLLM's
    # oneDNN where it acts as a lesser one (the AVX2 emulation of docs/results on such hardware)
    assert recording_llm == {"multiprocessing": False, "aot": True, "enforce_eager": False,
                             "additional_config": {"collab_lora_lanes": 3, "collab_lora_rank": 8,
                                                   "collab_bf16_gemm": cpu_kernels.bf16_gemm_served()}}, recording_llm
    assert "VLLM_USE_AOT_COMPILE" not in os.environ         # nothing set for other engines


def test_the_compiled_models_cache_key_holds_its_lora_lanes_not_its_cores(model_path, monkeypatch):
    """vLLM's AOT key for a compiled CPU engine, from a real VllmConfig: the same whatever cores the
    engine is bound to (`collab serve` pins them, the install's engine race does not: serve must
    load what the race compiled), different when the in-graph LoRA lanes or the bf16 layers' GEMM
    differ (vLLM drops a loaded artifact's guards: lanes of the wrong shape would be indexed, the
    traced kernel called on another kernel's packed weights). Outside the mend vLLM's key moves
    with the binding: if a vLLM stops hashing it, this says the mend can go."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled
    from vllm import envs
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.engine.arg_utils import EngineArgs

    from collab_app.engines import cpu_kernels
    from collab_app.engines.engine_vllm import cpu_compile_unfit

    if cpu_compile_unfit("bfloat16", None):
        pytest.skip(cpu_compile_unfit("bfloat16", None))
    envs.disable_envs_cache()                                # read the variables set below
    configs = {lanes: EngineArgs(model=model_path, dtype="bfloat16", enforce_eager=False, max_model_len=2048,
                                 additional_config=cpu_kernels.aot_key_extras(lanes, 8)).create_engine_config()
               for lanes in (2, 3)}
    served = cpu_kernels.bf16_gemm_served()                   # "sgl" on a native-bf16 CPU, "onednn" acting as AVX2
    other = "onednn" if served == "sgl" else "sgl"
    configs["other"] = EngineArgs(model=model_path, dtype="bfloat16", enforce_eager=False, max_model_len=2048,
                                  additional_config={**cpu_kernels.aot_key_extras(2, 8), "collab_bf16_gemm": other}
                                  ).create_engine_config()

    def key(lanes: int | str, cores: str, mended: bool = True) -> list:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", cores)
        if not mended:
            return aot_compile_hash_factors(configs[lanes])
        with cpu_kernels.compiled_model_kept_on_disk():
            assert hasattr(Bundled, "finalize_loading")      # the loader's call finds a method
            return aot_compile_hash_factors(configs[lanes])

    assert key(2, "0") == key(2, "0-1") == key(2, "nobind")
    assert key(2, "0") != key(3, "0")
    assert cpu_kernels.aot_key_extras(2, 8)["collab_bf16_gemm"] == served and key(2, "0") != key("other", "0")
    assert key(2, "0", mended=False) != key(2, "0-1", mended=False)
    assert not hasattr(Bundled, "finalize_loading")          # put back after the build
