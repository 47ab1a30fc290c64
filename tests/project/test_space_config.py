"""The Space's configuration agrees with itself and with what the tests ran on.

A Hugging Face Space installs Gradio from README's `sdk_version`, then `requirements.txt`; local
installs use pyproject.toml. If the three disagree, the Space runs a Gradio nobody tested (the app
needs Gradio 6 APIs), or misses a dependency pyproject has (a Space does not read pyproject).
"""
from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def front_matter() -> dict:
    text = (ROOT / "README.md").read_text()
    m = re.match(r"---\n(.*?)\n---\n", text, re.S)
    assert m, "README.md must start with the Space's YAML front matter between --- lines"
    return yaml.safe_load(m.group(1))


def requirements() -> dict[str, Requirement]:
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            r = Requirement(line)
            out[r.name.lower().replace("_", "-")] = r
    return out


def pyproject_deps() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {(r := Requirement(d)).name.lower().replace("_", "-"): r for d in deps}


def test_front_matter_names_a_gradio_space_with_pinned_versions():
    fm = front_matter()
    assert fm["sdk"] == "gradio" and fm["app_file"] == "app.py"
    assert re.fullmatch(r"\d+\.\d+\.\d+", str(fm["sdk_version"])), fm.get("sdk_version")
    assert str(fm["python_version"]) == "3.11"


def test_one_gradio_version_everywhere():
    sdk = str(front_matter()["sdk_version"])
    req, py = requirements()["gradio"], pyproject_deps()["gradio"]
    assert str(req.specifier) == f"=={sdk}", f"requirements.txt pins {req}, the Space runs gradio {sdk}"
    assert str(py.specifier) == f"=={sdk}", f"pyproject pins {py}, the Space runs gradio {sdk}"
    # what this test suite (and so every other test) ran on
    assert version("gradio") == sdk, f"installed gradio {version('gradio')} != sdk_version {sdk}: run `make install`"


def test_requirements_cover_pyproject():
    """Every runtime dependency reaches the Space; torch is pinned to the CPU wheel index."""
    req = requirements()
    missing = sorted(set(pyproject_deps()) - set(req))
    assert not missing, f"requirements.txt lacks {missing} (a Space installs only requirements.txt)"
    assert str(req["torch"].specifier).startswith("=="), "an unpinned torch pulls GBs of CUDA packages"
    assert "download.pytorch.org/whl/cpu" in (ROOT / "requirements.txt").read_text()
