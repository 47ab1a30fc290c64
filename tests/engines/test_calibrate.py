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


def test_calibration_measures_once_per_machine_and_model(model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path))
    entry = cal.calibrate(model_path, threads=1)
    assert set(entry["ms_per_step"]) == {"float32", "bfloat16", "int8"} and all(v > 0 for v in entry["ms_per_step"].values())
    assert entry["dtype"] in ("float32", "bfloat16") and entry["threads"] == 1
    if entry["ms_per_step"]["int8"] * cal.INT8_MIN_SPEEDUP <= min(entry["ms_per_step"]["float32"],
                                                                 entry["ms_per_step"]["bfloat16"]):
        assert entry["logprob_gap"]["int8"]["mean"] > 0     # fast enough: its accuracy was measured
    cache = json.loads((tmp_path / "calibration.json").read_text())
    assert list(cache) == [cal.machine_key(model_path, 1)] and cache[cal.machine_key(model_path, 1)] == entry

    def boom(*a, **k):
        raise AssertionError("measured again although cached")
    monkeypatch.setattr(cal, "speed", boom)
    assert cal.calibrate(model_path, threads=1) == entry              # cached: no measurement
    with pytest.raises(AssertionError, match="measured again"):
        cal.calibrate(model_path, threads=2)                          # another thread count: another key


def test_engine_dtype_auto_on_cpu_follows_the_calibration(monkeypatch, tmp_path):
    from collab_app import engines

    monkeypatch.setattr(cal, "calibrate", lambda path, threads=None: {
        "dtype": "bfloat16", "quantize": "int8", "why": "test", "measured_at": "now"})
    assert engines.cpu_precision(str(tmp_path), "vllm") == {"dtype": "bfloat16", "quantize": "int8"}
    assert engines.cpu_precision(str(tmp_path), "transformers") == {"dtype": "bfloat16"}   # int8 is vLLM's

    def fails(path, threads=None):
        raise OSError("read-only")
    monkeypatch.setattr(cal, "calibrate", fails)
    assert engines.cpu_precision(str(tmp_path), "vllm") == {}       # the CPU-flags rule, and a warning
