"""Process-wide settings a CPU process makes before torch loads, called explicitly by each entry
point (`collab` commands, `app.py`, the `python -m` children, the tests' conftest): torch and its
libgomp read these variables once, when they load, so no import of ours sets them as a side effect.
A value already in the environment always wins.

- `GOMP_SPINCOUNT`: OpenMP's workers stay awake ~1.2 s between the parallel regions of an engine's
  decoding thread (a compiled bf16 decode step starts ~250 regions; each wake-up of a parked worker
  costs more than the region). The pinned trainer child gets libgomp's default back (pin.py).
- torch.compile's and vLLM's caches under COLLAB_HOME, per machine (paths.compile_cache_dir), so a
  compiled engine's first build happens once per machine, not after every reboot.
- no precompiled header for inductor's C++ kernels (torch keeps it in /tmp and rebuilds it after
  a reboot, ~15 s of a start; the kernels compile as fast without it).
- transparent huge pages for a serving process's large tensors (`huge_pages_for_serving`,
  huge_pages.py says why), never for a training process.
docs/CPU.md has the measurements."""
from __future__ import annotations

import os
import sys

GOMP_SPINCOUNT = "100000000"
LIBGOMP_DEFAULT_SPINCOUNT = "300000"   # libgomp's own value when neither it nor OMP_WAIT_POLICY is set
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"   # torch's own variable: where torch.compile keeps its kernels
VLLM_CACHE_ENV = "VLLM_CACHE_ROOT"               # vLLM's own variable: where vLLM keeps a compiled model
PRECOMPILE_HEADERS_ENV = "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"
THP_VAR = "THP_MEM_ALLOC_ENABLE"   # torch's allocator: tensors >= 2 MiB in transparent huge pages

_prepared_before_torch: bool | None = None   # None: prepare() never ran in this process


def prepare(compile_dir: str) -> None:
    """Set this process's CPU variables (module doc); `compile_dir`: where compiled kernels for
    this machine live (paths.compile_cache_dir()). Idempotent; call it before importing torch."""
    global _prepared_before_torch
    if _prepared_before_torch is None:
        _prepared_before_torch = "torch" not in sys.modules
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    os.environ.setdefault(COMPILE_CACHE_ENV, compile_dir)
    os.environ.setdefault(VLLM_CACHE_ENV, os.path.join(compile_dir, "vllm"))
    os.environ.setdefault(PRECOMPILE_HEADERS_ENV, "0")


def spin_set_before_torch() -> bool:
    """Whether OpenMP's long spin took effect here: prepare() ran before torch loaded (libgomp
    reads GOMP_SPINCOUNT once), or the variable came from the environment of this process."""
    inherited = _prepared_before_torch is None and os.environ.get("GOMP_SPINCOUNT") == GOMP_SPINCOUNT
    return bool(_prepared_before_torch) or inherited


def huge_pages_for_serving() -> None:
    """A serving process (engine + app) asks torch's CPU allocator for transparent huge pages
    (huge_pages.py: why, and why training processes do not). torch reads the variable once, at
    its first allocation, so this only works before torch is imported."""
    if THP_VAR not in os.environ and "torch" not in sys.modules:
        os.environ[THP_VAR] = "1"
