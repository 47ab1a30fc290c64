"""An in-process vLLM engine built with decode_thread=False (`collab train`'s) runs on the thread
that built it: no engine thread of its own, whose OpenMP team would stay alive beside the
trainer's and make libgomp throttle both (engine_vllm.VLLMEngine's decode_thread; docs/results
"An idle engine's thread slowed the rest of its process"); a call from another thread is refused
with a message that says what to do. In a fresh interpreter: vLLM binds the building thread's
OpenMP threads to cores, which must not happen to the test run's own main thread."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.engines import vllm_importable

CODE = r"""
import json, sys, threading
from collab_app import paths; from collab_app.cpu import process; process.prepare(paths.compile_cache_dir())
from collab_app.engines.engine_types import EngineError, Request, Sampling
from collab_app.engines.engine_vllm import VLLMEngine

eng = VLLMEngine(sys.argv[1], dtype="float32", num_agents=2, seed=0, decode_thread=False)
eng.register_agent("base")
greedy = Sampling(max_new_tokens=4, temperature=0.0)
tokens = eng.generate([Request("base", "Hello")], 1, greedy)[0][0].token_ids
threads = [t.name for t in threading.enumerate()]
refused = []
def other():
    try:
        eng.generate([Request("base", "Hello")], 1, greedy)
    except EngineError as e:
        refused.append(str(e))
t = threading.Thread(target=other)
t.start()
t.join(60)
again = eng.generate([Request("base", "Hello")], 1, greedy)[0][0].token_ids
eng.close()
print(json.dumps({"tokens": tokens, "again": again, "threads": threads, "refused": refused}))
"""


@pytest.mark.vllm
def test_a_vllm_engine_without_a_decode_thread_runs_on_its_builders_thread_only(model_path):
    if not vllm_importable():
        pytest.skip("vllm is not importable")
    out = subprocess.run([sys.executable, "-c", CODE, model_path], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["tokens"]) == 4 and got["again"] == got["tokens"]
    from collab_app.engines.engine_vllm import ENGINE_THREAD

    assert not [n for n in got["threads"] if n.startswith(ENGINE_THREAD)], got["threads"]
    assert len(got["refused"]) == 1 and "decode_thread=False" in got["refused"][0], got["refused"]
