"""One place decides where collab keeps its files (collab_app/paths.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from collab_app import paths
from collab_app.cpu.machine import machine_tag

ROOT = Path(__file__).resolve().parents[2]


def test_home_store_and_adapters_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("COLLAB_DB", raising=False)
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path))
    assert paths.home() == str(tmp_path)
    assert paths.adapters_dir() == str(tmp_path / "adapters")
    assert paths.store_url() == f"sqlite:///{tmp_path / 'collab.db'}"
    monkeypatch.setenv("COLLAB_HOME", "")                      # empty = unset, everywhere
    assert paths.home() == os.path.expanduser("~/.cache/collab")
    monkeypatch.setenv("COLLAB_DB", "postgresql+psycopg://u@h/db")
    assert paths.store_url() == "postgresql+psycopg://u@h/db"


def test_the_default_home_is_written_once():
    """No module but paths.py spells the default home or reads COLLAB_HOME itself."""
    offenders = []
    for sub in ("collab_app", "trainer", "tasks"):
        for f in (ROOT / sub).rglob("*.py"):
            if f.name == "paths.py" and f.parent.name == "collab_app":
                continue
            text = f.read_text()
            if ".cache/collab\")" in text or "environ.get(\"COLLAB_HOME\"" in text or ".cache\" / \"collab\"" in text:
                offenders.append(str(f.relative_to(ROOT)))
    assert offenders == [], offenders


def _fresh_python(code: str, **env_over) -> str:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "COLLAB_HOME",
                        "VLLM_CACHE_ROOT")}
    env.update(env_over)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                          timeout=300).stdout.strip()


def test_compiled_kernels_are_kept_in_collab_home_not_in_tmp(tmp_path):
    """torch.compile's cache (a compiled engine's kernels) is COLLAB_HOME/compiled, which outlives a
    reboot and a Space's restart (torch's default is /tmp/torchinductor_<user>): in a fresh process,
    torch's own cache_dir(), the one every inductor write goes through, says so; no precompiled
    header (torch keeps it under /tmp regardless). What the person set is kept. (That a compiled vLLM engine leaves it there: tests/engines/test_engine.py's
    compiled-engine test.)"""
    home = tmp_path / "home"
    code = ("import os\nfrom collab_app import paths; from collab_app.cpu import process; process.prepare(paths.compile_cache_dir())\n"   # as every entry point does (collab_app/cpu/process.py)
            "from torch._inductor import config\n"
            "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR']); print(cache_dir()); print(config.cpp_cache_precompile_headers)\n")
    # and no precompiled header, which torch would keep under /tmp whatever the cache's place
    out = _fresh_python(code, COLLAB_HOME=str(home)).splitlines()
    assert out[0] == out[1] == os.path.join(home, "compiled", machine_tag()) and out[2] == "False", out
    mine = tmp_path / "mine"
    assert _fresh_python(code, COLLAB_HOME=str(home), TORCHINDUCTOR_CACHE_DIR=str(mine),
                         TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="1").splitlines() == [str(mine)] * 2 + ["True"]


def test_kernels_compiled_for_another_vector_isa_are_kept_apart(monkeypatch):
    """torch 2.13's graph cache does not key on the vector ISA: a kernel cached under AVX-512 and
    loaded with ATEN_CPU_CAPABILITY=avx2 counted half the elements it should (docs/results). So the
    cache folder is per machine tag: CPU model and flags, that variable and torch's version."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    native = machine_tag()
    assert native == machine_tag() and os.sep not in native and native.islower()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    capped = machine_tag()
    assert capped != native and capped.rsplit("-", 1)[0] == native.rsplit("-", 1)[0]   # same CPU, other ISA
    monkeypatch.setenv("COLLAB_HOME", "/some/home")
    assert paths.compile_cache_dir() == os.path.join("/some/home", "compiled", capped)


def test_vllms_compiled_model_is_kept_in_collab_home(tmp_path):
    """vLLM's cache (a compiled engine's traced model, engines/vllm_team.py compiled_model_kept_on_disk)
    is COLLAB_HOME/compiled/<machine>/vllm, beside the kernels, as vLLM itself reads it in a fresh
    process (its default is ~/.cache/vllm: per user, not per CPU kind); what the person set is kept."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not importable")
    home = tmp_path / "home"
    code = "from collab_app import paths; from collab_app.cpu import process; process.prepare(paths.compile_cache_dir())\nimport vllm.envs as envs\nprint(envs.VLLM_CACHE_ROOT)\n"
    assert _fresh_python(code, COLLAB_HOME=str(home)) == os.path.join(home, "compiled", machine_tag(), "vllm")
    assert _fresh_python(code, COLLAB_HOME=str(home), VLLM_CACHE_ROOT=str(tmp_path / "mine")) == str(tmp_path / "mine")


def test_old_compiled_models_are_pruned_and_the_newest_and_recent_ones_kept(tmp_path):
    """paths.prune_compiled_models: the model in use is marked used now; of its siblings the
    KEEP_COMPILED_NEWEST used last stay whatever their age, the others stay only if used within
    KEEP_COMPILED_DAYS; files beside the key folders are never touched."""
    day = 86400.0
    now = 1_800_000_000.0
    aot = tmp_path / "vllm" / "torch_compile_cache" / "torch_aot_compile"
    ages = {"in_use": 400, "a": 1, "b": 2, "c": 30, "d": 60, "e": 13, "f": 90}   # days since last use
    for name, age in ages.items():
        (aot / name / "rank_0_0").mkdir(parents=True)
        (aot / name / "rank_0_0" / "model").write_bytes(b"x" * 1000)
        os.utime(aot / name, (now - age * day, now - age * day))
    (aot / "stray.txt").write_text("not a key folder")
    os.utime(aot / "stray.txt", (now - 999 * day, now - 999 * day))

    removed = paths.prune_compiled_models(str(aot / "in_use"), now=now)

    # newest three after marking: in_use (now), a, b; recent: e (13 days); old: c, d, f
    assert sorted(os.path.basename(p) for p, _ in removed) == ["c", "d", "f"]
    assert all(size == 1000 for _, size in removed)
    assert sorted(os.listdir(aot)) == ["a", "b", "e", "in_use", "stray.txt"]
    assert os.stat(aot / "in_use").st_mtime == now
    # a second start a day later removes nothing more
    assert paths.prune_compiled_models(str(aot / "in_use"), now=now + day) == []
