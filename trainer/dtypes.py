"""dtype and device "auto" for the engines and the trainer: the dtype a CPU or GPU computes
fastest in, and the device (cuda > mps > cpu) their models go on.

Lives in trainer/ (not collab_app/) because the trainer must not import collab_app, while
collab_app may import trainer: `collab_app.engines.resolve_dtype` re-exports this one.

Why it matters (measured, docs/ENGINES.md "dtype on CPU"): on a CPU with AVX-512-BF16 or AMX,
bf16 is the faster dtype (bf16 HF generate 112-125 vs fp32 79-95 tok/s); on an AVX2-only CPU
torch's bf16 matmul runs at 1.4 GFLOP/s against 51 in fp32 (36x slower), so there fp32 is the
right one. torch 2.13 reports "AVX512" from `get_cpu_capability()` on an AVX-512-BF16 CPU, so the
bf16 / AMX features are read from torch.cpu's own probes as well.
"""
from __future__ import annotations

DTYPES = ("auto", "bfloat16", "float32")
DEVICES = ("auto", "cpu", "cuda", "mps")


def mps_available() -> bool:
    """Apple-silicon GPU through torch's MPS backend (macOS 12.3+, a torch built with it)."""
    import torch

    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(device: str = "auto") -> str:
    """"cuda" | "mps" | "cpu" (or the given "cuda:N") for `device` in DEVICES. auto: cuda when torch
    sees a CUDA GPU, else mps on Apple silicon, else cpu. An explicit device torch cannot use is
    refused here, with the fix, rather than deep inside the first `.to(device)`."""
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if mps_available() else "cpu"
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ValueError(f"device must be one of {DEVICES} (or cuda:N), got {device!r}")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA GPU: use --device cpu (or auto)")
    if device == "mps" and not mps_available():
        raise ValueError("device='mps' but torch's MPS backend is not available (it needs Apple silicon, "
                         "macOS 12.3+ and torch's macOS wheel): use --device cpu (or auto)")
    return device


def cpu_capability() -> str:
    """torch's CPU capability plus what it knows about native bf16: e.g. "AVX512+AVX512_BF16",
    "AVX512+AMX", "AVX2" (shown by `collab models` and the bench)."""
    import torch

    cap = str(torch.backends.cpu.get_cpu_capability())
    extra = []
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        extra.append("AMX")
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        extra.append("AVX512_BF16")
    return "+".join([cap] + [e for e in extra if e not in cap])


def cpu_has_native_bf16(capability: str) -> bool:
    """AMX or AVX512_BF16 (torch.cpu's probes read the hardware) while torch's own dispatch runs
    AVX-512 kernels: with ATEN_CPU_CAPABILITY capped below that (e.g. "AVX2+AMX+AVX512_BF16", an
    AVX2 emulation) torch runs as on an AVX2 CPU, where bf16 is ~36x slower."""
    return capability.split("+")[0].startswith("AVX512") and ("AMX" in capability or "BF16" in capability)


def resolve_dtype(dtype: str, device: str) -> str:
    """"bfloat16" | "float32" for `dtype` in DTYPES on `device` ("cpu", "cuda", "cuda:0", "mps").
    auto: on CUDA bf16 if the GPU supports it; on MPS fp32; on CPU bf16 only with native bf16
    (AVX512_BF16 / AMX), else fp32."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    if str(device).startswith("mps"):
        # bf16 on MPS depends on the macOS version (older ones reject bf16 tensors on the GPU) and
        # torch has no probe for it like CUDA's is_bf16_supported: fp32 always works; a user whose
        # Mac has it asks for bfloat16.
        return "float32"
    if str(device).startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_has_native_bf16(cpu_capability()) else "float32"


GQA_SDPA = "sdpa_gqa"   # the attention implementation name `gqa_attention` registers with transformers


def _fp32_attention(query) -> bool:
    """Whether a CPU attention call computes in fp32 instead of the model's 16-bit dtype: for one
    query position (a decode step) or under autograd (the trainer's forward). torch's CPU flash
    kernel in bf16 does per-block work on the keys and values (packing, conversion) for each query
    head and query block, which one query position cannot amortize (inferred from the timings, not
    read in torch's source); with the inputs converted once, the same sums cost a fraction: on a CPU with
    AVX512_BF16, 16 rows x 136 keys 1.08 -> 0.31 ms a layer, 8 rows x 600 keys 2.35 -> 0.45 ms,
    forward + backward of 16 rows x 136 tokens 49 -> 30 ms. A prefill without autograd (many query positions) ran as fast either way and
    stays in 16 bits (tried: prefills in fp32 too, so that a prompt's last token gets the same
    logits from a prefill (n=1) as from the decode step after the engine's shared prefill (n > 1);
    test_learning's rise then fell to 0.10 at its seed, from 0.78-1.20 over three seeds: not kept).
    The products of 16-bit inputs are exact in fp32 and the kernel sums in fp32
    in both, so only the rounding of the softmax weights before the value product differs (the
    fp32 path's error against float64 was equal or lower in every shape measured)."""
    import torch

    return query.dtype in (torch.bfloat16, torch.float16) and (query.shape[2] == 1 or torch.is_grad_enabled())


def _sdpa_gqa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention on a CPU, with two changes (same masks, same sums):
    - a masked batch on grouped-query attention hands torch the key/value heads as they are
      (`enable_gqa=True`) instead of copying each one `num_key_value_groups` times first:
      transformers does that copy whenever there is a mask (left padding: every batch of prompts of
      different lengths), because CUDA's fused kernels take no mask with GQA. torch's CPU kernel
      does; the outputs are identical (tests/engines/test_engine_dtype.py);
    - a 16-bit decode step or a forward under autograd computes in fp32 (`_fp32_attention`).
    Everything else (position bias, paged cache, attention weights asked for) goes to transformers'
    own function unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("position_bias") is not None or kwargs.get("cache") is not None or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    dtype = query.dtype
    if _fp32_attention(query):
        query, key, value = query.float(), key.float(), value.float()
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or groups == 1:
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, is_causal=is_causal, **kwargs)
        return out.to(dtype), weights
    import torch

    out = torch.nn.functional.scaled_dot_product_attention(   # (batch, heads, T, head_dim)
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous().to(dtype), None     # (batch, T, heads, head_dim), as sdpa's


def gqa_attention(model, device: str) -> None:
    """Switch a model on `device` "cpu" that runs transformers' "sdpa" attention to `_sdpa_gqa_forward` (same
    masks, same sums; 16-bit decode steps and training forwards in fp32, `_fp32_attention`). Why:
    decoding 16 left-padded rows of SmolLM2-135M (3 key/value heads for 9 query heads) on the
    2-core AVX2 CPU, the copies of the key/value heads took 2.1 ms per layer and step against
    0.48 ms for the whole masked attention without them, ~20% of a step. Left alone: GPUs (CUDA's
    fused kernels take no mask with GQA, so there the copy is the fast path) and models on
    another attention implementation."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) != "sdpa" or str(device) != "cpu":
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, _sdpa_gqa_forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)
