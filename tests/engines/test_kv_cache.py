"""The transformers engine's KV cache written in place (engine_hf.PreallocatedLayer): the same keys
and values as transformers' DynamicLayer after every kind of update the engine and `generate`
make, positions written without copying the cache, and the engine's tokens and log-probs
unchanged against DynamicCache (shared prefill n > 1 and plain n = 1)."""
from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from collab_app.engines import engine_hf
from collab_app.engines.engine_hf import PreallocatedLayer
from collab_app.engines.engine_types import Request, Sampling
from helpers.engines import PROMPT, setup_agents


def _kv(batch: int, positions: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, positions, 4, generator=g), torch.randn(batch, 3, positions, 4, generator=g))


def _same(ours: PreallocatedLayer, theirs: DynamicLayer):
    assert ours.get_seq_length() == theirs.get_seq_length()
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_updates_match_dynamic_layer_and_write_in_place():
    ours, theirs = PreallocatedLayer(capacity=12), DynamicLayer()
    for step, positions in enumerate([5, 1, 1, 1, 3, 1]):    # a prefill, decode steps, a 3-token chunk
        k, v = _kv(2, positions, step)
        out, ref = ours.update(k, v), theirs.update(k, v)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        _same(ours, theirs)
        if step == 0:
            base = ours.keys.data_ptr()
        assert ours.keys.data_ptr() == base, "an update within the capacity copied the cache"


def test_room_doubles_when_the_capacity_runs_out():
    ours, theirs = PreallocatedLayer(), DynamicLayer()   # no capacity given: exactly the first update's size
    moves = 0
    last = None
    for step in range(20):
        k, v = _kv(1, 1, step)
        ours.update(k, v)
        theirs.update(k, v)
        moves += last is not None and ours.keys.data_ptr() != last
        last = ours.keys.data_ptr()
        _same(ours, theirs)
    assert ours._buffers[0].shape[-2] == 32 and moves == 5   # 1 -> 2 -> 4 -> 8 -> 16 -> 32


@pytest.mark.parametrize("change", ["batch_repeat_interleave", "batch_select_indices", "crop", "reset"])
def test_a_cache_changed_between_updates_stays_equal(change):
    ours, theirs = PreallocatedLayer(capacity=16), DynamicLayer()
    for layer in (ours, theirs):
        layer.update(*_kv(2, 6, 0))
        if change == "batch_repeat_interleave":    # the engine's shared prefill: (requests) -> (requests * n)
            layer.batch_repeat_interleave(3)
        elif change == "batch_select_indices":
            layer.batch_select_indices(torch.tensor([1]))
        elif change == "crop":
            layer.crop(-2)
        else:
            layer.reset()
    batch = {"batch_repeat_interleave": 6, "batch_select_indices": 1}.get(change, 2)
    for step in range(3):
        k, v = _kv(batch, 1, 10 + step)
        ours.update(k, v)
        theirs.update(k, v)
        _same(ours, theirs)


@pytest.fixture(scope="module")
def engine(model_path, adapters):
    eng = engine_hf.TransformersEngine(model_path, dtype="float32", quantize=None, seed=0)
    setup_agents(eng, adapters)
    return eng


@pytest.fixture(scope="module")
def engine_bf16(model_path, adapters):
    eng = engine_hf.TransformersEngine(model_path, dtype="bfloat16", seed=0)
    setup_agents(eng, adapters)
    return eng


def _compare(engine, monkeypatch, n, others):
    """The engine's samples with its preallocated cache, then with `others` (a cache factory)."""
    requests = [Request("a1", PROMPT), Request("base", "Name three colours."), Request("a2", PROMPT)]
    sampling = Sampling(max_new_tokens=12, temperature=0.9, seed=3)

    def run():
        return [[(s.token_ids, s.logprobs) for s in row] for row in engine.generate(requests, n, sampling)]

    made = []
    real = engine_hf.preallocated_cache
    monkeypatch.setattr(engine_hf, "preallocated_cache", lambda room: made.append(room) or real(room))
    ours = run()
    assert made, "the engine did not use the preallocated cache"
    monkeypatch.setattr(engine_hf, "preallocated_cache", others)
    return ours, run(), made


@pytest.mark.parametrize("n", [1, 3])
def test_engine_tokens_and_logprobs_equal_dynamic_cache(engine, monkeypatch, n):
    ours, theirs, made = _compare(engine, monkeypatch, n, lambda room: DynamicCache())
    assert ours == theirs


def test_a_bf16_engine_gives_the_same_samples(engine_bf16, monkeypatch):
    """bf16 attends in fp32 at decode steps on a CPU (trainer.dtypes._fp32_attention), on the views."""
    ours, theirs, made = _compare(engine_bf16, monkeypatch, 3, lambda room: DynamicCache())
    assert ours == theirs


def test_a_repeated_prefill_takes_the_call_room_once_per_row_not_per_request(engine, monkeypatch):
    """The shared prefill caches each request's prompt at its own size; its n rows' buffers take
    the whole call's room (padded prompt + max_new_tokens) at their first decode step, in one copy
    (the repeat copies anyway), not a doubling of the prompt's size; no copy after that."""
    seen = []
    real = engine._shared_prefill

    def spy(model, prompts, names, n, room):
        cache = real(model, prompts, names, n, room)
        seen.append((cache, prompts["input_ids"].shape, n, room, [layer._buffers[0].shape for layer in cache.layers]))
        return cache

    monkeypatch.setattr(engine, "_shared_prefill", spy)
    requests = [Request("a1", PROMPT), Request("a2", PROMPT + " Answer in one line.")]
    engine.generate(requests, 3, Sampling(max_new_tokens=5, temperature=0.9, seed=3))
    [(cache, (batch, width), n, room, prefill_shapes)] = seen
    assert room == width + 5 and 2 * (width - 1) > room   # doubling the prompt's buffers would overshoot
    for shape in prefill_shapes:
        assert shape[0] == batch and shape[-2] == width - 1   # the prompts but their last token, at their size
    for layer in cache.layers:
        assert layer._buffers[0].shape[0] == batch * n and layer._buffers[0].shape[-2] == room
        assert layer.keys.data_ptr() == layer._buffers[0].data_ptr() and layer.get_seq_length() == room - 1
