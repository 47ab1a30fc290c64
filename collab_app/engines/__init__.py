"""The inference engines: `make_engine(kind, model)` picks and builds one (choose.py: the rule
behind "auto"); an Engine serves a team's agents, each with its own LoRA adapter version
(engine_types.py: the contract; engine_vllm.py and vllm_team.py: vLLM, one decoder pass for the
whole team; engine_hf.py: transformers + peft; engine_remote.py: a running vLLM server; team.py:
agents on different bases). This face re-exports what callers outside the room use; modules
inside the room import each other's modules, never this face."""
from __future__ import annotations

from collab_app.engines.calibrate import cpu_precision  # noqa: F401
from collab_app.engines.choose import CPU_LORA_FASTER, KINDS, auto_choice, make_engine  # noqa: F401
from collab_app.engines.device import QUANTIZE, cuda_available  # noqa: F401
from collab_app.engines.engine_types import Engine, EngineError, Progress, Request, Sampling  # noqa: F401
from collab_app.engines.requests import chat_prompt_ids, check_lengths, check_requests, stream  # noqa: F401
from trainer.dtypes import DTYPES, cpu_capability, resolve_dtype  # noqa: F401 - one rule for engines and trainer
