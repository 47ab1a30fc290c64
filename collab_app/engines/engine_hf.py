"""transformers + peft backend: the fallback engine and the fast test backend.

One base model, one peft LoRA adapter per agent (agents without one use the base). A batch that
mixes agents runs as ONE `generate` call, left-padded: the base layers once for every row, and
each row's own low-rank delta added to its agent's rows (`team_lora`: forward hooks on peft's
LoRA layers, peft's own adapters switched off for the call; per layer two GEMMs over all the
batch's adapters stacked, a mask keeping each row's own rank columns). peft's mixed-batch
`adapter_names=[...]` computes the same sums but indexes the batch per layer and step, which is
slow on a GPU; it stays the reference in the tests. Adapters are loaded, named and deleted by peft.

Log-probs (`SampledLogprobs`): a logits processor applies the sampling temperature (and top-p)
itself and keeps each step's log-prob of the token drawn (engine_types' convention), instead of
holding every step's float32 logits (`output_logits=True`) until the end. On CPU the draw is a
logits processor too (`InverseCDFSampling`, engines/cpu_sampler.py).

Thread safety: one lock around `generate` and around adapter loading (peft's hooks sit on shared
modules): a `load_adapter` during a `generate` waits for that batch, which finishes on the
versions it started with; the old version is deleted right after the new one is in.
Threads (`decode_thread=True`, a server): weights load, every batch and every adapter load run
on one thread, `decoder_thread()`, shared by the process's engines, since libgomp keeps a worker
team per thread and throttles them all once they outnumber the cores. Without it (a training
process) `generate` runs on the caller's thread and a stream on a fresh thread per call.

On CPU (why and measured effects: docs/CPU.md): base GEMMs as calibrated (`quantize`: None,
"fp16" weights with fp32 sums via `cpu_kernels.fp16_linear`, "int8"; "auto" = `flags_quantize`),
each prompt prefilled once per call and its KV cache repeated for its rows (`_shared_prefill`),
and a KV cache preallocated for the whole call and written in place (`preallocated_cache`).
Left out: KV-cache reuse across calls (the next round prefills again).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import queue
import re
import threading
import time
from concurrent.futures import Future

import torch
import torch.nn.functional as F
from transformers import (AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList,
                          StoppingCriteria, StoppingCriteriaList, TemperatureLogitsWarper, TopPLogitsWarper)
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.streamers import BaseStreamer

from trainer.dtypes import DTYPES, resolve_dtype

from collab_app.engines.device import QUANTIZE, checkpoint_dtype, flags_quantize

from collab_app.engines.requests import chat_prompt_ids, check_lengths, check_requests
from collab_app.cpu import huge_pages
from collab_app.engines.agents import AgentTable
from collab_app.engines.cpu_sampler import sample_rows
from collab_app.engines.engine_types import EngineError, Progress, Request, Sample, Sampling, sampling_meta
from trainer.dtypes import gqa_attention, resolve_device

log = logging.getLogger(__name__)


def row_segments(names: list[str | None]) -> list[tuple[int, int, str]]:
    """[(start, end, adapter)] for each run of consecutive rows on one adapter; base rows (None)
    get none. ["a", "a", None, "b", "b"] -> [(0, 2, "a"), (3, 5, "b")]."""
    out: list[tuple[int, int, str]] = []
    for r, name in enumerate(names):
        if name is None:
            continue
        if out and out[-1][2] == name and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1, name)
        else:
            out.append((r, r + 1, name))
    return out


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers (batch, kv heads, capacity,
    head_dim) with room for `capacity` positions: an update writes its positions in place, where
    DynamicLayer's `torch.cat` copies the whole cache every layer and step. The views hold the same
    values as DynamicLayer's tensors (only their head stride differs), so the sums are unchanged.
    When the room runs out the buffers double (one copy). Whatever replaces `self.keys` with a
    tensor of its own (`batch_repeat_interleave` after the shared prefill, `batch_select_indices`,
    `reorder_cache`, `reset`) is copied into new buffers at the next update, once; `crop` keeps a
    view of the buffers, so the next update writes over the cropped positions."""

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = capacity
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        buf = self._buffers
        own = (buf is not None and self.keys.data_ptr() == buf[0].data_ptr()
               and buf[0].shape[:-2] == key_states.shape[:-2] and buf[0].dtype == key_states.dtype)
        if not own or end > buf[0].shape[-2]:
            # doubling only when our own room ran out: a repeated prefill's rows take `capacity`
            room = max(end, self.capacity, 2 * buf[0].shape[-2] if own else 0)
            buf = tuple(s.new_empty((*s.shape[:-2], room, s.shape[-1])) for s in (key_states, value_states))
            if start:
                buf[0][..., :start, :] = self.keys
                buf[1][..., :start, :] = self.values
            self._buffers = buf
        buf[0][..., start:end, :] = key_states
        buf[1][..., start:end, :] = value_states
        self.keys, self.values = buf[0][..., :end, :], buf[1][..., :end, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._buffers = None
        super().reset()


def preallocated_cache(capacity: int) -> DynamicCache:
    """An empty DynamicCache whose layers (made as the model's layers first write to it) are
    PreallocatedLayer(capacity): for a `generate` call, capacity = padded prompt + max_new_tokens."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(PreallocatedLayer, capacity)
    return cache


def _add_deltas(a, b, mask, scaling, module, args, out):
    """Forward hook on one peft LoRA layer whose adapters are switched off: adds every row's own
    delta, peft's vanilla-LoRA `lora_B(lora_A(x)) * scaling` in `a`'s dtype (team_lora: the
    adapters' on a GPU, fp32 on a CPU; dropout is the identity in eval), to the base layer's
    output, for all the batch's adapters at once: `a` stacks
    their A matrices (sum of ranks R, d_in), `b` their B matrices side by side (d_out, R), `mask`
    (rows, 1, R) is 1 in the columns of each row's own adapter and 0 in the others' (which then add
    exact zeros), `scaling` (rows, 1, 1) each row's adapter's scaling, applied last as peft does.
    x: (rows, T, d_in), out: (rows, T, d_out)."""
    h = F.linear(args[0].to(a.dtype), a) * mask            # (rows, T, R)
    out += F.linear(h, b) * scaling                         # (rows, T, d_out), rounded once to out's dtype
    return out


def _packed_forward(linear, bias, x):
    """An nn.Linear's forward through a packed GEMM (`cpu_kernels.BASE_GEMMS`), which takes 2-D input."""
    return linear(x.reshape(-1, x.shape[-1]), None, bias).reshape(*x.shape[:-1], -1)


@contextlib.contextmanager
def team_lora(peft_model, names: list[str | None]):
    """For one batched forward pass (or `generate`) of `peft_model` whose row r runs peft adapter
    names[r] (None = the base): peft's own adapter layers off, a hook per LoRA layer adding each
    row's delta (none for a batch of base rows only: the plain base). Nothing to do when there is
    no peft model. Variants other than vanilla LoRA (DoRA, ...) are refused: the engine loads
    only what the trainer saves (plain LoRA).

    One hook per layer does two GEMMs and a mask for the whole batch whatever the number of
    agents, rather than two per agent slice: on a GPU every kernel launch is a fixed cost per layer
    and step, and the per-slice version was 2.3x the launches of the base model alone (H200,
    8 rows x 128 tokens, same generate call: 8.2 s per slice, 5.8 s fused, 4.1 s without adapters).
    The cost on a CPU: the rank columns of the other agents (2 x 8
    instead of 8 per row), nothing next to the base GEMMs.

    On a CPU the deltas are computed in fp32 whatever the model's dtype: torch's bf16 GEMM at
    LoRA's shapes (8 rows x rank 16) is several times slower than fp32 (with AMX, one thread:
    ~90 vs ~40 µs per layer, about a base GEMM's time), and fp32 rounds the delta once, not at each
    GEMM. On a GPU they stay in the adapters' dtype (a cast would be one more kernel per layer)."""
    if peft_model is None:
        yield
        return
    segments = row_segments(names)
    from peft.tuners.lora import LoraLayer

    handles = []
    with peft_model.disable_adapter():
        try:
            for module in peft_model.modules():
                if not isinstance(module, LoraLayer):
                    continue
                a_parts, b_parts, spans, width = [], [], [], 0
                for start, end, name in segments:
                    if name not in module.lora_A:
                        continue
                    if name in getattr(module, "lora_variant", {}):
                        raise EngineError(f"adapter {name!r} is a LoRA variant (e.g. DoRA) this engine does not "
                                          f"serve; save plain LoRA adapters")
                    a, b = module.lora_A[name].weight, module.lora_B[name].weight    # (r, d_in), (d_out, r)
                    a_parts.append(a)
                    b_parts.append(b)
                    spans.append((start, end, width, width + a.shape[0], module.scaling[name]))
                    width += a.shape[0]
                if not spans:
                    continue
                device = a_parts[0].device
                dtype = torch.float32 if device.type == "cpu" else a_parts[0].dtype
                mask = torch.zeros(len(names), 1, width, dtype=dtype)
                scale = torch.zeros(len(names), 1, 1, dtype=dtype)
                for start, end, c0, c1, scaling in spans:
                    mask[start:end, :, c0:c1] = 1
                    scale[start:end] = scaling
                hook = functools.partial(_add_deltas, torch.cat(a_parts).to(dtype), torch.cat(b_parts, 1).to(dtype),
                                         mask.to(device), scale.to(device))
                handles.append(module.register_forward_hook(hook))
            yield
        finally:
            for h in handles:
                h.remove()


class _DecodeThread:
    """One daemon thread that runs submitted calls in order (`submit` -> concurrent.futures.Future).
    Not a ThreadPoolExecutor: its worker is not a daemon, and the interpreter waits for it at exit,
    so stopping `collab serve` in the middle of a round would wait for the round to finish."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.ident = self._thread.ident
        self.users = 0   # engines that hold it (decoder_thread(use=True) / release_decoder_thread)

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:   # stop(): the thread ends, and libgomp frees its OpenMP team with it
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                    future.set_exception(e)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread after the calls already submitted (waits up to `timeout` for them,
        unless called from the thread itself)."""
        self._calls.put(None)
        if threading.get_ident() != self.ident:
            self._thread.join(timeout)


DECODE_THREAD = "hf-decode"   # the decode thread's name
_DECODER: _DecodeThread | None = None
_DECODER_LOCK = threading.Lock()


# A stream decodes its newest snapshot at most this often (and at once when generate ends). Why:
# each snapshot wakes the consuming thread, which takes the GIL from the generating thread to
# decode every row; on a GPU, where that thread's Python sets the pace of a decode step (~30 ms),
# a snapshot per step made a streamed round 1.30x a non-streamed one (5.18 vs 3.99 s, 8 rows x 128
# tokens, H200). Ten a second still reads as smooth text.
STREAM_INTERVAL_S = 0.1


def decoder_thread(use: bool = False) -> _DecodeThread:
    """The process's one decode thread, shared by every engine built with decode_thread=True
    (module doc, "Threads"), started if there is none; `use=True` also counts the caller (an
    engine) among its users. A daemon: exit does not wait for it. It ends when its last user
    releases it (`release_decoder_thread`, from TransformersEngine.close): while it lives, its
    OpenMP team counts against the cores, and every other thread's torch work in the process
    (a trainer's step, a test after the engine's) runs with libgomp's spinning throttled: the
    step tests of tests/trainer took 1.5-1.9x as long beside an idle engine's live thread as
    without it."""
    global _DECODER
    with _DECODER_LOCK:
        if _DECODER is None:
            _DECODER = _DecodeThread(DECODE_THREAD)
        _DECODER.users += bool(use)
        return _DECODER


def release_decoder_thread(decoder: _DecodeThread) -> None:
    """An engine is done with the decode thread; the last user's release ends it."""
    global _DECODER
    with _DECODER_LOCK:
        decoder.users -= 1
        if decoder.users > 0:
            return
        if _DECODER is decoder:
            _DECODER = None
    decoder.stop()


class SampledLogprobs(LogitsProcessor):
    """log pi_T(sampled token) per step without keeping the logits: step t's log_softmax waits
    until step t+1's call, whose input_ids end with the token sampled at t; `finish` takes the
    last step's from the final sequences. Changes no scores. Memory: one (rows, vocab) tensor.
    It sees the scores after the processors the model's generation_config asks for (none for
    SmolLM2: no repetition penalty or suppressed tokens), before generate's temperature and
    top-p warpers, so it applies the same ones to its own copy: the log-probs are those of the
    distribution the token is drawn from (engine_types). temperature 0 (greedy): untempered."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0):
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_p = TopPLogitsWarper(top_p) if temperature > 0 and top_p < 1 else None
        self.pending: torch.Tensor | None = None   # (rows, vocab) log_softmax of the last step
        self.taken: list[torch.Tensor] = []         # (rows,) per finished step

    def _take(self, tokens: torch.Tensor) -> None:
        if self.pending is not None:
            self.taken.append(self.pending.gather(1, tokens[:, -1:]).squeeze(1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._take(input_ids)
        drawn = scores.float()                                                   # (rows, vocab)
        if self.temperature != 1.0:
            drawn = drawn / self.temperature             # as TemperatureLogitsWarper: a new tensor
        if self.top_p is not None:
            drawn = self.top_p(input_ids, drawn)         # -inf outside the nucleus (a new tensor)
        self.pending = torch.log_softmax(drawn, -1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(rows, new tokens) log-probs, given generate's output sequences."""
        self._take(sequences)
        self.pending = None
        return torch.stack(self.taken, 1)


class InverseCDFSampling(LogitsProcessor):
    """The draw itself, as the last logits processor of a greedy `generate` (on CPU): transformers'
    own temperature and top-p warpers, then `cpu_sampler.sample_rows`; every other token's score
    becomes -inf, so generate's argmax takes the drawn token. Why: transformers samples with
    `torch.multinomial`, whose one-sample path on CPU is an exponential race (`exponential_` for
    every vocabulary entry): 10-16 ms a decode step at 8 rows x 49,152 with AMX, the
    inverse CDF 0.3-0.8 ms. Same distribution, other draws for a seed."""

    def __init__(self, temperature: float, top_p: float):
        self.warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        tokens = sample_rows(scores.float().softmax(-1))                                  # (rows,)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)   # (rows, vocab)


class _RowStreamer(BaseStreamer, StoppingCriteria):
    """transformers streamer + stopping criterion for `generate_stream`. `put` (in the generate
    thread) gets the prompt once, then each step's new token per row; it appends them, and the
    log-probs `SampledLogprobs` has taken since, to per-row lists that only grow, and queues the
    counts (tokens, log-probs) so far: the consumer slices the lists at those counts. O(1) per
    step on the generating thread (it stacked and copied every step so far, every step, before).
    `ended` is set once generate returns. As a stopping criterion it ends generation once the
    consumer set `cancel`."""

    def __init__(self, logprobs: SampledLogprobs):
        self.queue: queue.Queue = queue.Queue()
        self.logprobs = logprobs
        self.tokens: list[list[int]] = []   # per row, tokens so far
        self.lps: list[list[float]] = []    # per row, log-probs so far (one step behind the tokens)
        self.prompt_seen = False
        self.cancel = False
        self.ended = threading.Event()
        self.result = self.error = None

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        new = value.reshape(-1).tolist()                            # (rows,)
        if not self.tokens:
            self.tokens, self.lps = [[] for _ in new], [[] for _ in new]
        for row, tok in zip(self.tokens, new):
            row.append(tok)
        for step in self.logprobs.taken[len(self.lps[0]):]:         # (rows,) each
            for row, lp in zip(self.lps, step.tolist()):
                row.append(lp)
        self.queue.put((len(self.tokens[0]), len(self.lps[0])))

    def end(self):
        pass

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.cancel, dtype=torch.bool, device=input_ids.device)


class _BeforeStep(StoppingCriteria):
    """Never stops anything: runs `SpareCores.before_step` between decode steps, on the generate
    thread (whose affinity and torch threads it widens or narrows)."""

    def __init__(self, spare):
        self.spare = spare

    def __call__(self, input_ids, scores, **kwargs):
        self.spare.before_step()
        return torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)


class TransformersEngine:
    name = "transformers"

    def __init__(self, model_path: str, dtype: str = "auto", max_model_len: int = 2048,
                 seed: int | None = None, device: str | None = None, num_threads: int | None = None,
                 quantize: str | None = "auto", decode_thread: bool = False):
        if dtype not in DTYPES:
            raise EngineError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if quantize != "auto" and quantize not in QUANTIZE:
            raise EngineError(f"quantize must be one of {QUANTIZE} or 'auto', got {quantize!r}")
        if num_threads:
            # torch's intra-op threads for this process. On a box whose cores other processes also
            # use, fewer threads can be much faster (`collab bench generate` measured 1 thread at
            # 27 tok/s vs 2 threads at 3 tok/s with load avg 8 on 2 cores: OpenMP barriers spin).
            torch.set_num_threads(num_threads)
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.device = device or resolve_device("auto")  # the trainer's rule: cuda > mps > cpu
        self.dtype = resolve_dtype(dtype, self.device)  # "auto": bf16 only where the hardware has it natively
        # a step's temporaries (the KV cache grown by a copy each step, the logits) reused, not
        # faulted in afresh every step (huge_pages.keep_freed_memory; glibc only)
        if self.device == "cpu":
            huge_pages.keep_freed_memory()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"  # decoder-only batched generate needs left padding
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.quantize = flags_quantize(self.device, self.dtype, checkpoint_dtype(model_path)) if quantize == "auto" else quantize
        if self.quantize and (self.device != "cpu" or self.dtype != "float32"):   # refused before the weights load
            raise EngineError(f"quantize={self.quantize!r} is for a CPU engine in float32 (got {self.device}, "
                              f"{self.dtype}): pass quantize=None, or dtype='float32' on a CPU")
        # decode_thread: one thread of the engine's own loads the weights and runs every batch and
        # adapter load (module doc, "Threads"); else they run on the caller's thread
        self._decoder = decoder_thread(use=True) if decode_thread else None
        try:
            self._on_decoder(self._load_model)
        except BaseException:
            self.close()   # no engine: its use of the decode thread ends here
            raise
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self.eos_ids.discard(None)
        self._peft = None  # PeftModel, created on the first adapter (it wraps self.model in place)
        self._agents = AgentTable()  # agent -> (peft adapter name, version)
        self._names = itertools.count(1)
        self._lock = threading.Lock()
        self.spare_cores = None   # lending.SpareCores: `collab serve` lends the trainer child's cores between its steps
        if seed is not None:
            torch.manual_seed(seed)

    def _on_decoder(self, fn, *args):
        """fn(*args) on the engine's decode thread where it has one (and the caller is not it), else here."""
        if self._decoder is None or threading.get_ident() == self._decoder.ident:
            return fn(*args)
        return self._decoder.submit(fn, *args).result()

    def _load_model(self) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, self.dtype)).to(self.device).eval()
        gqa_attention(self.model, self.device)   # on a CPU: masked attention without copied key/value heads (trainer.dtypes)
        if self.quantize:   # before any adapter: peft's LoRA layers wrap the packed base layers
            self._pack_base_gemms(self.quantize)
        if self.device == "cpu":
            log.info("transformers engine: %s", huge_pages.summary())

    def _pack_base_gemms(self, kind: str) -> None:
        """Every nn.Linear of the base model computes through `kind`'s packed weights (module doc)."""
        from collab_app.engines.cpu_kernels import BASE_GEMMS
        try:
            for module in self.model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.forward = functools.partial(_packed_forward, BASE_GEMMS[kind](module.weight), module.bias)
        except (RuntimeError, AttributeError) as e:   # e.g. no fbgemm in this build of torch / on this CPU
            raise EngineError(f"cannot switch the base GEMMs to {kind} here ({e}): pass quantize=None") from e

    # -- adapters ---------------------------------------------------------------------------
    def register_agent(self, agent: str) -> None:
        with self._lock:
            self._agents.register(agent)

    def adapter_version(self, agent: str) -> int | None:
        return self._agents.version(agent)

    def load_adapter(self, agent: str, path: str | None, version: int | None) -> None:
        with self._lock:   # taken before the hop to the decode thread, which only lock holders use
            self._on_decoder(self._load_adapter, agent, path, version)

    def _load_adapter(self, agent: str, path: str | None, version: int | None) -> None:
        from peft import PeftModel

        name = None
        if path is not None:
            # A fresh peft name per load: the new weights never mix with the old ones.
            name = f"v{next(self._names)}_{re.sub(r'[^0-9A-Za-z_]', '_', agent)}"
            try:
                if self._peft is None:
                    self._peft = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
                else:
                    self._peft.load_adapter(path, adapter_name=name)
            except (OSError, ValueError) as e:
                raise EngineError(f"cannot load adapter {path!r} for agent {agent!r}: {e}; "
                                  f"pass a peft LoRA directory (adapter_config.json + weights)") from e
        old = self._agents.set(agent, name, version)
        if old is not None:
            # Make some other adapter active first: deleting the active one makes peft warn
            # ("... was active which is now deleted") on every hot-swap.
            others = [n for n in self._peft.peft_config if n != old]
            if others and self._peft.active_adapter == old:
                self._peft.set_adapter(others[-1])
            self._peft.delete_adapter(old)
            if not self._peft.peft_config:  # no adapter left: peft cannot run with none, go back to the base
                self.model = self._peft.unload()
                self._peft = None

    # -- generation -------------------------------------------------------------------------
    def generate(self, requests: list[Request], n: int, sampling: Sampling) -> list[list[Sample]]:
        last = None
        for last in self._generate(requests, n, sampling, progress=False):
            pass
        return last.result()

    def generate_stream(self, requests: list[Request], n: int, sampling: Sampling):
        """One `model.generate` in a thread; a streamer (`_RowStreamer`) hands each decode step's
        tokens back here, where they are decoded into a `Progress` (at most one per step and one
        per STREAM_INTERVAL_S: steps in between are skipped, each snapshot being cumulative). A row is
        done one step after its EOS (its log-prob arrives with the next step's logits). Stopping
        the stream early stops the generate thread at its next step."""
        return self._generate(requests, n, sampling, progress=True)

    def _generate(self, requests: list[Request], n: int, sampling: Sampling, progress: bool):
        """generate_stream's body. progress=False (`generate`, the trainer's rollouts): no
        streamer and no per-step decoding (which would hold the GIL against the generating thread
        once per step for every row; on a GPU that thread sets the pace), and no thread of its own
        unless cores are lent (`spare_cores`): `generate` runs on the caller's."""
        check_requests(self, requests, n, sampling, self._agents)
        prompt_ids = [chat_prompt_ids(self.tokenizer, r) for r in requests]
        check_lengths(prompt_ids, sampling, self.max_model_len)
        with self._lock:
            agents = {r.agent: self._agents.served(r.agent) for r in requests}  # versions this batch runs on
            # requests sorted by adapter (stable), each request's n rows together: every agent's
            # rows are one slice of the batch (team_lora's mask is the same either way; sorted, it
            # is filled from one span per agent instead of one per request)
            order = sorted(range(len(requests)), key=lambda i: agents[requests[i].agent][0] or "")
            rows = [(i, prompt_ids[i]) for i in order for _ in range(n)]
            prompts = self.tokenizer.pad({"input_ids": [prompt_ids[i] for i in order]}, padding=True, return_tensors="pt")
            batch = {k: v.repeat_interleave(n, 0) for k, v in prompts.items()}   # (rows, T): each prompt's n rows
            logprobs = SampledLogprobs(sampling.temperature, sampling.top_p)
            streamer = _RowStreamer(logprobs)
            kw = dict(
                input_ids=batch["input_ids"].to(self.device), attention_mask=batch["attention_mask"].to(self.device),
                max_new_tokens=sampling.max_new_tokens, do_sample=sampling.temperature > 0,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=sorted(self.eos_ids),
                return_dict_in_generate=True, logits_processor=LogitsProcessorList([logprobs]),
            )
            criteria = [streamer] if progress else []
            spare = self.spare_cores
            if spare is not None:   # called after each step's forward, on the generating thread
                criteria.append(_BeforeStep(spare))
            if progress:
                kw["streamer"] = streamer
            if criteria:
                kw["stopping_criteria"] = StoppingCriteriaList(criteria)
            if sampling.temperature > 0 and self.device == "cpu":
                # the draw as a logits processor after the log-probs', generate itself greedy
                kw["logits_processor"].append(InverseCDFSampling(sampling.temperature, sampling.top_p))
                kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            elif sampling.temperature > 0:
                # top_k=0: the model's generation_config may carry a default top-k (HF's is 50); vLLM has none.
                kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
            else:
                kw.update(temperature=None, top_p=None, top_k=None)
            model = self._peft if self._peft is not None else self.model
            names = [agents[requests[i].agent][0] for i, _ in rows]   # peft adapter per row, None = base
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)

            def run():
                try:
                    if spare is not None:   # the prefill comes before the first criterion call
                        spare.before_step()
                    with torch.inference_mode():
                        room = batch["input_ids"].shape[1] + sampling.max_new_tokens   # every position of the call
                        if n > 1:
                            kw["past_key_values"] = self._shared_prefill(model, prompts, names[::n], n, room)
                        else:
                            kw["past_key_values"] = preallocated_cache(room)
                        with team_lora(self._peft, names):
                            streamer.result = model.generate(**kw)
                except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                    streamer.error = e
                finally:
                    if spare is not None:
                        spare.end()
                    streamer.queue.put(None)
                    streamer.ended.set()

            if self._decoder is not None and threading.get_ident() != self._decoder.ident:
                thread = self._decoder.submit(run)   # the engine's own decode thread (module doc, "Threads")
            elif progress or spare is not None:
                # a stream is read here while generate runs; lent cores change the affinity and
                # torch threads of the thread that decodes, which must not be the caller's
                thread = threading.Thread(target=run, name="hf-generate", daemon=True)
                thread.start()
            else:
                # no stream to read: generate on the caller's thread, whose OpenMP team already
                # exists (module doc, "Threads": a thread of its own next to a live team took 19.3
                # vs 15.3 s on the AVX2 CPU; on an H200 15.9 vs 8.2 s)
                thread = None
                run()
            texts = [[""] * n for _ in requests]
            done: list[list[Sample | None]] = [[None] * n for _ in requests]
            try:
                finished = False
                last = None
                while not finished:
                    if last is not None:   # at most one snapshot per STREAM_INTERVAL_S (STREAM_INTERVAL_S's doc)
                        streamer.ended.wait(max(0.0, last + STREAM_INTERVAL_S - time.monotonic()))
                    item = streamer.queue.get()
                    while item is not None and not streamer.queue.empty():  # skip to the newest step
                        nxt = streamer.queue.get()
                        if nxt is None:  # generate ended: show the newest step, then stop
                            finished = True
                            break
                        item = nxt
                    if item is None:
                        break
                    last = time.monotonic()
                    toks = [row[:item[0]] for row in streamer.tokens]   # the lists grow under us: cut at the counts
                    lps = [row[:item[1]] for row in streamer.lps]
                    for r, (i, _) in enumerate(rows):
                        j = r % n
                        if done[i][j] is not None:
                            continue
                        end = next((t + 1 for t, tok in enumerate(toks[r]) if tok in self.eos_ids), None)
                        if end is not None and len(lps[r]) >= end:
                            done[i][j] = self._sample(requests[i], agents, prompt_ids[i], toks[r][:end], lps[r][:end],
                                                      True, sampling)
                            texts[i][j] = done[i][j].text
                        else:
                            text = self.tokenizer.decode(toks[r][:end], skip_special_tokens=True)
                            if not text.endswith("\ufffd"):  # hold back a half-decoded character
                                texts[i][j] = text
                    if any(d is None for row in done for d in row):  # the last one comes from the full result
                        yield Progress([list(t) for t in texts], [list(d) for d in done])
            finally:
                streamer.cancel = True  # a stream abandoned early stops generate at its next step
                if isinstance(thread, threading.Thread):
                    thread.join()
                elif thread is not None:
                    thread.result()   # run() keeps its errors in streamer.error
            if streamer.error is not None:
                raise streamer.error
            out = streamer.result
            new = out.sequences[:, batch["input_ids"].shape[1]:]
            lp = logprobs.finish(out.sequences)                                  # (rows, new tokens)
            if lp.shape != new.shape:
                raise EngineError(f"log-probs for {tuple(lp.shape)} tokens but {tuple(new.shape)} generated: "
                                  f"transformers changed how logits processors are called")
        result = self._samples(requests, rows, new.tolist(), lp.tolist(), prompt_ids, agents, n, sampling)
        yield Progress([[s.text for s in row] for row in result], [list(row) for row in result])

    def _shared_prefill(self, model, prompts, names: list[str | None], n: int, room: int):
        """The KV cache of every request's prompt but its last token, computed once per request
        and repeated for its n rows (`generate` then runs only the last prompt token per row and
        decodes). A prompt's G samples share it, and `generate` alone would prefill each row's
        copy: on a 2-core AVX2 CPU, 2 TL;DR prompts of 106 / 126 tokens x G=8 took 5.7 s of
        prefill in a 13.8 s rollout of 40 tokens.
        `prompts`: the left-padded requests, one row each, in batch order; names[r]: row r's
        adapter; room: the positions each row will cache (`preallocated_cache`). Positions as
        `generate` derives them from the mask (pads masked, their position 1)."""
        ids = prompts["input_ids"].to(self.device)
        mask = prompts["attention_mask"].to(self.device)
        pos = mask.long().cumsum(-1) - 1
        pos.masked_fill_(mask == 0, 1)
        with team_lora(self._peft, names):
            out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1],
                        past_key_values=preallocated_cache(0), use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)   # (requests, ...) -> (requests * n, ...), rows in batch order
        # The prompts were cached at their own size (room for the whole call per request would be
        # taken, then dropped by the repeat: +7% peak memory in the first version); the rows'
        # buffers take the call's room at their first decode step, the one copy a repeat makes anyway.
        for layer in cache.layers:
            layer.capacity = room
        return cache

    def _sample(self, request, agents, prompt_ids, toks, lp, stopped, sampling: Sampling) -> Sample:
        return Sample(
            agent=request.agent, adapter_version=agents[request.agent][1],
            prompt_token_ids=prompt_ids, text=self.tokenizer.decode(toks, skip_special_tokens=True),
            token_ids=toks, logprobs=lp, finish_reason="stop" if stopped else "length",
            meta={"engine": self.name, "model": self.model_path, "sampling": sampling_meta(sampling)},
        )

    def _samples(self, requests, rows, seqs, lps, prompt_ids, agents, n, sampling) -> list[list[Sample]]:
        result: list[list[Sample]] = [[] for _ in requests]
        for (i, _), toks, lp in zip(rows, seqs, lps):
            end = next((t + 1 for t, tok in enumerate(toks) if tok in self.eos_ids), None)
            # up to and including EOS; pad after it dropped
            result[i].append(self._sample(requests[i], agents, prompt_ids[i], toks[:end], lp[:end], end is not None,
                                          sampling))
        return result

    def close(self) -> None:
        self._peft = self.model = None
        decoder, self._decoder = getattr(self, "_decoder", None), None
        if decoder is not None:   # the last engine on the decode thread ends it (decoder_thread's doc)
            release_decoder_thread(decoder)
        huge_pages.give_back_freed_memory()
