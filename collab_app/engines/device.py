"""What the device and the checkpoint allow the engines: a CUDA GPU or not, the base-GEMM
precisions an engine may serve (`QUANTIZE`), the dtype a checkpoint is stored in, and the
transformers engine's base GEMMs where no calibration ran."""
from __future__ import annotations

# base GEMMs on CPU (cpu_kernels.BASE_GEMMS): None = the engine's own in its dtype; "fp16" = fp16
# weights, fp32 activations and sums; "int8" = dynamic int8 (not exact)
QUANTIZE = (None, "fp16", "int8")


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def flags_quantize(device: str, dtype: str, stored_dtype: str | None) -> str | None:
    """The transformers engine's base GEMMs where no calibration ran (`quantize="auto"`): "fp16"
    on a CPU engine in float32 with fbgemm (x86) when the checkpoint's weights are 16-bit
    (`stored_dtype`, its config's dtype: bfloat16 / float16), else None. From a 16-bit checkpoint
    fp16 weights are exact (bf16 values below 6e-5 in magnitude lose bits as fp16 subnormals: the
    embedded model's log-prob gap is 0.0) and halve what a decode step streams (1.7-1.9x on the
    AVX2 CPU; docs/CPU.md). An fp32 checkpoint would be rounded: it keeps torch's GEMMs. The
    calibration (cpu_precision) measures instead where it runs."""
    import torch

    if device != "cpu" or dtype != "float32" or stored_dtype not in ("bfloat16", "float16"):
        return None
    return "fp16" if "fbgemm" in torch.backends.quantized.supported_engines else None


def checkpoint_dtype(model_path: str) -> str | None:
    """The dtype a local checkpoint's config.json says its weights are stored in (None: not a
    local folder, or not said)."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    stored = cfg.get("dtype") or cfg.get("torch_dtype")
    return stored if isinstance(stored, str) else None
