"""dtype "auto" (trainer/dtypes.py, re-exported by collab_app.engines): bf16 only where the CPU
computes it natively (AVX512_BF16 / AMX), fp32 on AVX2-only CPUs (bf16 matmul ~36x slower there)."""
from __future__ import annotations

import pytest

from trainer import dtypes


@pytest.mark.parametrize("capability, want", [
    ("AVX2", "float32"), ("AVX512", "float32"), ("DEFAULT", "float32"),
    ("AVX512+AVX512_BF16", "bfloat16"), ("AVX512+AMX", "bfloat16"), ("AVX512+AMX+AVX512_BF16", "bfloat16"),
])
def test_auto_follows_cpu_capability(monkeypatch, capability, want):
    monkeypatch.setattr(dtypes, "cpu_capability", lambda: capability)
    assert dtypes.resolve_dtype("auto", "cpu") == want


def test_cpu_capability_reads_torch_probes(monkeypatch):
    import torch

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert dtypes.cpu_capability() == "AVX512+AVX512_BF16"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert dtypes.cpu_capability() == "AVX2" and dtypes.resolve_dtype("auto", "cpu") == "float32"


def test_auto_on_cuda_follows_bf16_support(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert dtypes.resolve_dtype("auto", "cuda:0") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert dtypes.resolve_dtype("auto", "cuda") == "bfloat16"


def test_explicit_dtype_wins_and_bad_one_is_refused(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_capability", lambda: "AVX2")
    assert dtypes.resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        dtypes.resolve_dtype("float16", "cpu")


def test_engines_and_trainer_default_to_auto():
    import inspect

    from collab_app.engines import engine_hf, engine_vllm, resolve_dtype
    from trainer.config import MAGRPOConfig

    assert resolve_dtype is dtypes.resolve_dtype
    assert MAGRPOConfig.dtype == "auto"
    for cls in (engine_hf.TransformersEngine, engine_vllm.VLLMEngine):
        assert inspect.signature(cls.__init__).parameters["dtype"].default == "auto"
