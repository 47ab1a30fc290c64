"""collab: a team of LLM agents that co-writes / co-codes with a person and learns online (MAGRPO)."""
import os as _os
import sys as _sys

__version__ = "0.1.0"

# OpenMP's workers stay awake between the parallel regions of a thread other than the main one
# (docs/ENGINES.md "OpenMP from the engine's thread"). Both CPU engines decode on their own thread;
# with libgomp's default spin, a region started there pays a wake-up of the pool's worker (a
# parallel loop over 24 items: 62-80 µs from a second thread against 4.4 µs from the main thread, on
# the 2-vCPU Xeon; ~12 µs with a long spin), and a compiled bf16 decode step starts ~250 of them.
# Paired A/Bs of rounds (docs/results "OpenMP workers kept awake"): 3e6 spins 0.88x the default's
# round time, 1e7 0.84x, 1e8 another 0.85x of 1e7 and of 3e7. 1e8 spins keep an idle worker busy
# ~1.2 s after the engine's last region (measured ~12 ns a spin) before it sleeps. libgomp reads
# GOMP_SPINCOUNT once, when torch loads it, so it is set here, before anything of ours imports
# torch; a value already in the environment wins. The trainer child gets libgomp's own default back
# (online/cpushare.py `_pin_and_exec`): it runs its regions from its main thread, and a long spin
# there would hold the cores it lends the engine between steps. No effect with LLVM's libomp (macOS).
GOMP_SPINCOUNT = "100000000"
LIBGOMP_DEFAULT_SPINCOUNT = "300000"   # libgomp's own value when neither this nor OMP_WAIT_POLICY is set
_os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
SPIN_BEFORE_TORCH = "torch" not in _sys.modules   # False: torch came first; its libgomp kept the default
