"""Transparent huge pages (2 MiB) for a serving process's large CPU tensors (the weights every
decode step streams and the KV cache), and malloc settings that keep an engine's freed step
temporaries instead of faulting them in again every step.

Why: a CPU decode step reads all of the model's weights for a few rows; through 4 KiB pages that is
tens of thousands of TLB misses a step, and most Linux distributions ship THP in `madvise` mode,
so torch's tensors sit in 4 KiB pages unless asked.

How: torch's own CPU allocator madvises tensors of >= 2 MiB when `THP_MEM_ALLOC_ENABLE=1`; c10
reads the variable once, at its first allocation, so a serving process sets it before torch loads
(`process.huge_pages_for_serving()`, called first by `collab serve`'s entry; `collab bench
generate`'s engine workers too). A value already in the environment wins (`=0` turns it off).
Training processes get `0` (pin.pin_and_exec); in-process `collab train` and the test suite
keep 4 KiB pages. `keep_freed_memory` / `give_back_freed_memory`: glibc's mallopt at an engine's
start, malloc_trim at its close. Left out: memory outside torch's allocator, macOS / Windows.
What each buys, and what was measured and not kept: docs/CPU.md "Huge pages and malloc".
"""
from __future__ import annotations

import sys

from collab_app.cpu.process import THP_VAR as VAR   # "THP_MEM_ALLOC_ENABLE", read by torch's c10 (alloc_cpu.cpp)


# glibc's mallopt parameters (malloc.h) and the values keep_freed_memory sets
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
KEEP_BELOW = 32 << 20    # glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_ABOVE = 1 << 30     # a heap's free top given back only beyond this (mallopt takes an int)
TOP_PAD = 64 << 20       # a thread's heap left in place when all of it is free (glibc's heap size)
_kept = False            # keep_freed_memory took effect in this process (summary() says so)


def keep_freed_memory() -> bool:
    """glibc's malloc keeps what this process frees for its next allocations instead of handing it
    back to the kernel: blocks below 32 MiB come from its heaps (not a fresh mmap each), and a
    heap's free top is trimmed only beyond 1 GiB. Process-wide; True where it took effect (glibc
    on Linux), False elsewhere (nothing changed).

    Why: an engine step allocates and frees the same temporaries every step (at the rollout's 128
    rows: the logits in bf16 and fp32, the raw log-probs and the probabilities, ~90 MB). With
    torch's huge pages on (serving processes, above), those >= 2 MiB tensors are 2 MiB-aligned,
    glibc handed their pages back to the kernel between steps (fresh mappings, trimmed heaps), and
    the kernel faulted and zeroed them again at every step: a rollout round (128 rows x 128 steps) took ~285,000 minor faults
    and 3.1-3.6 s of system time, 1,000-6,500 faults and 0.3-0.5 s with this (AVX512_BF16
    CPU); paired rollout rounds 0.931x (95% 0.907-0.958). The
    cost: memory freed below 32 MiB stays with the process (its peak, which it reaches every
    step anyway) until an engine closes (give_back_freed_memory); larger blocks (weights, the KV
    cache) are still mapped and unmapped as before.
    Both CPU engines call it at start (engine_vllm, engine_hf). The eager fp32 vLLM engine on an
    AVX2 CPU, rollout rounds 0.938x (0.931-0.945), rounds of 8 rows unchanged (0.992x,
    0.982-1.001); the transformers engine (bf16), rollout rounds 0.923x (0.903-0.946)
    and its round's faults ~10,000-16,000 -> ~570, rounds of 8 rows 0.986x (0.966-1.004).
    Left out: tcmalloc (vLLM's advice) needs LD_PRELOAD before the process starts."""
    global _kept
    if _kept or not sys.platform.startswith("linux"):   # set once per process (a second engine finds it set)
        return _kept
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = all(mallopt(param, value) == 1 for param, value in
                ((M_MMAP_THRESHOLD, KEEP_BELOW), (M_TRIM_THRESHOLD, TRIM_ABOVE), (M_TOP_PAD, TOP_PAD)))
    return _kept


def give_back_freed_memory() -> bool:
    """Hand back to the kernel what malloc kept for a closed engine's steps (keep_freed_memory):
    free heap memory of every arena (glibc's `malloc_trim(0)`, after a garbage collection so
    that the engine's objects in reference cycles are freed first). Called by both CPU engines'
    `close()`. True where it trimmed (a process in which keep_freed_memory took effect).

    Why: the freed temporaries of a closed engine's steps otherwise stay with the process until
    it exits. A process that builds engine after engine (`collab bench generate`, the test suite)
    grew with each: the test process held 12-15 GB of a 24 GiB box by the end of the suite, and a
    test module that had closed its engines still held 4.1-5.5 GB, of which `malloc_trim(0)` gave
    back 1.6-3.1 GB; with this the suite's test process averaged
    5.2 GB instead of 9.1.
    The cost: an engine still open in the process faults its step temporaries in again once."""
    if not _kept:
        return False
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def resident() -> tuple[int, int] | None:
    """(bytes resident, bytes of them in transparent huge pages) of this process; None where
    the kernel does not say (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    rss = huge = 0
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) << 10
                elif line.startswith("AnonHugePages:"):
                    huge = int(line.split()[1]) << 10
    except OSError:
        return None
    return rss, huge


def summary() -> str:
    """One log line's worth: how much of this process's memory sits in 2 MiB pages, and whether
    malloc keeps what a step frees (keep_freed_memory)."""
    now = resident()
    kept = f"freed memory kept by malloc: {'yes' if _kept else 'no'}"
    if now is None:
        return f"huge pages: not reported on this platform; {kept}"
    rss, huge = now
    return f"{huge / 2**30:.2f} of {rss / 2**30:.2f} GiB resident in 2 MiB pages; {kept}"
