"""Run a command on some cores only (`collab serve`'s trainer child): affinity and thread counts,
then exec, so the pid and the signals are the command's own. With `--load-on`, the child loads
torch on a wider mask first and confines itself after (`confine_after_torch`), so that libgomp
counts every core it may later widen onto. The child gets libgomp's default spin and 4 KiB pages
back (process.py: those settings are for a serving process)."""
from __future__ import annotations

import os
import sys

from collab_app.cpu import process
from collab_app.cpu.cores import THREAD_VARS, confine, fmt_cores

CONFINE_VAR = "COLLAB_CONFINE_AFTER_TORCH"   # `pin --load-on`: the cores the child confines itself to once torch is loaded


def pinned_command(cores, argv: list[str], load_on=None) -> list[str]:
    """`argv` run on `cores` only (through `pin`: affinity + thread counts, then exec, so the pid
    and signals are argv's own). `load_on` (a superset of `cores`): argv starts on those cores and
    confines itself to `cores` once torch is loaded (it must call `confine_after_torch`), so that
    libgomp counts them all and a later widening onto them runs at full speed (module doc)."""
    wide = ["--load-on", fmt_cores(load_on)] if load_on and set(load_on) > set(cores) else []
    return [sys.executable, "-m", "collab_app.cpu.pin", fmt_cores(cores), *wide, "--", *argv]


def confine_after_torch() -> None:
    """In a process started by `pin --load-on`: load torch (and its libgomp) now, on the wide
    mask, then confine this process to its own cores. Elsewhere nothing."""
    cores = os.environ.pop(CONFINE_VAR, "")
    if not cores:
        return
    import torch

    own = [int(c) for c in cores.split(",")]
    confine(own)
    torch.set_num_threads(len(own))


def pin_and_exec(cores: list[int], argv: list[str], load_on: list[int] | None = None) -> None:
    if load_on:
        confine(load_on)
        os.environ[CONFINE_VAR] = fmt_cores(cores)
    else:
        confine(cores)
    for var in THREAD_VARS:
        os.environ[var] = str(len(cores))   # torch reads OMP_NUM_THREADS when it starts
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)   # the serving process's cores, not ours
    if os.environ.get("GOMP_SPINCOUNT") == process.GOMP_SPINCOUNT:   # ours, not the user's:
        os.environ["GOMP_SPINCOUNT"] = process.LIBGOMP_DEFAULT_SPINCOUNT   # no long spin on lent cores
    # a trainer's steps allocate and free their activations every step: in huge pages they ran
    # slower (cpu/huge_pages.py), so the pinned child keeps torch's 4 KiB pages
    os.environ[process.THP_VAR] = "0"
    os.execvp(argv[0], argv)


def main(argv: list[str] | None = None) -> int:
    """`python -m collab_app.cpu.pin CORES [--load-on CORES] -- CMD ...`: CMD on CORES only."""
    argv = sys.argv[1:] if argv is None else argv
    load_on = None
    if len(argv) > 2 and argv[1] == "--load-on":
        load_on = [int(c) for c in argv[2].split(",")]
        argv = argv[:1] + argv[3:]
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m collab_app.cpu.pin CORES [--load-on CORES] -- CMD ...")
    pin_and_exec([int(c) for c in argv[0].split(",")], argv[2:], load_on)
    return 0   # not reached


if __name__ == "__main__":
    sys.exit(main())
