"""`collab bench generate`'s own arithmetic: the floor (weights x steps / bandwidth) and the
table that puts ours, the plain baseline and the floor side by side. The engines' runs are the
benchmark itself (not a test)."""
from __future__ import annotations

import pytest

from collab_app.commands import bench


def test_floor_is_the_weights_read_once_per_step(model_path):
    f = bench.floor(model_path, max_new_tokens=128, bandwidth_gbs=10.0)
    assert 0.5 < f["weight_gb_fp32"] < 0.6                    # SmolLM2-135M: ~135M params x 4 bytes
    assert f["weight_gb_int8"] < f["weight_gb_fp32"] / 3       # nearly all weights are 2-D (int8)
    assert f["weight_gb_int8"] < f["weight_gb_fp16"] < f["weight_gb_fp32"] / 1.9   # fp16: ~half of fp32
    assert abs(f["round_s_fp32"] - f["weight_gb_fp32"] * 128 / 10.0) < 0.01
    assert bench.floor(model_path, 128, 20.0)["round_s_fp32"] < f["round_s_fp32"]


def test_read_bandwidth_is_plausible():
    assert 0.5 < bench.read_bandwidth_gbs(mb=64, repeats=2) < 500


def test_table_shows_ours_the_baseline_and_the_floor():
    report = {
        "workload": {"adapters": True, "interactive": "1 prompt x 2 agents x G=4", "prompts": 0, "num_generations": 4,
                     "max_new_tokens": 128, "temperature": 0.8, "dtype": "auto", "lora_rank": 8, "lora_scale": 2.0},
        "machine": {"cpu_capability": "AVX2", "load_avg_1m_at_end": 0.5},
        "engines": {"vllm": {"dtype": "float32", "interactive": {"round_s": 25.5, "first_text_s": 0.36}},
                    "plain": {"dtype": "float32", "interactive": {"round_s": 30.0}}},
        "floor": {"bandwidth_gbs": 20.0, "weight_gb_fp32": 0.54, "weight_gb_int8": 0.14, "round_s_fp32": 3.46,
                  "round_s_int8": 0.9},
        "ratio_round_s_vllm_over_plain": 0.85,
    }
    table = bench._table(report)
    assert "round s" in table and "25.5" in table and "30.0" in table
    assert "floor round s" in table and "3.46" in table and "20.0 GB/s" in table
    assert "ratio_round_s_vllm_over_plain: 0.85" in table


def test_table_puts_rounds_beside_pausing_and_never_pausing_steps_side_by_side():
    report = {
        "workload": {"adapters": True, "interactive": "1 prompt x 2 agents x G=4", "prompts": 0, "num_generations": 4,
                     "max_new_tokens": 128, "temperature": 0.8, "dtype": "auto", "lora_rank": 8, "lora_scale": 2.0},
        "machine": {"cpu_capability": "AVX512", "load_avg_1m_at_end": 2.0},
        "engines": {"vllm": {"dtype": "bfloat16", "interactive": {"round_s": 4.2, "first_text_s": 0.05},
                             "interactive_beside_training": {"round_s": 5.08, "first_text_s": 0.06},
                             "interactive_beside_training_no_pause": {"round_s": 6.55, "first_text_s": 0.09}}},
        "floor": {"bandwidth_gbs": 11.9, "weight_gb_fp32": 0.54, "weight_gb_int8": 0.14, "round_s_fp32": 5.79,
                  "round_s_int8": 1.45},
    }
    rows = {line[:22].strip(): line[22:].split() for line in bench._table(report).splitlines()}
    assert rows["round s (train)"] == ["5.08"] and rows["round s (no pause)"] == ["6.55"]


def test_think_time_must_not_be_negative():
    with pytest.raises(SystemExit):
        bench.cli_main(["generate", "--think-s", "-1"])


def test_auto_precision_is_the_one_serve_would_use(monkeypatch):
    """The bench times what `collab serve` serves: dtype auto on a CPU is this machine's
    calibration (engines.cpu_precision: dtype, and for vLLM the base GEMMs), not the CPU-flags rule
    (they differ where the flags claim native bf16 that the kernels do not use, e.g.
    ATEN_CPU_CAPABILITY=avx2 on an AVX512_BF16 box)."""
    seen = []
    monkeypatch.setattr("collab_app.engines.device.cuda_available", lambda: False)
    monkeypatch.setattr("collab_app.engines.calibrate.cpu_precision",
                        lambda path, kind, threads=None: seen.append(kind) or {"dtype": "float32", "quantize": "fp16"})
    monkeypatch.setenv("COLLAB_CALIBRATE", "1")
    assert bench._auto_precision("/m", "vllm") == {"dtype": "float32", "quantize": "fp16"} and seen == ["vllm"]
    monkeypatch.setattr("collab_app.engines.calibrate.cpu_precision", lambda path, kind, threads=None: {})   # calibration failed
    assert bench._auto_precision("/m", "transformers") == {}
    monkeypatch.setenv("COLLAB_CALIBRATE", "0")                                         # the test session's
    assert bench._auto_precision("/m", "vllm") == {}
    monkeypatch.setenv("COLLAB_CALIBRATE", "1")
    monkeypatch.setattr("collab_app.engines.device.cuda_available", lambda: True)                        # a GPU: the engine's own
    assert bench._auto_precision("/m", "vllm") == {}


def test_every_vllm_variant_is_a_choice_with_valid_engine_keywords():
    import inspect

    from collab_app.engines import QUANTIZE
    from collab_app.engines.engine_vllm import VLLMEngine

    params = inspect.signature(VLLMEngine).parameters
    for name, kw in bench.VLLM_VARIANTS.items():
        assert kw["quantize"] in (*QUANTIZE, "auto"), name
        assert all(k in params for k in kw), name


def test_each_engine_gets_the_base_gemms_it_names(monkeypatch):
    """`transformers` = the app's transformers engine (the calibration's base GEMMs, else its flags
    rule "auto"); `transformers-torch` = torch's own GEMMs whatever was measured; vLLM variants as named."""
    calibrated = {"dtype": "float32", "quantize": "fp16"}
    monkeypatch.setattr(bench, "_auto_precision", lambda path, kind: calibrated)
    assert bench.engine_precision("transformers", "auto", "/m") == ("float32", "fp16")
    assert bench.engine_precision("transformers-torch", "auto", "/m") == ("float32", None)
    assert bench.engine_precision("vllm", "auto", "/m") == ("float32", "fp16")
    assert bench.engine_precision("vllm-onednn", "auto", "/m") == ("float32", None)
    assert bench.engine_precision("vllm-int8", "bfloat16", "/m") == ("float32", "int8")   # int8 runs fp32 activations
    monkeypatch.setattr(bench, "_auto_precision", lambda path, kind: {})                  # no calibration (a GPU, ...)
    assert bench.engine_precision("transformers", "auto", "/m") == ("auto", "auto")
    assert bench.engine_precision("vllm", "auto", "/m") == ("auto", None)


def test_vllm_runs_compiled_and_borrows_exactly_where_serve_would(monkeypatch):
    """`vllm` is the engine `collab serve` runs: compiled where the engine race cached here found
    that faster and the dtype / base GEMMs allow it (the rule make_engine applies), eager
    elsewhere; the named variants change one thing; only `vllm-noborrow` (and the engines that
    decode in another process, or the baseline) skip serve's borrowing of the trainer's cores."""
    from collab_app.engines import choose as engines

    monkeypatch.setattr("collab_app.engines.device.cuda_available", lambda: False)
    asked = []
    monkeypatch.setattr(engines, "_race_compiles", lambda path: asked.append(path) or True)
    monkeypatch.setattr("collab_app.engines.engine_vllm.cpu_compile_unfit",
                        lambda dtype, quantize, in_process=True:
                        None if dtype == "bfloat16" and not quantize and in_process else "unfit")
    kw = bench.vllm_variant_kw
    assert kw("vllm", "/m", "bfloat16", None) == {"enforce_eager": False}
    assert asked == ["/m"]     # the cached race: race_first measured it before the split (its own test)
    assert kw("vllm-noborrow", "/m", "bfloat16", None) == {"enforce_eager": False}
    assert kw("vllm-eager", "/m", "bfloat16", None) == {"enforce_eager": True}
    assert kw("vllm", "/m", "float32", None) == {}                                # fp32: the engine's default (eager)
    assert kw("vllm-fp16", "/m", "float32", "fp16") == {}
    assert kw("vllm-spawn", "/m", "bfloat16", None) == {"in_process": False}       # needs this process to compile
    monkeypatch.setattr(engines, "_race_compiles", lambda path: False)  # the race kept eager here
    assert kw("vllm", "/m", "bfloat16", None) == {}
    assert kw("vllm-compiled", "/m", "bfloat16", None) == {"enforce_eager": False}
    monkeypatch.setattr("collab_app.engines.device.cuda_available", lambda: True)                   # a GPU: vLLM's own default
    monkeypatch.setattr(engines, "_race_compiles", lambda path: True)
    assert kw("vllm", "/m", "bfloat16", None) == {}
    assert bench.NO_BORROWING == {"vllm-noborrow"}


def test_the_engine_race_is_timed_apart_from_the_engines_start(monkeypatch, tmp_path):
    """A vLLM variant that leaves compiling to the race runs it (cached, or now) before the worker's
    core split and off the start-up clock (`race_s` beside `startup_s`); the others race nothing."""
    from collab_app.engines import choose as engines

    asked = []
    monkeypatch.setattr(engines, "auto_choice", lambda path, measure=False: asked.append((path, measure)) or ([], ""))
    status = tmp_path / "status"
    assert isinstance(bench.race_first("vllm", "/m", status), float)
    assert asked == [("/m", True)] and status.read_text() == "engine race (once per machine)"
    for kind in ("vllm-eager", "vllm-compiled", "transformers", "transformers-torch", "plain", "remote"):
        assert bench.race_first(kind, "/m") is None
    assert len(asked) == 1
