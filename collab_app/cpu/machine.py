"""What this machine is, read without importing torch (collab_app's import uses it): the CPU's
name and flags, and the tag that names a folder of kernels compiled for it. One reader for the
calibration's cache key (engines/calibrate.py), `collab doctor` and the compile cache
(paths.compile_cache_dir)."""
from __future__ import annotations

import functools
import os
import platform
import sys


def _cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.readlines()
    except OSError:               # not Linux
        return []


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo, macOS sysctl, else platform's). An ARM core
    on Linux has no name in /proc/cpuinfo, only its implementer and part codes: lscpu's vendor and
    model names then (it carries the table of codes), else the codes themselves, so that two ARM
    cores are never both just "aarch64" (the calibration's cache key starts with this)."""
    lines = _cpuinfo_lines()
    for line in lines:
        if line.lower().startswith(("model name", "hardware", "cpu model")):
            return line.split(":", 1)[1].strip()
    if lines:
        named = _lscpu_name()
        if named:
            return named
        codes = {}
        for line in lines:
            key, _, value = line.partition(":")
            if key.strip() in ("CPU implementer", "CPU part", "CPU variant"):
                codes.setdefault(key.strip().split()[1], value.strip())
        if codes:
            return " ".join([platform.machine() or "cpu"] +
                            [f"{k} {codes[k]}" for k in ("implementer", "part", "variant") if k in codes])
    if sys.platform == "darwin":
        import subprocess

        with_sysctl = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        if with_sysctl.returncode == 0 and with_sysctl.stdout.strip():
            return with_sysctl.stdout.strip()
    return platform.processor() or platform.machine() or "unknown"


def _lscpu() -> str:
    """What lscpu prints, in the C locale; "" where it is not there (it is util-linux's: on nearly
    every Linux) or fails."""
    import shutil
    import subprocess

    if shutil.which("lscpu") is None:
        return ""
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                              env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _lscpu_name() -> str:
    """lscpu's "Vendor ID" and "Model name"s (two on a big.LITTLE chip, one per cluster), e.g.
    "ARM Neoverse-N1"; "" without lscpu or without a name ("-": a part its table lacks)."""
    vendor, names = "", []
    for line in _lscpu().splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "Vendor ID" and not vendor:
            vendor = value
        elif key == "Model name" and value not in ("", "-") and value not in names:
            names.append(value)
    return " ".join(([vendor] if vendor else []) + ["/".join(names)]) if names else ""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> str:
    """The first core's instruction-set flags, sorted (x86 `flags`, ARM `Features`); "" off Linux."""
    for line in _cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return " ".join(sorted(value.split()))
    return ""


def machine_tag() -> str:
    """What decides the code inductor generates here, short and readable: the CPU model and its
    flags (the vector ISA it picks), $ATEN_CPU_CAPABILITY (which caps that ISA) and torch's
    version, e.g. `intel-r-xeon-r-processor-07d67a834d` (paths.compile_cache_dir says why)."""
    import hashlib
    import re
    from importlib import metadata

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    facts = "|".join([cpu_model(), cpu_flags(), os.environ.get("ATEN_CPU_CAPABILITY", ""), torch_version,
                      platform.machine()])
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-")[:32].strip("-") or "cpu"
    return f"{slug}-{hashlib.sha256(facts.encode()).hexdigest()[:10]}"
