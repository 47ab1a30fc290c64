"""`collab bench comlrl`: the reward adapter, the wall-clock stop, config checks (fast, no comlrl
needed), and one slow end-to-end run of comlrl's MAGRPOTrainer when the `compare` extra is in."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from collab_app.commands import bench_comlrl as bc
from tasks.base import Reward

HAVE_COMLRL = importlib.util.find_spec("comlrl") is not None
NEEDS_COMLRL = pytest.mark.skipif(not HAVE_COMLRL, reason='comlrl not installed: .venv/bin/pip install -e ".[compare]"')


class CountingTask:
    """A two-agent task whose reward is the number of characters the agents wrote (levels split)."""
    name, num_agents, roles, max_reward = "count", 2, ("helper", "main"), 100.0
    level_names = ("helper", "main")

    def reward(self, example, texts):
        levels = {"helper": float(len(texts[0])), "main": float(len(texts[1]))}
        return Reward(total=sum(levels.values()), levels=levels, max_total=self.max_reward)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_reward_adapter_returns_our_total_on_humaneval():
    from tasks import load_task

    task = load_task("humaneval")
    ex = task.examples("train")[0]
    helper = "def aux(xs):\n    return xs\n"
    main = ex["prompt"] + ex["canonical_solution"]
    adapter = bc.RewardAdapter(task)
    got = adapter([helper], [main], batch_items=[ex])
    want = task.reward(ex, [helper, main])
    assert got == [pytest.approx(want.total)]
    assert want.total > 0  # the canonical solution at least earns structure and syntax
    assert adapter.calls == 1 and [r.total for r in adapter.take()] == [want.total]
    assert adapter.take() == []


@NEEDS_COMLRL
def test_reward_adapter_through_comlrls_dispatch():
    """comlrl inspects reward_func's signature to decide how to call it: ours must get the
    per-agent completions and the example (batch_items)."""
    from comlrl.utils.reward_utils import call_reward_function

    adapter = bc.RewardAdapter(CountingTask())
    out = call_reward_function(adapter, ["prompt"], [["abc"], ["de"]], num_agents=2, batch_items=[{"id": "x"}])
    assert out == [5.0]


def test_reward_adapter_rejects_wrong_shapes():
    adapter = bc.RewardAdapter(CountingTask())
    with pytest.raises(ValueError, match="batch_items"):
        adapter(["a"], ["b"])
    with pytest.raises(ValueError, match="agents"):
        adapter(["a"], batch_items=[{}])


def _drive(loader, reward, seconds_per_prompt):
    """Play comlrl's loop: per prompt, 'generate' (the clock moves) and call the reward G=2 times."""
    seen = []
    for batch in loader:
        assert len(batch) == 1
        seen.append(batch[0]["id"])
        loader.clock.t += seconds_per_prompt
        for text in ("ab", "abcd"):
            reward([text], ["x"], batch_items=batch)
    return seen


def test_budget_stops_at_an_update_boundary_after_the_budget():
    examples = [{"id": i} for i in range(3)]
    reward, clock = bc.RewardAdapter(CountingTask()), FakeClock()
    loader = bc.BudgetLoader(examples, reward, prompts_per_update=2, budget_s=10.0, clock=clock)
    seen = _drive(loader, reward, seconds_per_prompt=3.0)
    # updates end at 6 s (under budget: go on) and 12 s (spent: stop); never half an update
    assert len(seen) == 4 and loader.prompts == 4 and loader.updates == 2
    assert sorted(seen[:3]) == [0, 1, 2]      # a full pass before any prompt repeats
    assert "time budget" in loader.stopped_by
    assert loader.elapsed() == pytest.approx(12.0)
    assert [p["minutes"] for p in loader.curve] == [0.1, 0.2]
    assert [p["reward_calls"] for p in loader.curve] == [4, 8]
    # returns per update: each prompt gets totals 3 and 5 -> mean 4
    assert all(p["mean_return"] == 4.0 and p["levels"] == {"helper": 3.0, "main": 1.0} for p in loader.curve)


def test_budget_spent_mid_update_still_finishes_the_update():
    reward, clock = bc.RewardAdapter(CountingTask()), FakeClock()
    loader = bc.BudgetLoader([{"id": i} for i in range(5)], reward, prompts_per_update=4, budget_s=1.0, clock=clock)
    _drive(loader, reward, seconds_per_prompt=30.0)
    assert loader.prompts == 4 and loader.updates == 1


def test_max_updates_stops_before_the_budget():
    reward, clock = bc.RewardAdapter(CountingTask()), FakeClock()
    loader = bc.BudgetLoader([{"id": i} for i in range(2)], reward, prompts_per_update=1, budget_s=1e9,
                             max_updates=3, clock=clock)
    seen = _drive(loader, reward, seconds_per_prompt=1.0)
    assert loader.updates == 3 and len(seen) == 3 and "max_updates" in loader.stopped_by


def test_train_order_matches_collab_train():
    """Prompt order = trainer.magrpo's: pass p over the split shuffled by (seed, p)."""
    import itertools
    import random

    examples = list(range(7))
    got = list(itertools.islice(bc.train_order(examples, seed=3), 14))
    want = []
    for p in range(2):
        order = list(range(7))
        random.Random(3 * 1_000_003 + p).shuffle(order)
        want += order
    assert got == want


@pytest.mark.parametrize("kw, flag", [
    ({"max_minutes": 0}, "--max-minutes"),
    ({"max_minutes": float("nan")}, "--max-minutes"),
    ({"num_generations": 1}, "--num-generations"),
    ({"prompts_per_update": 0}, "--prompts-per-update"),
    ({"learning_rate": 0.0}, "--learning-rate"),
    ({"temperature": 0.0}, "--temperature"),
    ({"top_p": 1.5}, "--top-p"),
    ({"top_k": -1}, "--top-k"),
    ({"eval_limit": -1}, "--eval-limit"),
    ({"max_updates": -2}, "--max-updates"),
])
def test_config_errors_name_the_fix(kw, flag):
    with pytest.raises(ValueError, match=flag):
        bc.ComlrlBenchConfig(**kw)


def test_cli_rejects_bad_values(capsys):
    with pytest.raises(SystemExit) as e:
        bc.cli_main(["--max-minutes", "-5"])
    assert e.value.code == 2 and "--max-minutes must be a positive" in capsys.readouterr().err


def test_bench_dispatches_comlrl(capsys):
    from collab_app.commands.bench import cli_main

    with pytest.raises(SystemExit):
        cli_main(["comlrl", "--help"])
    assert "--max-minutes" in capsys.readouterr().out


def test_missing_comlrl_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "comlrl", None)   # import comlrl -> ImportError
    with pytest.raises(SystemExit) as e:
        bc.require_comlrl()
    assert '.venv/bin/pip install -e ".[compare]"' in str(e.value.code)


def test_chat_text_tokenizes_like_our_engines(model_path):
    """comlrl tokenizes the formatter's text with tokenizer(text): the ids must be the ones our
    engines feed the model, and the pad comlrl looks for must not occur in them."""
    from transformers import AutoTokenizer

    from collab_app.engines import chat_prompt_ids
    from collab_app.engines.engine_types import Request
    from tasks import load_task

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.pad_token = bc.COMLRL_PAD_TOKEN
    task = load_task("humaneval")
    ex = task.examples("train")[0]
    for k, text in enumerate(bc.make_formatters(task, tok)):
        ids = tok(text(ex))["input_ids"]
        assert ids == chat_prompt_ids(tok, Request(task.roles[k], task.agent_prompts(ex, [])[k]))
        assert tok.pad_token_id not in ids


@pytest.mark.slow
@NEEDS_COMLRL
def test_comlrl_trains_saves_and_evaluates(tmp_path):
    """One comlrl update (2 prompts, G=2, 16 tokens), models saved, 2 eval problems before/after."""
    out, models = tmp_path / "result.json", tmp_path / "models"
    rc = bc.cli_main(["--max-minutes", "0.01", "--max-updates", "1", "--prompts-per-update", "2",
                      "--num-generations", "2", "--train-limit", "2", "--max-new-tokens", "16",
                      "--eval-limit", "2", "--eval-max-new-tokens", "16", "--output-dir", str(models),
                      "--out", str(out), "--json",
                      # one thread: beside other jobs (CI, a training run) a second OpenMP thread
                      # spin-waits for its preempted sibling and the run crawls (seen: 13 min a prompt)
                      "--threads", "1"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert (models / "agent_0" / "model.safetensors").exists() and (models / "agent_1" / "model.safetensors").exists()
    assert json.loads((models / "roles.json").read_text()) == {"helper": "agent_0", "main": "agent_1"}
    train = result["train"]
    assert train["updates"] == 1 and train["prompts"] == 2 and train["reward_calls"] == 4
    assert len(train["curve"]) == 1 and train["curve"][0]["mean_return"] is not None
    for system in ("before", "after"):
        s = result["systems"][system]
        assert set(s["returns"]) == {"HumanEval/0", "HumanEval/1"}
        assert {"mean_return", "pass@1", "levels"} <= set(s)
    assert set(result["gain"]) == {"mean_return", "pass@1", "levels"}
    assert result["comlrl_version"] == "1.4.3" and result["machine"]["cpu_capability"]
