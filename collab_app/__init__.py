"""collab: a team of LLM agents that co-writes / co-codes with a person and learns online (MAGRPO)."""
import os as _os
import sys as _sys

__version__ = "0.1.0"

# OpenMP's workers stay awake between the parallel regions of the engines' decoding threads: with
# libgomp's default spin a region started from a thread other than the main one pays a wake-up of
# the pool's worker, and a compiled bf16 decode step starts ~250 regions. Why 1e8 (~1.2 s of spin
# after the last region), the measurements, and the costs handled elsewhere (the trainer child gets
# libgomp's default back, `cpushare._pin_and_exec`; the engine's widened workers idle while it is
# narrow, `cpushare.SpareCores`): docs/ENGINES.md "OpenMP from the engine's thread". libgomp reads
# GOMP_SPINCOUNT once, when torch loads it, so it is set here, before anything of ours imports
# torch; a value already in the environment wins. No effect with LLVM's libomp (macOS).
GOMP_SPINCOUNT = "100000000"
LIBGOMP_DEFAULT_SPINCOUNT = "300000"   # libgomp's own value when neither this nor OMP_WAIT_POLICY is set
_os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
SPIN_BEFORE_TORCH = "torch" not in _sys.modules   # False: torch came first; its libgomp kept the default

# torch.compile's kernels where a person's other files are (paths.compile_cache_dir), so a compiled
# engine's ~100 s first build happens once per COLLAB_HOME, not after every reboot (torch's default
# is under /tmp) or every restart of a Space with persistent storage. Set at import, before anything
# compiles: torch reads it at its first compile, and every process started from here (the engine
# race's children, a bench's `collab serve` in a fresh COLLAB_HOME, the tests' servers) inherits
# the same cache. A value already in the environment wins.
from collab_app import paths as _paths  # noqa: E402 - no torch (paths and machine read files and the environment)

_COMPILED = _paths.compile_cache_dir()   # once: the machine tag reads /proc/cpuinfo and torch's metadata
_os.environ.setdefault(_paths.COMPILE_CACHE_ENV, _COMPILED)
# vLLM's own cache beside it: a compiled engine's traced model (vLLM's AOT artifact, ~10 MB) and the
# kernels compiled with it, so a later start loads the model instead of tracing it again
# (engines/vllm_team.py compiled_model_kept_on_disk); on a GPU, vLLM's whole compile cache (its key
# holds the device). vLLM's default is ~/.cache/vllm: per user, not per CPU kind, and outside a
# Space's /data. A value already in the environment wins.
_os.environ.setdefault(_paths.VLLM_CACHE_ENV, _paths.vllm_cache_dir(_COMPILED))
# No precompiled header for inductor's C++ kernels: torch keeps it (~150 MB) in
# /tmp/torchinductor_<user>/precompiled_headers whatever the variable above says, and rebuilds it in
# every process that loads a C++ kernel once /tmp has lost it, even when every kernel is cached:
# ~15 s of a compiled engine's start after a reboot. The engine's ~25 kernels compile about as fast
# without it (docs/ENGINES.md "Start-up and compilation"). torch reads it when it imports its
# inductor config, so it is set here too; a value already in the environment wins.
PRECOMPILE_HEADERS_ENV = "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"
_os.environ.setdefault(PRECOMPILE_HEADERS_ENV, "0")

THP_VAR = "THP_MEM_ALLOC_ENABLE"   # torch's allocator: tensors >= 2 MiB in transparent huge pages


def huge_pages_for_serving() -> None:
    """A serving process (engine + app) asks torch's CPU allocator for transparent huge pages
    (collab_app/engines/huge_pages.py: why, the measurements, and why training processes do
    not). torch reads the variable once, at its first allocation, so this only works before
    torch is imported; a value already in the environment wins."""
    if THP_VAR not in _os.environ and "torch" not in _sys.modules:
        _os.environ[THP_VAR] = "1"
