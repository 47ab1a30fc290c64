"""`collab serve` runs the engine race (when engine `auto` needs one and none is cached) before it
confines itself to its engine cores: web/serve.py race_before_the_split."""
import pytest

from collab_app.web.serve import ServeConfig, race_before_the_split


@pytest.fixture
def asked(monkeypatch):
    import collab_app.engines as engines

    calls = []
    monkeypatch.setattr(engines, "auto_choice", lambda path, measure=False: calls.append((path, measure)) or ([], ""))
    monkeypatch.delenv("COLLAB_ENGINE", raising=False)
    return calls


def test_engine_auto_races_each_base_once(asked):
    race_before_the_split(ServeConfig(), ["/base", "/other", "/base"])
    assert asked == [("/base", True), ("/other", True)]   # measured now if not cached (auto_choice caches)


@pytest.mark.parametrize("cfg, env", [(ServeConfig(engine="transformers"), None), (ServeConfig(engine="vllm"), None),
                                      (ServeConfig(), "transformers"), (ServeConfig(), "http://127.0.0.1:8000"),
                                      (ServeConfig(engine_url="http://127.0.0.1:8000"), None)])
def test_an_engine_chosen_by_hand_or_remote_races_nothing(asked, monkeypatch, cfg, env):
    if env:
        monkeypatch.setenv("COLLAB_ENGINE", env)
    race_before_the_split(cfg, ["/base"])
    assert asked == []
