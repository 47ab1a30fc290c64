"""A trainer's adapters and optimizers against their versions on disk (trainer/adapters.py) and
across data-parallel ranks: where a `MAGRPOTrainer` starts (resume from the latest versions, or
save version 0 of every agent), saving one agent's next version, and under torchrun every rank
starting from rank 0's state. trainer/magrpo.py keeps the algorithm; this is its bookkeeping."""
from __future__ import annotations

import logging
import os
from dataclasses import asdict
import torch

from trainer import adapters as versions_on_disk
from trainer import distributed
from trainer.config import StepConfig

log = logging.getLogger(__name__)


def start(trainer) -> None:
    """Set the trainer's versions, step, version times, weights and AdamW moments: rank 0 from
    its adapters_dir, every other rank from rank 0."""
    if distributed.is_main():
        _from_disk(trainer)
    if distributed.world_size() > 1:
        _sync_from_main(trainer)


def save(model, optimizer: torch.optim.Optimizer, cfg: StepConfig, adapters_dir: str, agent: str, version: int,
         meta: dict) -> str:
    """Write `agent`'s adapter (peft format, from `model`: the PeftModel holding it) and optimizer
    state as `version` (atomic, then prune to cfg.keep_versions); returns the version's directory.
    meta["base_model"]: the agent's base (default cfg.model), recorded in collab.json."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    def write(tmp: str) -> None:
        state = {k: v.detach().cpu().contiguous() for k, v in
                 get_peft_model_state_dict(model, adapter_name=agent).items()}
        save_file(state, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        model.peft_config[agent].save_pretrained(tmp)
        torch.save(optimizer.state_dict(), os.path.join(tmp, versions_on_disk.OPTIMIZER))

    meta = {"base_model": cfg.model, **meta, "config": asdict(cfg)}
    path = versions_on_disk.save_version(adapters_dir, agent, version, write, meta)
    versions_on_disk.prune_versions(adapters_dir, agent, cfg.keep_versions)
    return path


def _from_disk(trainer) -> None:
    """Resume from the latest readable versions in adapters_dir, or save version 0 of every agent;
    then, where an agent's floor (trainer/adapters.py) is above what it resumed from, save that
    state again as the floor's number, so a version number is never used twice."""
    adapters_dir = trainer.adapters_dir
    for a in trainer.agents:
        for path in versions_on_disk.remove_partial(adapters_dir, a):
            log.warning("removed a half-written adapter version left by a crash: %s", path)
    found = {a: versions_on_disk.latest_version(adapters_dir, a) for a in trainer.agents}
    if any(found.values()):
        if not trainer.cfg.resume:
            raise FileExistsError(f"{adapters_dir} already holds adapter versions: pass --resume to "
                                  f"continue from them, or choose a fresh --adapters-dir")
        missing = [a for a, f in found.items() if f is None]
        if missing:
            raise FileNotFoundError(f"{adapters_dir} has versions for {sorted(set(found) - set(missing))} "
                                    f"but none for {missing}: it belongs to another team; use a fresh --adapters-dir")
        for a in trainer.agents:
            _resume_agent(trainer, a)
        log.info("resumed at step %d from versions %s", trainer.step, trainer.versions)
    else:
        for a in trainer.agents:
            trainer.versions[a] = 0
    for a in trainer.agents:
        resumed = versions_on_disk.latest_version(adapters_dir, a)
        floor = versions_on_disk.floor(adapters_dir, a)
        if resumed is None or (floor is not None and floor > resumed[0]):
            trainer.versions[a] = max(floor or 0, 0)
            parent = None if resumed is None else resumed[0]
            if floor:
                log.warning("agent %s: versions up to %d were published but are not in %s (a lost or restored "
                            "folder, or a version that could not be read): continuing from %s as version %d",
                            a, floor - 1, adapters_dir, "a fresh adapter" if parent is None else f"version {parent}",
                            floor)
            trainer.save_version(a, {"step": trainer.step, "parent_version": parent, "metrics": {}})
        versions_on_disk.clear_floor(adapters_dir, a)


def _resume_agent(trainer, a: str) -> None:
    """Load agent `a`'s newest readable version; one that cannot be read (truncated or corrupt
    file) is quarantined and the one before it tried, down to none (then the fresh adapter the
    trainer was built with stays, saved at the floor by `_from_disk`)."""
    from peft import set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    while (found := versions_on_disk.latest_version(trainer.adapters_dir, a)) is not None:
        version, path = found
        was_on = None
        try:
            was_on = versions_on_disk.read_meta(path).get("base_model")
            state = load_file(os.path.join(path, "adapter_model.safetensors"))
        except (SafetensorError, OSError, ValueError) as e:   # truncated, emptied, unreadable meta
            aside = versions_on_disk.quarantine(path)
            log.error("agent %s: version %d cannot be read (%s: %s); moved it to %s and trying the version "
                      "before it", a, version, type(e).__name__, str(e)[:200], aside)
            continue
        try:
            set_peft_model_state_dict(trainer.model_of[a], state, adapter_name=a)
        except RuntimeError as e:   # shapes of another base: torch's size-mismatch error
            raise ValueError(f"{path} is agent {a!r}'s adapter on base {was_on}, which does not fit its base "
                             f"now ({trainer.base_of[a]}): {str(e)[:300]}; resume with the same --model / "
                             f"--agent-models, or use a fresh --adapters-dir") from e
        if was_on and was_on != trainer.base_of[a]:
            log.warning("%s was trained on base %s; resuming it on %s (same shapes)", path, was_on, trainer.base_of[a])
        opt = os.path.join(path, versions_on_disk.OPTIMIZER)
        if os.path.exists(opt):
            try:
                trainer.optimizers[a].load_state_dict(torch.load(opt, weights_only=True, map_location=trainer.device))
            except Exception as e:  # noqa: BLE001 - a corrupt or foreign optimizer state: keep the weights
                log.warning("%s: its optimizer state cannot be loaded (%s: %s): AdamW moments restart from zero",
                            path, type(e).__name__, str(e)[:200])
        else:
            log.warning("%s has no optimizer state: AdamW moments restart from zero", path)
        trainer.versions[a] = version
        meta = versions_on_disk.read_meta(path)
        trainer.step = max(trainer.step, int(meta.get("step", 0)))
        trainer.train_seconds = max(trainer.train_seconds, float(meta.get("metrics", {}).get("train_seconds", 0.0)))
        trainer.saved_at[a] = [float(versions_on_disk.read_meta(p).get("created_at", 0.0))
                               for v, p in versions_on_disk.list_versions(trainer.adapters_dir, a) if 0 < v <= version]
        return


def _sync_from_main(trainer) -> None:
    """Data parallel: every rank starts from rank 0's adapters, AdamW moments, versions, step and
    version times (rank 0 resumed them from its adapters_dir, which the others may not see);
    ranks > 0 then keep a copy of each current version in their scratch adapters_dir."""
    main = distributed.is_main()
    state = distributed.broadcast_object(
        {"versions": trainer.versions, "step": trainer.step, "saved_at": trainer.saved_at,
         "train_seconds": trainer.train_seconds,
         "optimizers": {a: distributed.to_cpu(o.state_dict()) for a, o in trainer.optimizers.items()}}
        if main else None)
    for a in trainer.agents:
        distributed.broadcast_(trainer.params[a])
    if not main:
        trainer.versions, trainer.step, trainer.saved_at = state["versions"], state["step"], state["saved_at"]
        trainer.train_seconds = state["train_seconds"]
        for a in trainer.agents:
            trainer.optimizers[a].load_state_dict(state["optimizers"][a])
            trainer.save_version(a, {"step": trainer.step, "parent_version": None, "metrics": {}})
