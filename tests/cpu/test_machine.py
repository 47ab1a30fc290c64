"""What names this CPU (collab_app/cpu/machine.py) on the kinds of Linux /proc/cpuinfo there are: the
name starts the calibration's cache key (engines/calibrate.py machine_key), so two different CPUs
must not share one."""
from __future__ import annotations

import pytest

from collab_app.cpu import machine

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16
"""

# a Neoverse N1 (Graviton2, Ampere Altra): no "model name", only the codes lscpu has names for
NEOVERSE_N1 = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""
LSCPU_N1 = "Architecture:  aarch64\nVendor ID:     ARM\nModel:         1\nModel name:    Neoverse-N1\n"
LSCPU_BIG_LITTLE = ("Architecture: aarch64\nVendor ID: ARM\nModel name: Cortex-A55\nModel: 0\n"
                    "Model name: Cortex-A76\nModel: 1\n")
LSCPU_UNKNOWN_PART = "Architecture: aarch64\nVendor ID: Phytium\nModel name: -\n"


@pytest.fixture
def this_cpu(monkeypatch):
    """this_cpu(cpuinfo, lscpu): /proc/cpuinfo reads `cpuinfo`; lscpu prints `lscpu` (None: absent)."""
    def pretend(cpuinfo: str, lscpu: str | None, arch: str = "aarch64"):
        monkeypatch.setattr(machine, "_cpuinfo_lines", lambda: cpuinfo.splitlines(keepends=True))
        monkeypatch.setattr(machine.platform, "machine", lambda: arch)
        monkeypatch.setattr(machine, "_lscpu", lambda: lscpu or "")
        machine.cpu_model.cache_clear()
        machine.cpu_flags.cache_clear()

    yield pretend
    machine.cpu_model.cache_clear()
    machine.cpu_flags.cache_clear()


def test_an_x86_cpu_is_its_model_name_and_flags(this_cpu):
    this_cpu(XEON, lscpu=LSCPU_N1, arch="x86_64")        # /proc/cpuinfo's name wins; lscpu not asked
    assert machine.cpu_model() == "Intel(R) Xeon(R) Processor"
    assert machine.cpu_flags() == "amx_bf16 amx_tile avx2 avx512_bf16 avx512_vnni avx512f fpu sse2"


def test_an_arm_core_on_linux_is_named_by_lscpu(this_cpu):
    this_cpu(NEOVERSE_N1, lscpu=LSCPU_N1)
    assert machine.cpu_model() == "ARM Neoverse-N1"
    assert "asimddp" in machine.cpu_flags().split() and "atomics" in machine.cpu_flags().split()


def test_a_big_little_chip_names_both_clusters(this_cpu):
    this_cpu(NEOVERSE_N1, lscpu=LSCPU_BIG_LITTLE)
    assert machine.cpu_model() == "ARM Cortex-A55/Cortex-A76"


@pytest.mark.parametrize("lscpu", [None, LSCPU_UNKNOWN_PART], ids=["no lscpu", "a part lscpu cannot name"])
def test_an_arm_core_without_a_name_is_its_codes_never_just_the_architecture(this_cpu, lscpu):
    this_cpu(NEOVERSE_N1, lscpu=lscpu)
    assert machine.cpu_model() == "aarch64 implementer 0x41 part 0xd0c variant 0x3"


def test_a_machine_without_proc_cpuinfo_falls_back_to_platform(this_cpu, monkeypatch):
    this_cpu("", lscpu=LSCPU_N1, arch="riscv64")
    monkeypatch.setattr(machine.sys, "platform", "freebsd14")
    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    assert machine.cpu_model() == "riscv64" and machine.cpu_flags() == ""


def test_the_calibration_key_tells_apart_the_same_model_with_other_flags(this_cpu, monkeypatch, tmp_path):
    """A VM can mask some of a CPU's flags from its guest (AVX512-VNNI here, which fbgemm's int8
    kernels use): same model name, same torch capability, other speed. The key must differ, or one
    machine's calibration would be reused on the other."""
    from collab_app.engines import calibrate

    (tmp_path / "model.safetensors").write_bytes(b"0")
    keys = []
    for cpuinfo in (XEON, XEON.replace(" avx512_vnni", "")):
        this_cpu(cpuinfo, lscpu=None, arch="x86_64")
        keys.append(calibrate.machine_key(str(tmp_path), 2))
    assert keys[0] != keys[1]
    assert keys[0].split(" | ")[0] == keys[1].split(" | ")[0] == "Intel(R) Xeon(R) Processor"
