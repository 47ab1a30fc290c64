"""collab_app sets GOMP_SPINCOUNT before torch loads libgomp (collab_app/__init__.py): the CPU
engines' decoding threads start ~250 OpenMP regions a step, each a wake-up of a parked worker
with libgomp's default. These check the setting's rules, not its speed (docs/results has that)."""
from __future__ import annotations

import os
import subprocess
import sys


def _run(code: str, **env_over) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env.update(env_over)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout.strip()


def test_importing_collab_app_sets_the_spin_before_torch_loads():
    out = _run("import collab_app, os, sys; print(os.environ['GOMP_SPINCOUNT'], collab_app.SPIN_BEFORE_TORCH, 'torch' in sys.modules)")
    import collab_app

    assert out == f"{collab_app.GOMP_SPINCOUNT} True False"


def test_a_spin_the_user_chose_is_kept():
    assert _run("import collab_app, os; print(os.environ['GOMP_SPINCOUNT'])", GOMP_SPINCOUNT="1234") == "1234"


def test_torch_imported_first_is_noticed_and_make_engine_says_so():
    code = ("import logging, torch, collab_app; print(collab_app.SPIN_BEFORE_TORCH)\n"
            "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
            "from collab_app.engines import make_engine\n"
            "try:\n    make_engine('no-such-kind')\nexcept Exception as e:\n    print(type(e).__name__)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"})
    assert res.stdout.split() == ["False", "EngineError"]
    assert "OpenMP kept its default wait" in res.stderr
