"""Shared fixtures: the embedded model and random-init LoRA adapters on it."""
from __future__ import annotations

import importlib.util

import pytest

# peft's LoRA targets for the adapters the app trains (attention projections of a Llama block).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="session")
def model_path() -> str:
    """The embedded SmolLM2-135M-Instruct folder (provisioned once into $COLLAB_HOME, then reused)."""
    from collab_app.model import ensure_model

    return ensure_model()


def make_lora_adapter(model_path: str, out_dir, seed: int, scale: float = 2.0, r: int = 8) -> str:
    """Write a random-init peft LoRA adapter for `model_path` into `out_dir` and return its path.

    init_lora_weights=False makes B non-zero (peft's default B=0 would be a no-op adapter);
    `scale` multiplies every LoRA weight so that the adapters' outputs clearly differ from the
    base model's and from each other's .
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=LORA_TARGETS, init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.fixture(scope="session")
def lora_adapter(model_path, tmp_path_factory):
    """Factory: lora_adapter(seed, scale=2.0) -> adapter dir (cached per (seed, scale) for the session)."""
    cache: dict = {}

    def make(seed: int, scale: float = 2.0) -> str:
        if (seed, scale) not in cache:
            cache[seed, scale] = make_lora_adapter(model_path, tmp_path_factory.mktemp(f"lora{seed}"), seed, scale)
        return cache[seed, scale]

    return make


@pytest.fixture(scope="session")
def hf_engine(model_path):
    """One bf16 TransformersEngine for the session (tests register their own agent names)."""
    from collab_app.engine_hf import TransformersEngine

    return TransformersEngine(model_path, seed=0)


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None
