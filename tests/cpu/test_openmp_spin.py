"""The entry points set GOMP_SPINCOUNT before torch loads libgomp (collab_app/cpu/process.py): the
CPU engines' decoding threads start ~250 OpenMP regions a step, each a wake-up of a parked worker
with libgomp's default. Importing the package sets nothing. These check the setting's rules, not
its speed (docs/CPU.md has that)."""
from __future__ import annotations

import os
import subprocess
import sys

from collab_app.cpu import process

PREPARE = "from collab_app import paths; from collab_app.cpu import process; process.prepare(paths.compile_cache_dir())\n"


def _run(code: str, **env_over) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", process.COMPILE_CACHE_ENV,
                                                            process.VLLM_CACHE_ENV, process.THP_VAR)}
    env.update(env_over)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)


def test_importing_the_package_and_its_rooms_sets_nothing():
    out = _run("import os, collab_app, collab_app.engines, collab_app.online.service, collab_app.web.serve, "
               "collab_app.cpu.cores, collab_app.cpu.lending\n"
               f"print([v for v in ('GOMP_SPINCOUNT', {process.COMPILE_CACHE_ENV!r}, {process.VLLM_CACHE_ENV!r}, "
               f"{process.THP_VAR!r}) if v in os.environ])").stdout.strip()
    assert out == "[]"


def test_an_entry_point_sets_the_spin_before_torch_loads():
    out = _run(PREPARE + "import os, sys; print(os.environ['GOMP_SPINCOUNT'], process.spin_set_before_torch(), "
                         "'torch' in sys.modules)").stdout.strip()
    assert out == f"{process.GOMP_SPINCOUNT} True False"


def test_the_cli_and_serve_prepare_their_process(tmp_path):
    """`collab ...` prepares every command; `collab serve` also asks for huge pages (a serving process)."""
    probe = ("import os, sys, importlib\n"
             "sys.argv = ['collab', 'doctor', '--help']\n"
             "from collab_app import cli\n"
             "try:\n    cli.main(['export', '--help'])\nexcept SystemExit:\n    pass\n"
             f"print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get({process.THP_VAR!r}))\n"
             "from collab_app.web import serve\n"
             "serve.prepare_serving_process()\n"
             f"print(os.environ.get({process.THP_VAR!r}))\n")
    out = _run(probe, COLLAB_HOME=str(tmp_path)).stdout.strip().splitlines()
    assert out[-2] == f"{process.GOMP_SPINCOUNT} None" and out[-1] == "1"


def test_a_spin_the_user_chose_is_kept():
    assert _run(PREPARE + "import os; print(os.environ['GOMP_SPINCOUNT'])", GOMP_SPINCOUNT="1234").stdout.strip() == "1234"


def test_torch_imported_first_is_noticed_and_make_engine_says_so():
    code = ("import logging, torch\n" + PREPARE + "print(process.spin_set_before_torch())\n"
            "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
            "from collab_app.engines import make_engine\n"
            "try:\n    make_engine('no-such-kind')\nexcept Exception as e:\n    print(type(e).__name__)\n")
    res = _run(code)
    assert res.stdout.split() == ["False", "EngineError"]
    assert "OpenMP keeps its default wait" in res.stderr
