"""dtype "auto" (trainer/dtypes.py, re-exported by collab_app.engines): bf16 only where the CPU
computes it natively (AVX512_BF16 / AMX), fp32 on AVX2-only CPUs (bf16 matmul ~36x slower there)."""
from __future__ import annotations

import pytest

from trainer import dtypes


@pytest.mark.parametrize("capability, want", [
    ("AVX2", "float32"), ("AVX512", "float32"), ("DEFAULT", "float32"),
    ("AVX512+AVX512_BF16", "bfloat16"), ("AVX512+AMX", "bfloat16"), ("AVX512+AMX+AVX512_BF16", "bfloat16"),
    ("AVX2+AMX+AVX512_BF16", "float32"),   # torch capped at AVX2 (ATEN_CPU_CAPABILITY=avx2) on an AMX CPU
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


# -- device "auto": cuda > mps > cpu, for the trainer and the transformers engine ----------------

@pytest.fixture
def gpus(monkeypatch):
    """set(cuda=..., mps=...): what torch reports as available."""
    import torch

    def set_(cuda: bool, mps: bool):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    return set_


@pytest.mark.parametrize("cuda, mps, want", [
    (True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"), (False, False, "cpu"),
])
def test_device_auto_prefers_cuda_then_mps_then_cpu(gpus, cuda, mps, want):
    gpus(cuda, mps)
    assert dtypes.resolve_device("auto") == want


def test_explicit_device_is_checked(gpus):
    gpus(False, False)
    assert dtypes.resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="no CUDA GPU: use --device cpu"):
        dtypes.resolve_device("cuda:0")
    with pytest.raises(ValueError, match="MPS backend is not available.*use --device cpu"):
        dtypes.resolve_device("mps")
    with pytest.raises(ValueError, match="device must be one of"):
        dtypes.resolve_device("tpu")
    gpus(True, True)
    assert dtypes.resolve_device("mps") == "mps" and dtypes.resolve_device("cuda:1") == "cuda:1"


def test_auto_dtype_on_mps_is_float32_unless_asked(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_capability", lambda: "AVX512+AMX")   # the host's CPU plays no part
    assert dtypes.resolve_dtype("auto", "mps") == "float32"
    assert dtypes.resolve_dtype("bfloat16", "mps") == "bfloat16"


def test_trainer_config_accepts_every_device():
    import typing

    from trainer.config import MAGRPOConfig

    assert typing.get_args(typing.get_type_hints(MAGRPOConfig)["device"]) == dtypes.DEVICES
    assert MAGRPOConfig(device="mps").device == "mps"
    with pytest.raises(ValueError, match=r"device must be auto, cpu or cuda \(or mps"):
        MAGRPOConfig(device="tpu")


class _FakeTokenizer:
    padding_side = "right"
    pad_token_id = eos_token_id = 0
    eos_token = "</s>"


class _FakeModel:
    def __init__(self, dtype):
        self.dtype, self.device = dtype, None
        self.generation_config = type("G", (), {"eos_token_id": 0})()

    def to(self, device):
        self.device = device
        return self

    def eval(self):
        return self

    def modules(self):   # no nn.Linear to pack
        return iter(())


@pytest.mark.parametrize("cuda, mps, want_device, want_dtype", [
    (False, False, "cpu", "float32"), (False, True, "mps", "float32"), (True, True, "cuda", "bfloat16"),
])
def test_transformers_engine_picks_the_trainers_device(monkeypatch, gpus, cuda, mps, want_device, want_dtype):
    import torch

    from collab_app.engines import engine_hf

    gpus(cuda, mps)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(dtypes, "cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(engine_hf.AutoTokenizer, "from_pretrained", lambda *a, **k: _FakeTokenizer())
    monkeypatch.setattr(engine_hf.AutoModelForCausalLM, "from_pretrained", lambda *a, dtype, **k: _FakeModel(dtype))
    eng = engine_hf.TransformersEngine("unused-model-path")
    assert (eng.device, eng.dtype, eng.model.device, eng.model.dtype) == (
        want_device, want_dtype, want_device, getattr(torch, want_dtype))
    assert eng.quantize is None   # a checkpoint whose stored dtype is not known keeps torch's GEMMs
    assert engine_hf.TransformersEngine("unused-model-path", device="cpu").device == "cpu"   # explicit wins


@pytest.mark.parametrize("cuda, mps, want_device, want_dtype", [
    (False, False, "cpu", "float32"), (False, True, "mps", "float32"), (True, True, "cuda", "bfloat16"),
])
def test_collab_models_reports_the_engines_device(monkeypatch, gpus, cuda, mps, want_device, want_dtype):
    """`collab models` shows dtype auto on the device the transformers engine and trainer pick."""
    import torch

    from collab_app.commands import models

    gpus(cuda, mps)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(dtypes, "cpu_capability", lambda: "AVX2")
    info = models._dtype_info()
    assert (info["device"], info["dtype"]) == (want_device, want_dtype)
    assert isinstance(info["cpu_capability"], str)


def test_flags_quantize_takes_fp16_weights_only_where_they_are_exact_and_run(tmp_path):
    """engines.flags_quantize (the transformers engine's base GEMMs where no calibration ran):
    fp16 weights for a CPU engine in fp32, with fbgemm, on a checkpoint stored in 16 bits."""
    import json

    import torch

    from collab_app.engines.device import checkpoint_dtype, flags_quantize

    fp16 = "fp16" if "fbgemm" in torch.backends.quantized.supported_engines else None
    assert flags_quantize("cpu", "float32", "bfloat16") == fp16
    assert flags_quantize("cpu", "float32", "float16") == fp16
    assert flags_quantize("cpu", "float32", "float32") is None     # fp16 would round an fp32 checkpoint
    assert flags_quantize("cpu", "float32", None) is None
    assert flags_quantize("cpu", "bfloat16", "bfloat16") is None   # bf16 runs its own GEMMs
    assert flags_quantize("cuda", "float32", "bfloat16") is None
    assert flags_quantize("mps", "float32", "bfloat16") is None
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert checkpoint_dtype(str(tmp_path)) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16", "torch_dtype": "float32"}))
    assert checkpoint_dtype(str(tmp_path)) == "bfloat16"            # transformers 5 writes "dtype"
    assert checkpoint_dtype(str(tmp_path / "missing")) is None and checkpoint_dtype("org/model-id") is None


def test_gqa_attention_gives_sdpas_sums_on_a_padded_batch(tiny_model_path):
    """trainer.dtypes.gqa_attention (masked grouped-query attention without copied key/value
    heads, CPU): the same logits, greedy tokens and gradients as transformers' sdpa on a
    left-padded batch of a GQA model (the tiny base: 4 query heads, 2 key/value heads); a model on
    another attention implementation is left alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    ref, ours = (AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval() for _ in range(2))
    dtypes.gqa_attention(ours, "cpu")
    assert ours.config._attn_implementation == dtypes.GQA_SDPA and ref.config._attn_implementation == "sdpa"
    batch = tok(["Hello there, how are you today?", "Hi", "A much longer prompt " * 8], padding=True, return_tensors="pt")
    assert not batch["attention_mask"].all(), "the batch must be padded: the mask is what changes the path"
    with torch.no_grad():
        assert torch.equal(ref(**batch).logits, ours(**batch).logits)
        assert torch.equal(ref.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id),
                           ours.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id))
    for m in (ref, ours):
        m(**batch).logits[:, -4:].logsumexp(-1).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6 * p.grad.abs().max().item()), name
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation="eager")
    dtypes.gqa_attention(eager, "cpu")
    gpu = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    dtypes.gqa_attention(gpu, "cuda")   # CUDA's fused kernels take no mask with GQA: the copy stays there
    assert eager.config._attn_implementation == "eager" and gpu.config._attn_implementation == "sdpa"


def test_a_16_bit_decode_step_and_a_training_forward_attend_in_fp32(tiny_model_path):
    """trainer.dtypes._fp32_attention: in bf16, a decode step (one query position) and a forward
    under autograd attend in fp32 (torch's bf16 CPU kernel is 3-5x slower there, docs/ENGINES.md);
    a prefill without autograd stays bf16, fp32 models are untouched. The fp32 sums are at least as
    close to float64's as the bf16 kernel's, the output keeps the model's dtype, and a bf16 model
    still generates and trains through it."""
    import types

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bf16 = torch.zeros(2, 9, 1, 8, dtype=torch.bfloat16)
    assert dtypes._fp32_attention(bf16) and dtypes._fp32_attention(bf16.half())
    with torch.no_grad():
        assert not dtypes._fp32_attention(torch.zeros(2, 9, 5, 8, dtype=torch.bfloat16))   # a prefill
    assert dtypes._fp32_attention(torch.zeros(2, 9, 5, 8, dtype=torch.bfloat16))           # autograd on
    assert not dtypes._fp32_attention(bf16.float())

    torch.manual_seed(0)
    q = torch.randn(4, 9, 1, 64, dtype=torch.bfloat16)
    k, v = torch.randn(4, 3, 50, 64, dtype=torch.bfloat16), torch.randn(4, 3, 50, 64, dtype=torch.bfloat16)
    mask = torch.ones(4, 1, 1, 50, dtype=torch.bool)
    mask[::2, ..., :7] = False                                   # left padding: the masked GQA path
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    old = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    for m in (mask, None):
        with torch.no_grad():
            out, _ = dtypes._sdpa_gqa_forward(module, q, k, v, m)      # (batch, T, heads, head_dim)
        assert out.dtype == torch.bfloat16 and out.shape == (4, 1, 9, 64)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, enable_gqa=True)
        assert torch.equal(out, want.transpose(1, 2).to(torch.bfloat16))
    out, _ = dtypes._sdpa_gqa_forward(module, q, k, v, mask)
    err = lambda o: (o.double() - ref.transpose(1, 2)).abs().max().item()   # noqa: E731
    assert err(out) <= err(old.transpose(1, 2)) + 1e-6

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.padding_side, tok.pad_token = "left", tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    dtypes.gqa_attention(model, "cpu")
    batch = tok(["Hello there, how are you today?", "Hi"], padding=True, return_tensors="pt")
    with torch.no_grad():
        new = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert new.shape[1] == batch["input_ids"].shape[1] + 6
    model(**batch).logits[:, -1].float().logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.bfloat16 and torch.isfinite(g.float()).all() for g in grads)
