"""engines/engine_race.py: on a CPU with both engines, `make_engine("auto")` serves with the one
that was faster here, raced once per machine and model and cached; a race an engine did not
finish is not cached; COLLAB_CALIBRATE=0 (the suite's default) keeps the figures taken elsewhere."""
from __future__ import annotations

import json
import sys

import pytest

from collab_app.engines import engine_race
from collab_app.engines import engine_hf   # imported before `raced` narrows importlib's find_spec (transformers checks it)


@pytest.fixture
def raced(monkeypatch, tmp_path):
    """COLLAB_HOME in tmp_path, calibration on, vLLM a candidate here, and scripted children:
    `times` maps engine -> round_s or an exception message; `runs` lists the children started;
    `peaks` (optional) maps engine -> the peak memory its start reports, MB."""
    from collab_app.engines import platform

    monkeypatch.setenv("COLLAB_HOME", str(tmp_path))
    monkeypatch.setenv("COLLAB_MACHINE_DIR", str(tmp_path))
    monkeypatch.setenv("COLLAB_CALIBRATE", "1")
    monkeypatch.setattr("collab_app.engines.device.cuda_available", lambda: False)
    monkeypatch.setattr(platform, "this_platform", lambda: ("Linux", "x86_64"))
    monkeypatch.setattr(platform.importlib.util, "find_spec", lambda name: object() if name == "vllm" else None)
    monkeypatch.setattr(engine_race, "race_key", lambda path: f"race {path}")
    state = {"times": {}, "runs": [], "events": []}

    class Child:   # engine_race._Child, scripted: a string time is the child's error at start
        def __init__(self, kind, path):
            self.kind = kind
            state["runs"].append(kind)

        def start(self):
            state["events"].append(("start", self.kind))
            t = state["times"][self.kind]
            peak = {"peak_mb": state["peaks"][self.kind]} if "peaks" in state else {}
            return {"error": t} if isinstance(t, str) else {"startup_s": 1.0, **peak}

        def round(self):
            state["events"].append(("round", self.kind))
            t = state["times"][self.kind]
            return t() if callable(t) else {"round_s": t}

        def close(self):
            state["events"].append(("close", self.kind))

        def cpu_s(self):   # idle: wait_quiet returns after one poll
            return 0.0

    monkeypatch.setattr(engine_race, "_Child", Child)
    monkeypatch.setattr(engine_race, "QUIET_POLL_S", 0.001)
    # an fp32 CPU unless a test says otherwise: no compiled contestant
    monkeypatch.setattr(engine_race, "_compile_unfit", lambda path: state.get("unfit", "fp32 here"))
    model = tmp_path / "model"
    model.mkdir()
    state["model"] = str(model)
    return state


def test_make_engine_never_races_and_a_missing_race_is_named(raced, monkeypatch):
    """A person may be waiting on make_engine("auto"): with nothing cached it serves the default at
    once (no child started) and says why; race_missing names what `collab serve` races in the
    background, and nothing once the race is cached."""
    from collab_app.engines import choose, engine_vllm

    raced["times"] = {"vllm": 3.1, "transformers": 2.4}
    monkeypatch.setattr(engine_vllm, "VLLMEngine", lambda path, **kw: "vllm engine")
    monkeypatch.setattr("collab_app.engines.calibrate.cpu_precision", lambda path, kind, threads=None: {})
    assert choose.make_engine("auto", raced["model"]) == "vllm engine" and raced["runs"] == []
    assert "not measured on this one yet" in choose.auto_choice(raced["model"])[1]
    assert choose.race_missing([raced["model"], raced["model"], raced["model"] + "-absent"]) == [raced["model"]]
    choose.auto_choice(raced["model"], measure=True)
    assert raced["runs"] == ["vllm", "transformers"] and choose.race_missing([raced["model"]]) == []
    monkeypatch.setenv("COLLAB_CALIBRATE", "0")
    assert choose.race_missing([raced["model"] + "2"]) == []


def test_the_faster_engine_here_is_chosen_and_raced_once(raced):
    from collab_app.engines import auto_choice

    raced["times"] = {"vllm": 3.1, "transformers": 2.4}
    order, why = auto_choice(raced["model"], measure=True)
    assert order == ["transformers"] and "measured on this CPU" in why and "transformers 2.4 s vs vllm 3.1 s" in why
    assert raced["runs"] == ["vllm", "transformers"]
    # cached: not raced again, and `collab doctor` (measure off) reads the same answer
    assert auto_choice(raced["model"], measure=True)[0] == ["transformers"]
    assert auto_choice(raced["model"])[0] == ["transformers"]
    assert raced["runs"] == ["vllm", "transformers"]
    entry = engine_race.cached(raced["model"])
    assert entry["engine"] == "transformers" and entry["engines"]["vllm"]["round_s"] == 3.1


def test_vllm_faster_keeps_transformers_as_the_fallback(raced):
    from collab_app.engines import auto_choice

    raced["times"] = {"vllm": 1.9, "transformers": 2.4}
    assert auto_choice(raced["model"], measure=True)[0] == ["vllm", "transformers"]


def test_a_race_an_engine_did_not_finish_decides_but_is_run_again(raced):
    from collab_app.engines import auto_choice

    raced["times"] = {"vllm": "exit 1: ImportError: no vllm", "transformers": 2.4}
    order, why = auto_choice(raced["model"], measure=True)
    assert order == ["transformers"] and "vllm did not finish (exit 1: ImportError: no vllm)" in why
    assert engine_race.cached(raced["model"]) is None
    auto_choice(raced["model"], measure=True)
    assert raced["runs"] == ["vllm", "transformers"] * 2
    raced["times"] = {"vllm": "no result within 300 s", "transformers": "exit 1: MemoryError"}
    order, why = auto_choice(raced["model"], measure=True)
    assert order == ["vllm", "transformers"] and "not measured on this one" in why and "neither engine" in why


def test_a_compiled_vllm_that_wins_is_what_vllm_engines_are_built_as(raced, monkeypatch):
    """Where the engine runs bf16, `vllm-compiled` races too; when it wins, auto still says vLLM
    and every vLLM engine built here (auto or by name, dtype auto) is compiled, unless the caller
    says enforce_eager; an fp32 or quantized build stays eager."""
    import collab_app.engines.choose as engines
    from collab_app.engines import auto_choice, engine_vllm

    raced["unfit"] = None
    raced["times"] = {"vllm": 1.9, "vllm-compiled": 1.4, "transformers": 2.4}
    order, why = auto_choice(raced["model"], measure=True)
    assert order == ["vllm", "transformers"] and "vllm-compiled 1.4 s vs vllm 1.9 s vs transformers 2.4 s" in why
    assert why.endswith("vLLM runs compiled (enforce_eager=False)")
    assert raced["runs"] == ["vllm", "vllm-compiled", "transformers"]
    assert engine_race.cached(raced["model"])["compile"] is True
    built = []
    monkeypatch.setenv("CXX", sys.executable)   # a C++ compiler is found (the build rule's last check)
    monkeypatch.setattr(engine_vllm, "VLLMEngine", lambda path, **kw: built.append(kw) or "engine")
    monkeypatch.setattr("collab_app.engines.calibrate.cpu_precision", lambda path, kind, threads=None: {"dtype": "bfloat16", "quantize": None})
    assert engines.make_engine("auto", raced["model"]) == "engine"
    engines.make_engine("vllm", raced["model"])
    engines.make_engine("vllm", raced["model"], enforce_eager=True)
    engines.make_engine("vllm", raced["model"], dtype="float32")
    assert [kw.get("enforce_eager") for kw in built] == [False, False, True, None]


def test_serve_vllm_compile_overrides_the_race_for_the_served_engine(raced, monkeypatch):
    """`collab serve --vllm-compile on|off` decides where one race on a noisy machine should not:
    it becomes vLLM's enforce_eager (the race is then not consulted), the transformers engine that
    auto may fall back to drops it, and it is refused where no in-process vLLM serves."""
    import collab_app.engines.choose as engines
    from collab_app.engines import engine_vllm
    from collab_app.web.serve import ServeConfig, engine_kwargs

    local = {"decode_thread": True, "max_lora_rank": 8}
    assert engine_kwargs(ServeConfig()) == local                         # auto: the race decides
    assert engine_kwargs(ServeConfig(vllm_compile="on")) == local | {"enforce_eager": False}
    assert engine_kwargs(ServeConfig(vllm_compile="off")) == local | {"enforce_eager": True}
    for elsewhere in ({"engine": "transformers"}, {"engine_url": "http://127.0.0.1:8000"}):
        with pytest.raises(ValueError, match="--vllm-compile on applies to vLLM in this process"):
            ServeConfig(vllm_compile="on", **elsewhere)
    raced["unfit"] = None
    raced["times"] = {"vllm": 1.9, "vllm-compiled": 2.0, "transformers": 2.4}   # the race keeps eager
    engines.auto_choice(raced["model"], measure=True)
    built = []
    monkeypatch.setenv("CXX", sys.executable)
    monkeypatch.setattr(engine_vllm, "VLLMEngine", lambda path, **kw: built.append(("vllm", kw)) or "vllm")
    monkeypatch.setattr(engine_hf, "TransformersEngine", lambda path, **kw: built.append(("hf", kw)) or "hf")
    monkeypatch.setattr("collab_app.engines.calibrate.cpu_precision", lambda path, kind, threads=None: {"dtype": "bfloat16", "quantize": None})
    for mode in ("auto", "on", "off"):
        engines.make_engine("auto", raced["model"], **engine_kwargs(ServeConfig(vllm_compile=mode)))
    engines.make_engine("transformers", raced["model"], **engine_kwargs(ServeConfig(vllm_compile="on", engine="auto")))
    assert [(kind, kw.get("enforce_eager")) for kind, kw in built] == \
        [("vllm", None), ("vllm", False), ("vllm", True), ("hf", None)]
    assert "enforce_eager" not in built[-1][1] and "max_lora_rank" not in built[-1][1]
    assert all(kw["max_lora_rank"] == 8 for kind, kw in built if kind == "vllm")


def test_compiled_vllm_that_loses_or_does_not_start_leaves_vllm_eager(raced):
    from collab_app.engines import auto_choice
    from collab_app.engines.choose import _race_compiles

    raced["unfit"] = None
    raced["times"] = {"vllm": 1.9, "vllm-compiled": "exit 1: compile failed", "transformers": 2.4}
    order, why = auto_choice(raced["model"], measure=True)
    assert order == ["vllm", "transformers"] and "vllm-compiled did not finish" in why
    assert engine_race.cached(raced["model"]) is None and not _race_compiles(raced["model"])   # tried again next time
    raced["times"] = {"vllm": "exit 1: no start", "vllm-compiled": 1.4, "transformers": "exit 1: no start"}
    assert engine_race.race(raced["model"])["compile"] is True                  # the only one that ran
    assert engine_race.cached(raced["model"]) is None
    raced["times"] = {"vllm": 1.9, "vllm-compiled": 2.0, "transformers": 2.4}
    auto_choice(raced["model"], measure=True)
    assert engine_race.cached(raced["model"])["compile"] is False and not _race_compiles(raced["model"])
    # faster, but by less than its margin: its longer start-up is not worth it
    raced["times"]["vllm-compiled"] = 1.8
    order, why = engine_race.race(raced["model"], refresh=True)["engine"], engine_race.cached(raced["model"])["why"]
    assert order == "vllm" and "vllm-compiled not chosen" in why and not _race_compiles(raced["model"])


def test_an_fp32_cpu_races_two_engines_and_caches_it(raced):
    from collab_app.engines import auto_choice

    raced["times"] = {"vllm": 1.9, "transformers": 2.4}
    auto_choice(raced["model"], measure=True)
    entry = engine_race.cached(raced["model"])
    assert raced["runs"] == ["vllm", "transformers"] and entry["engines"]["vllm-compiled"] == {"skipped": "fp32 here"}
    assert entry["compile"] is False


def test_compiled_vllm_is_skipped_without_a_cpp_compiler(monkeypatch):
    from collab_app.engines.engine_vllm import cpu_compile_unfit

    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert "no C++ compiler (no-such-compiler-here)" in cpu_compile_unfit("bfloat16", None)
    monkeypatch.setenv("CXX", sys.executable)   # any executable: "a compiler is found"
    assert cpu_compile_unfit("bfloat16", None) is None
    assert "bf16" in cpu_compile_unfit("float32", None) and "bf16" in cpu_compile_unfit("bfloat16", "fp16")
    assert "in this process" in cpu_compile_unfit("bfloat16", None, in_process=False)


def test_calibration_off_or_no_local_folder_is_not_raced(raced, monkeypatch):
    from collab_app.engines import auto_choice

    raced["times"] = {"vllm": 3.1, "transformers": 2.4}
    assert auto_choice(raced["model"] + "-missing", measure=True)[0] == ["vllm", "transformers"]
    monkeypatch.setenv("COLLAB_CALIBRATE", "0")
    order, why = auto_choice(raced["model"], measure=True)
    assert order == ["vllm", "transformers"] and "not measured on this one" in why
    assert raced["runs"] == []


def test_a_child_times_a_real_round(model_path):
    """The child itself, for the transformers engine (vLLM's start-up is too slow for this tier):
    it answers its start-up once warm, a round per request, and exits when its stdin closes."""
    child = engine_race._Child("transformers", model_path)
    try:
        started = child.start()
        assert started["startup_s"] > 0 and started["dtype"] in ("float32", "bfloat16"), started
        assert 300 < started["peak_mb"] < 20_000, started          # torch + the model, in MB (not KiB or bytes)
        assert [child.round()["round_s"] > 0 for _ in range(2)] == [True, True]
    finally:
        child.close()
    assert child._proc.returncode == 0


def test_a_contestant_is_built_with_the_agent_slots_and_lanes_collab_serve_gives_its_engine():
    """A compiled engine's graph holds its in-graph LoRA lanes, so inductor's cache keeps one graph
    per lane count: a race with 2 slots (then one lane each) left `make run`'s 6-slot engine to
    compile again at its first start. The contestants get serve's default slots (one per role of
    the default tasks, as web/context.py counts them) and lanes (the largest default team, as
    build_context sizes them), serve's other keywords, eager or not. The slots also hold the arena's
    version slots (engines/version_slots.py: DEFAULT_SLOTS team states of the largest team)."""
    from collab_app.engines.version_slots import DEFAULT_SLOTS
    from collab_app.web.serve import ServeConfig, engine_kwargs
    from tasks import load_task

    lanes = max(len(load_task(name).roles) for name in ServeConfig().tasks)
    slots = len({role for name in ServeConfig().tasks for role in load_task(name).roles}) + DEFAULT_SLOTS * lanes
    assert slots == engine_race.serve_slots() == 12 and lanes == engine_race.serve_lanes() == 2
    served = engine_kwargs(ServeConfig())
    for kind, eager in (("vllm", True), ("vllm-compiled", False)):
        kw = engine_race.child_engine_kwargs(kind)
        assert kw == {"decode_thread": served["decode_thread"], "enforce_eager": eager, "num_agents": slots,
                      "lora_lanes": lanes}
    assert engine_race.child_engine_kwargs("transformers") == {"decode_thread": True}


def test_a_child_that_cannot_start_says_why(model_path):
    child = engine_race._Child("no-such-engine", model_path)
    try:
        got = child.start()
    finally:
        child.close()
    assert got["error"].startswith("exit 1:") and "no-such-engine" in got["error"], got


def test_the_rounds_are_interleaved_after_every_child_started(raced):
    """All children up first (start-ups never overlap a round), then ROUNDS passes of one round
    each, the order rotated, so that a machine that slows down during the race slows everyone;
    the best round of each is kept (here every round is 10% slower than the one before)."""
    from collab_app.engines import auto_choice

    clock = iter(range(100))
    slower = lambda: {"round_s": round(1.0 * 1.1 ** next(clock), 3)}   # noqa: E731
    raced["unfit"] = None
    raced["times"] = {"vllm": slower, "vllm-compiled": slower, "transformers": slower}
    auto_choice(raced["model"], measure=True)
    kinds = list(engine_race.ENGINES)
    assert raced["events"][:3] == [("start", k) for k in kinds]
    rounds = [k for e, k in raced["events"] if e == "round"]
    assert rounds == [k for p in range(engine_race.ROUNDS) for k in kinds[p:] + kinds[:p]]
    assert sorted(k for e, k in raced["events"][-3:] if e == "close") == sorted(kinds)
    best = {k: r["round_s"] for k, r in engine_race.cached(raced["model"])["engines"].items()}
    assert best == {"vllm": 1.0, "vllm-compiled": 1.1, "transformers": 1.21}   # each one's first pass


def test_children_that_memory_cannot_hold_at_once_are_raced_in_groups(raced, monkeypatch):
    """A child starts beside the others only while available memory holds MEMORY_HEADROOM x the
    largest peak a started child reported; otherwise those are raced and closed first, and the
    entry says the groups were timed apart. Here 5000 MB are free: vllm (3000 MB) leaves room
    for a second child, vllm-compiled (4500 MB) does not."""
    from types import SimpleNamespace

    import psutil

    from collab_app.engines import auto_choice

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=5000 * 2 ** 20))
    raced["unfit"] = None
    raced["times"] = {"vllm": 1.9, "vllm-compiled": 1.4, "transformers": 2.4}
    raced["peaks"] = {"vllm": 3000, "vllm-compiled": 4500, "transformers": 1500}
    order, why = auto_choice(raced["model"], measure=True)
    assert order == ["vllm", "transformers"] and engine_race.cached(raced["model"])["compile"] is True
    first = [("start", "vllm"), ("start", "vllm-compiled")] + \
        [("round", k) for k in ("vllm", "vllm-compiled", "vllm-compiled", "vllm", "vllm", "vllm-compiled")]
    assert raced["events"][:8] == first
    assert sorted(raced["events"][8:10]) == [("close", "vllm"), ("close", "vllm-compiled")]
    assert raced["events"][10:] == [("start", "transformers")] + [("round", "transformers")] * 3 + \
        [("close", "transformers")]
    entry = engine_race.cached(raced["model"])
    assert entry["groups"] == [["vllm", "vllm-compiled"], ["transformers"]]
    assert "timed in 2 groups, vllm, vllm-compiled | transformers" in entry["why"] and "not interleaved" in why
    # with room for all three, one group: the entry has no `groups`
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=6000 * 2 ** 20))
    entry = engine_race.race(raced["model"], refresh=True)
    assert "groups" not in entry and "not interleaved" not in entry["why"]


def test_a_child_that_fails_mid_race_is_an_error_and_not_cached(raced):
    from collab_app.engines import auto_choice

    raced["times"] = {"vllm": lambda: {"error": "exit -9: killed"}, "transformers": 2.4}
    order, why = auto_choice(raced["model"], measure=True)
    assert order == ["transformers"] and "vllm did not finish (exit -9: killed)" in why
    assert engine_race.cached(raced["model"]) is None
    assert [e for e in raced["events"] if e[0] == "round"] == [("round", "vllm"), ("round", "transformers"),
                                                             ("round", "transformers"), ("round", "transformers")]


def test_the_race_is_found_whatever_the_callers_thread_count(model_path):
    """`collab serve` sets torch's threads to its engine cores before the engine starts; the race
    that `collab models` ran at install (all threads) must be the one it finds."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = engine_race.race_key(model_path)
        torch.set_num_threads(2)
        assert engine_race.race_key(model_path) == one
        assert f"r{engine_race.ENGINES_REVISION} " in one   # an upgrade that moves the race races again
    finally:
        torch.set_num_threads(before)


def test_what_the_children_cached_meanwhile_is_kept(raced, tmp_path, monkeypatch):
    """The children calibrate the dtype on a fresh machine and write calibration.json while the
    race runs; the race's own entry must not overwrite theirs."""
    from collab_app.engines import auto_choice

    raced["times"] = {"vllm": 1.9, "transformers": 2.4}

    class ChildThatCalibrates(engine_race._Child):   # the scripted child of `raced`
        def start(self):
            (tmp_path / "calibration.json").write_text(json.dumps({"dtype entry": {"dtype": "bfloat16"}}))
            return super().start()

    monkeypatch.setattr(engine_race, "_Child", ChildThatCalibrates)
    auto_choice(raced["model"], measure=True)
    cache = json.loads((tmp_path / "calibration.json").read_text())
    assert set(cache) == {"dtype entry", f"race {raced['model']}"}


def test_serve_starts_vllm_for_the_rank_its_trainer_child_trains():
    """vLLM serves adapters up to its max_lora_rank (GPU LoRA, a compiled CPU engine's in-graph
    slots): serve starts it for the rank of the adapters its trainer child will write, --lora-r in
    --trainer-args or the trainer's default, never below 8 (vLLM's GPU LoRA takes 1, 8, 16, ...)."""
    from collab_app.web.serve import ServeConfig, trainer_lora_rank
    from trainer.config import MAGRPOConfig

    assert trainer_lora_rank(ServeConfig()) == max(8, MAGRPOConfig.lora_r)
    assert trainer_lora_rank(ServeConfig(trainer_args="--learning-rate 5e-5 --lora-r 32 --lora-alpha 64")) == 32
    assert trainer_lora_rank(ServeConfig(trainer_args="--lora-r 4")) == 8
    assert trainer_lora_rank(ServeConfig(trainer_args="--lora-r 16 --lora-r 64")) == 64     # the last flag wins, as argparse's


def test_a_round_waits_until_every_child_is_quiet(monkeypatch):
    """engine_race.wait_quiet: a child still using the CPU after its round (spinning OpenMP
    workers) holds the next round back until it stops, or QUIET_MAX_S; an idle machine waits one poll."""
    monkeypatch.setattr(engine_race, "QUIET_POLL_S", 0.01)

    class Busy:   # uses CPU for its first `polls` polls, then none
        def __init__(self, polls):
            self.polls, self.used = polls, 0.0

        def cpu_s(self):
            if self.polls > 0:
                self.polls -= 1
                self.used += 0.1
            return self.used

    idle, spinning = Busy(0), Busy(6)
    waited = engine_race.wait_quiet([idle, spinning])
    assert spinning.polls == 0 and 6 * 0.01 <= waited < 1.0
    assert engine_race.wait_quiet([Busy(0)]) < 0.5
    monkeypatch.setattr(engine_race, "QUIET_MAX_S", 0.1)
    assert 0.1 <= engine_race.wait_quiet([Busy(10 ** 6)]) < 1.0   # never quiet: capped


def test_the_race_times_each_round_after_the_children_went_quiet(raced, monkeypatch):
    from collab_app.engines import auto_choice

    def quiet(children):
        raced["events"].append(("quiet", len(list(children))))
        return 0.0

    monkeypatch.setattr(engine_race, "wait_quiet", quiet)
    raced["times"] = {"vllm": 3.1, "transformers": 2.4}
    auto_choice(raced["model"], measure=True)
    rounds = [i for i, e in enumerate(raced["events"]) if e[0] == "round"]
    assert rounds and all(raced["events"][i - 1] == ("quiet", 2) for i in rounds), raced["events"]


def test_collab_models_race_races_now_even_where_a_race_is_cached(raced, monkeypatch, capsys):
    """`collab models --race` retakes the race (e.g. one cached from a busy machine); without the
    flag it only shows what is cached, so the install never races."""
    from collab_app.commands import models
    from collab_app.engines import calibrate

    raced["times"] = {"vllm": 3.1, "transformers": 2.4}
    monkeypatch.setattr(models, "_engines_available", lambda: {"vllm": "ok", "transformers": "ok"})
    monkeypatch.setattr(models, "_dtype_info", lambda: {"device": "cpu", "dtype": "float32", "cpu_capability": "AVX2"})
    monkeypatch.setattr(calibrate, "calibrate", lambda path, threads=None, refresh=False, rows=8, engine="vllm": {
        "dtype": "float32", "quantize": None, "threads": threads or 2, "why": "test", "measured_at": "now", "engine": engine})
    assert models.cli_main(["--model", raced["model"]]) == 0 and raced["runs"] == []
    assert "not measured on this one yet" in capsys.readouterr().out
    assert models.cli_main(["--model", raced["model"], "--race"]) == 0
    assert raced["runs"] == ["vllm", "transformers"] and "transformers 2.4 s" in capsys.readouterr().out
    assert models.cli_main(["--model", raced["model"], "--race"]) == 0
    assert raced["runs"] == ["vllm", "transformers"] * 2          # cached, and raced again
