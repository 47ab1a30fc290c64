"""A heterogeneous team served as one Engine (engines/team.py TeamEngine, issue 23): agent `a` on
the embedded SmolLM2, agent `b` on the tiny Qwen2 with its own tokenizer (helpers/tiny_model.py),
on the transformers engine. One request list streams over both bases; each sample names its base
and carries its own tokenizer's prompt ids; hot-swapping b's adapter changes b only; memory is
reported per base; a homogeneous team still gets the plain engine."""
from __future__ import annotations

import pytest

from collab_app.engines.engine_types import EngineError, Request, Sampling
from helpers.engines import PROMPT
from helpers.tiny_model import make_tiny_lora


@pytest.fixture(scope="module")
def team_engine(model_path, tiny_model_path):
    from collab_app.engines.team import make_team_engine

    eng = make_team_engine("transformers", model_path, {"a": "", "b": tiny_model_path}, seed=0, dtype="float32")
    eng.register_agent("a")
    eng.register_agent("b")
    yield eng
    eng.close()


def test_one_stream_over_two_bases_each_sample_on_its_own(team_engine, model_path, tiny_model_path):
    from collab_app.engines.team import TeamEngine

    assert isinstance(team_engine, TeamEngine) and team_engine.model_of("b") == tiny_model_path
    reqs = [Request("b", PROMPT), Request("a", PROMPT)]
    snaps = list(team_engine.generate_stream(reqs, 2, Sampling(max_new_tokens=6, temperature=0.8, seed=0)))
    assert len(snaps) >= 2 and snaps[-1].finished and not snaps[0].finished   # streamed, base by base
    b, a = snaps[-1].result()
    assert [s.meta["model"] for s in a] == [model_path] * 2 and [s.meta["model"] for s in b] == [tiny_model_path] * 2
    assert a[0].prompt_token_ids != b[0].prompt_token_ids                      # each base's own tokenizer
    assert max(t for s in b for t in s.token_ids + s.prompt_token_ids) < 1100  # the tiny vocabulary
    assert all(len(s.logprobs) == len(s.token_ids) > 0 for s in a + b)
    assert team_engine.prompt_token_counts(reqs) == [len(b[0].prompt_token_ids), len(a[0].prompt_token_ids)]
    with pytest.raises(EngineError, match="unknown agent"):
        team_engine.generate([Request("c", PROMPT)], 1, Sampling(max_new_tokens=2))


def test_hot_swap_goes_to_the_agents_own_base(team_engine, tiny_model_path, tmp_path):
    greedy = Sampling(max_new_tokens=4, temperature=0.0)
    before = team_engine.generate([Request("a", PROMPT), Request("b", PROMPT)], 1, greedy)
    team_engine.load_adapter("b", make_tiny_lora(tiny_model_path, tmp_path / "lora"), 3)
    assert team_engine.adapter_version("b") == 3 and team_engine.adapter_version("a") is None
    after = team_engine.generate([Request("a", PROMPT), Request("b", PROMPT)], 1, greedy)
    assert after[1][0].adapter_version == 3 and after[0][0].adapter_version is None
    assert after[0][0].token_ids == before[0][0].token_ids                     # a's base untouched
    assert (after[1][0].token_ids, after[1][0].logprobs) != (before[1][0].token_ids, before[1][0].logprobs)
    team_engine.load_adapter("b", None, None)                                  # back to b's base
    assert team_engine.adapter_version("b") is None


def test_memory_per_base_and_a_homogeneous_team_gets_the_plain_engine(team_engine, model_path, tiny_model_path):
    from collab_app.engines.engine_hf import TransformersEngine
    from collab_app.engines.team import make_team_engine

    mem = team_engine.memory()
    assert mem[model_path]["agents"] == ["a"] and mem[tiny_model_path]["agents"] == ["b"]
    assert 0 < mem[tiny_model_path]["weights_bytes"] < mem[model_path]["weights_bytes"] / 50
    plain = make_team_engine("transformers", model_path, {"a": "", "b": model_path}, dtype="float32")
    try:
        assert isinstance(plain, TransformersEngine)
    finally:
        plain.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_a_team_on_two_bases_on_vllm(model_path, tmp_path):
    # the vLLM backend of a TeamEngine: one in-process vLLM engine per base (the embedded model
    # and a 4-layer cut of it), one stream over both, a hot-swap on one base's agent only
    from collab_app.engines import stream
    from collab_app.engines.team import TeamEngine, make_team_engine
    from helpers.engines import vllm_importable
    from helpers.tiny_model import build_shallow_model

    if not vllm_importable():
        pytest.skip("vllm is not importable")
    from collab_app.commands.bench import make_random_lora   # not `from conftest import`: in a full run
    # `conftest` may name another folder's conftest module

    shallow = build_shallow_model(model_path, str(tmp_path / "shallow"))
    eng = make_team_engine("vllm", model_path, {"a": "", "b": shallow}, num_agents=1, dtype="float32", seed=0)
    try:
        assert isinstance(eng, TeamEngine) and {e.name for e in eng.engines.values()} == {"vllm"}
        eng.register_agent("a")
        eng.register_agent("b")
        greedy = Sampling(max_new_tokens=6, temperature=0.0)
        reqs = [Request("a", PROMPT), Request("b", PROMPT)]
        snaps = list(stream(eng, reqs, 2, greedy))
        a, b = snaps[-1].done
        assert [s.meta["model"] for s in a] == [model_path] * 2 and [s.meta["model"] for s in b] == [shallow] * 2
        assert all(len(s.logprobs) == len(s.token_ids) > 0 for s in a + b)
        mem = eng.memory()
        assert mem[model_path]["agents"] == ["a"] and 0 < mem[shallow]["weights_bytes"] < mem[model_path]["weights_bytes"]
        eng.load_adapter("b", make_random_lora(shallow, tmp_path / "lora", 1, r=8, scale=2.0), 1)
        a2, b2 = eng.generate(reqs, 1, greedy)
        assert b2[0].adapter_version == 1 and a2[0].adapter_version is None
        assert a2[0].token_ids == a[0].token_ids and b2[0].token_ids != b[0].token_ids
    finally:
        eng.close()
