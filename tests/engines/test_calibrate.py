"""engines/calibrate.py: the CPU engine's precision is decided by measurements on this machine,
cached per machine and model; and make_engine's dtype "auto" on a CPU follows it."""
from __future__ import annotations

import json

import pytest

from collab_app.engines import calibrate as cal


def test_decide_keeps_the_fastest_exact_precision_and_int8_only_when_fast_and_close():
    ms = {"float32": 150.0, "bfloat16": 420.0, "int8": 75.0}
    close = {"int8": {"mean": 0.02, "max": 0.1}, "bfloat16": {"mean": 0.03, "max": 0.12}}
    assert cal.decide(ms, close)["quantize"] == "int8"
    far = {"int8": {"mean": 1.99, "max": 5.5}}          # what SmolLM2-135M measured (activation outliers)
    d = cal.decide(ms, far)
    assert d == {**d, "dtype": "float32", "quantize": None} and "gap 1.99" in d["why"]
    worse_than_bf16 = {"int8": {"mean": 0.05, "max": 0.3}, "bfloat16": {"mean": 0.03, "max": 0.12}}
    assert cal.decide(ms, worse_than_bf16)["quantize"] is None
    d = cal.decide({"float32": 150.0, "bfloat16": 90.0, "int8": 80.0}, close)   # int8 not 1.25x faster than bf16
    assert (d["dtype"], d["quantize"]) == ("bfloat16", None) and "not enough faster" in d["why"]


def test_decide_takes_fp16_weights_when_faster_and_within_rounding_noise():
    """What an AVX2-only box measured (one thread, 8 rows): vLLM's oneDNN fp32 85 ms, fp16 weights
    44 ms with a log-prob gap of rounding noise, int8 faster still but 1.99 nats off."""
    ms = {"float32": 85.0, "bfloat16": 170.0, "fp16": 44.0, "int8": 24.0}
    gap = {"fp16": {"mean": 0.0003, "max": 0.002}, "int8": {"mean": 1.99, "max": 5.5}}
    d = cal.decide(ms, gap)
    assert (d["dtype"], d["quantize"]) == ("float32", "fp16") and "44.0 ms" in d["why"]
    # int8 close enough and 1.25x faster than fp16: int8 (the most exact kind that wins)
    both_close = {**gap, "int8": {"mean": 0.02, "max": 0.1}, "bfloat16": {"mean": 0.03, "max": 0.1}}
    assert cal.decide(ms, both_close)["quantize"] == "int8"
    assert cal.decide({**ms, "int8": 40.0}, both_close)["quantize"] == "fp16"   # int8 not 1.25x faster than fp16
    # fp16 beyond rounding noise (a checkpoint trained in fp32 with tiny weights, say): not taken
    d = cal.decide(ms, {**gap, "fp16": {"mean": 0.05, "max": 0.3}})
    assert d["quantize"] is None and "fp16 faster but its log-prob gap 0.05" in d["why"]
    # 1.13x faster (two threads on the AVX2 EPYC: 47.0 / 41.6): enough for fp16 weights measured exact
    # (a 16-bit checkpoint's own values), not for fp16 that costs accuracy (gap above EXACT_GAP)
    two_threads = {"float32": 47.0, "bfloat16": 90.0, "fp16": 41.6, "int8": 20.0}
    assert cal.decide(two_threads, gap)["quantize"] == "fp16"
    d = cal.decide(two_threads, {**gap, "fp16": {"mean": 0.005, "max": 0.03}})
    assert (d["dtype"], d["quantize"]) == ("float32", None) and "fp16 not enough faster" in d["why"]
    d = cal.decide({**two_threads, "fp16": 45.5}, gap)                    # 1.03x: timing noise, stay
    assert d["quantize"] is None and "fp16 not enough faster" in d["why"]
    # a machine without fbgemm (aarch64): no fp16 / int8 entries, nothing to swap
    assert cal.decide({"float32": 50.0, "bfloat16": 30.0}, {})["quantize"] is None


def test_calibration_measures_once_per_machine_and_model(model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path))
    monkeypatch.setenv("COLLAB_MACHINE_DIR", str(tmp_path))
    entry = cal.calibrate(model_path, threads=1)
    ms = entry["ms_per_step"]
    assert {"float32", "bfloat16"} <= set(ms) <= set(cal.KINDS) and all(v > 0 for v in ms.values())
    assert entry["dtype"] in ("float32", "bfloat16") and entry["threads"] == 1
    assert set(entry["kernel"].values()) <= {"onednn", "sgl", "torch"} and "float32" in entry["kernel"]
    for kind in ("fp16", "int8"):
        need = cal.EXACT_SPEEDUP if kind == "fp16" else cal.MIN_SPEEDUP
        if kind in ms and ms[kind] * need <= min(ms["float32"], ms["bfloat16"]):
            assert entry["logprob_gap"][kind]["mean"] >= 0     # fast enough: its accuracy was measured
            assert kind != "fp16" or entry["logprob_gap"][kind]["mean"] < cal.FP16_MAX_GAP   # 16-bit checkpoint
    cache = json.loads((tmp_path / "calibration.json").read_text())
    assert list(cache) == [cal.machine_key(model_path, 1)] and cache[cal.machine_key(model_path, 1)] == entry
    assert entry["engine"] == "vllm"

    def boom(*a, **k):
        raise AssertionError("measured again although cached")
    monkeypatch.setattr(cal, "speed", boom)
    assert cal.calibrate(model_path, threads=1) == entry              # cached: no measurement
    with pytest.raises(AssertionError, match="measured again"):
        cal.calibrate(model_path, threads=2)                          # another thread count: another key


def test_fbgemms_own_isa_cap_is_part_of_the_machine_key(model_path, monkeypatch):
    # fbgemm (the fp16 / int8 kinds) ignores ATEN_CPU_CAPABILITY: an AVX2 emulation that caps only
    # torch would otherwise find a calibration measured with fbgemm's AVX-512 kernels
    monkeypatch.delenv("FBGEMM_ENABLE_INSTRUCTIONS", raising=False)
    plain = cal.machine_key(model_path, 2)
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")
    capped = cal.machine_key(model_path, 2)
    assert capped != plain and capped.endswith("| fbgemm AVX2") and capped.startswith(plain)


def test_engine_dtype_auto_on_cpu_follows_the_calibration(monkeypatch, tmp_path):
    from collab_app.engines import calibrate as engines

    # each engine gets the decision measured on its own GEMMs (engines/calibrate.py, "Per engine")
    decided = {"vllm": ("bfloat16", None), "transformers": ("float32", "fp16")}
    monkeypatch.setattr(cal, "calibrate", lambda path, threads=None, engine="vllm": {
        "dtype": decided[engine][0], "quantize": decided[engine][1], "why": "test", "measured_at": "now"})
    assert engines.cpu_precision(str(tmp_path), "vllm") == {"dtype": "bfloat16", "quantize": None}
    assert engines.cpu_precision(str(tmp_path), "transformers") == {"dtype": "float32", "quantize": "fp16"}
    decided["transformers"] = ("bfloat16", None)
    # None is a decision too: it overrides the transformers engine's flags rule ("auto")
    assert engines.cpu_precision(str(tmp_path), "transformers") == {"dtype": "bfloat16", "quantize": None}

    def fails(path, threads=None, engine="vllm"):
        raise OSError("read-only")
    monkeypatch.setattr(cal, "calibrate", fails)
    assert engines.cpu_precision(str(tmp_path), "vllm") == {}       # the CPU-flags rule, and a warning


def test_collab_models_also_measures_the_cores_serve_gives_its_engine(model_path, monkeypatch, capsys):
    """`collab models` (make install) calibrates for every thread of the machine and for the
    engine's share under `collab serve`'s core split (cores.plan): serve's engine then finds
    its own key cached instead of measuring it while the first page waits."""
    from collab_app.commands import models as M
    from collab_app.cpu import cores

    import importlib.util

    calls = []

    def measured(path, threads=None, refresh=False, rows=8, engine="vllm"):
        calls.append((threads, engine))
        n = threads or 4
        return {"dtype": "bfloat16", "quantize": None, "threads": n, "why": f"measured on {n}", "measured_at": "now",
                "engine": engine}

    monkeypatch.setattr(cal, "calibrate", measured)
    monkeypatch.setattr(M, "_dtype_info", lambda: {"device": "cpu", "dtype": "bfloat16", "cpu_capability": "AVX512"})
    monkeypatch.setattr(cores, "plan", lambda *a, **k: cores.CpuSplit(engine=(0, 1), trainer=(2, 3)))
    real_find_spec = importlib.util.find_spec
    for has_vllm, kinds in ((True, ("vllm", "transformers")), (False, ("transformers",))):
        # each engine's GEMMs (engines/calibrate.py, "Per engine"); no vLLM installed: the transformers engine's alone
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (real_find_spec("json") if has_vllm else None) if name == "vllm"
                            else real_find_spec(name, *a))
        calls.clear()
        assert M.cli_main(["--model", model_path, "--no-engines"]) == 0
        assert calls == [(t, k) for k in kinds for t in (None, 2)]
        out = capsys.readouterr().out
        for k in kinds:
            gemms = "the transformers engine's" if k == "transformers" else "vLLM's"
            assert f"4 threads, {gemms} GEMMs: measured on 4" in out
            assert f"2 threads, {gemms} GEMMs (collab serve's engine cores beside its trainer): measured on 2" in out
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    calls.clear()
    monkeypatch.setattr(cores, "plan", lambda *a, **k: None)     # one core, a GPU: serve splits nothing
    assert M.cli_main(["--model", model_path, "--no-engines", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [t for t, _ in calls] == [None] * len(calls) and "calibration_serve" not in listed
    assert listed["calibration"]["engine"] == calls[0][1]


def test_the_transformers_engine_is_calibrated_on_its_own_gemms(model_path, tmp_path, monkeypatch):
    """The transformers engine runs fp32 / bf16 through torch's `F.linear`, vLLM through its own
    kernels (oneDNN, sgl-kernel): its calibration times torch's, under a key of its own, so that
    each engine serves what is fastest for it (on the EPYC Zen 4 bf16 won for vLLM and fp16 weights
    for the transformers engine)."""
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path))
    monkeypatch.setenv("COLLAB_MACHINE_DIR", str(tmp_path))
    timed = []
    real = cal._exact_linear

    def spy(w, dtype, engine="vllm"):
        fn, kernel = real(w, dtype, engine)
        timed.append((engine, kernel))
        return fn, kernel
    monkeypatch.setattr(cal, "_exact_linear", spy)
    entry = cal.calibrate(model_path, threads=1, engine="transformers")
    assert entry["engine"] == "transformers" and entry["kernel"] == {"float32": "torch", "bfloat16": "torch"}
    assert timed and all(t == ("transformers", "torch") for t in timed)
    assert entry["dtype"] in ("float32", "bfloat16") and entry["quantize"] in (None, "fp16", "int8")
    key = cal.machine_key(model_path, 1, "transformers")
    assert key != cal.machine_key(model_path, 1) and key.startswith(cal.machine_key(model_path, 1))
    assert list(json.loads((tmp_path / "calibration.json").read_text())) == [key]
    with pytest.raises(ValueError, match="engine must be one of"):
        cal.calibrate(model_path, threads=1, engine="remote")
