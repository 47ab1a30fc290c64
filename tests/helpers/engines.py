"""What the engine tests can start here."""
from __future__ import annotations

import importlib.util


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None
