"""Adapter versions on disk: atomic writes (a crash mid-write leaves nothing loadable),
latest_version ignores partial dirs, pruning, and resuming a trainer from its latest version."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from trainer import adapters


def _write_files(tmp):
    with open(os.path.join(tmp, "adapter_model.safetensors"), "wb") as f:
        f.write(b"weights")


def test_save_and_latest(tmp_path):
    d = str(tmp_path)
    assert adapters.latest_version(d, "main") is None
    for v in (0, 1, 2):
        adapters.save_version(d, "main", v, _write_files, {"step": v})
    version, path = adapters.latest_version(d, "main")
    assert version == 2 and path.endswith("main/v000002")
    meta = adapters.read_meta(path)
    assert meta["step"] == 2 and meta["agent"] == "main" and meta["created_at"] > 0
    with pytest.raises(FileExistsError, match="immutable"):
        adapters.save_version(d, "main", 2, _write_files, {})


def test_every_file_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """Weights and optimizer state reach the disk before the version dir appears (like collab.json)."""
    synced, real_fsync, real_rename = [], os.fsync, os.rename

    def fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        synced.append(("rename", os.path.basename(dst)))
        real_rename(src, dst)

    def write(tmp):
        _write_files(tmp)
        with open(os.path.join(tmp, adapters.OPTIMIZER), "wb") as f:
            f.write(b"adam")

    monkeypatch.setattr(adapters.os, "fsync", fsync)
    monkeypatch.setattr(adapters.os, "rename", rename)
    adapters.save_version(str(tmp_path), "main", 1, write, {})
    cut = synced.index(("rename", "v000001"))
    assert {"adapter_model.safetensors", adapters.OPTIMIZER, adapters.MARKER} <= set(synced[:cut])
    assert synced[cut + 1:] == ["main"]                    # then the parent dir: the rename is durable


def test_failed_write_leaves_nothing(tmp_path):
    def explode(tmp):
        _write_files(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        adapters.save_version(str(tmp_path), "helper", 1, explode, {})
    assert os.listdir(tmp_path / "helper") == []          # the temp dir was removed, no v000001


def test_crash_mid_write_is_never_visible(tmp_path):
    """A process killed inside the write (os._exit: no cleanup runs) leaves its temp dir behind;
    readers ignore it, and so they do a version dir without the completeness marker."""
    d = str(tmp_path)
    adapters.save_version(d, "helper", 0, _write_files, {"step": 0})
    script = textwrap.dedent(f"""
        import os
        from trainer import adapters
        def die(tmp):
            open(os.path.join(tmp, "adapter_model.safetensors"), "wb").write(b"half")
            os._exit(9)
        adapters.save_version({d!r}, "helper", 1, die, {{}})
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 9
    left = os.listdir(tmp_path / "helper")
    assert any(n.startswith(".tmp-v000001") for n in left) and "v000001" not in left
    os.makedirs(tmp_path / "helper" / "v000002")           # no collab.json: incomplete
    assert adapters.latest_version(d, "helper")[0] == 0
    assert [v for v, _ in adapters.list_versions(d, "helper")] == [0]
    removed = adapters.remove_partial(d, "helper")
    assert len(removed) == 1 and not any(n.startswith(".tmp-") for n in os.listdir(tmp_path / "helper"))


def test_prune_keeps_version_0_the_newest_and_only_the_latest_optimizer(tmp_path):
    d = str(tmp_path)
    for v in range(6):
        adapters.save_version(d, "a", v, lambda t: open(os.path.join(t, adapters.OPTIMIZER), "wb").close(), {})
    removed = adapters.prune_versions(d, "a", keep=2)
    assert [v for v, _ in adapters.list_versions(d, "a")] == [0, 4, 5]
    assert len(removed) == 3
    has_opt = {v: os.path.exists(os.path.join(p, adapters.OPTIMIZER)) for v, p in adapters.list_versions(d, "a")}
    assert has_opt == {0: False, 4: False, 5: True}


# ------------------------------------------------------------------------------- trainer resume
def _lora_state(trainer, agent):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n and f".{agent}." in n}


def test_trainer_saves_version_0_then_resumes_weights_step_and_optimizer(model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tasks import load_task
    from helpers.trainer_groups import on_policy_groups
    from trainer.config import MAGRPOConfig
    from trainer.magrpo import MAGRPOTrainer

    cfg = MAGRPOConfig(task="tldr", model=model_path, dtype="float32", learning_rate=1e-3, keep_versions=0)
    d = str(tmp_path / "adapters")
    first = MAGRPOTrainer(cfg, load_task("tldr"), d)
    for agent in first.agents:
        v, path = adapters.latest_version(d, agent)
        assert v == 0 and adapters.read_meta(path)["step"] == 0
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(path))
    first.update(on_policy_groups(first))
    assert first.step == 1 and first.versions == {a: 1 for a in first.agents}

    second = MAGRPOTrainer(cfg, load_task("tldr"), d)       # resume (cfg.resume defaults to True)
    assert second.step == 1 and second.versions == first.versions
    for agent in first.agents:
        a, b = _lora_state(first, agent), _lora_state(second, agent)
        assert all(torch.equal(a[k], b[k]) for k in a)
        s1, s2 = first.optimizers[agent].state_dict()["state"], second.optimizers[agent].state_dict()["state"]
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)
    meta = adapters.read_meta(second.adapter_path("summary"))
    assert meta["parent_version"] == 0 and meta["step"] == 1 and "return_mean" in meta["metrics"]
    assert json.loads(open(os.path.join(second.adapter_path("summary"), "adapter_config.json")).read())["r"] == cfg.lora_r

    # the saved version is a plain peft adapter: PeftModel loads it and it is not the base model
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, second.adapter_path("summary"))
    lora_b = [p for n, p in loaded.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)

    with pytest.raises(FileExistsError, match="--resume"):
        MAGRPOTrainer(MAGRPOConfig(**{**cfg.__dict__, "resume": False}), load_task("tldr"), d)
