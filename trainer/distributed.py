"""Data-parallel MAGRPO updates under `torchrun` (docs/ARCHITECTURE.md "Beyond one machine"): the
few torch.distributed calls the trainer makes, all through torch.distributed's own collectives.

torchrun starts one process per GPU (or per CPU share) and sets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT; `init()` joins that group (nccl on GPUs, gloo on CPU). Without those
variables `init()` does nothing and every helper below is the identity (world size 1).

How one step is split (trainer/magrpo.py, MAGRPOTrainer.update / _update_agent): every rank
holds the SAME groups in the same order; rank r runs forward/backward on micro-batches r, r+W,
r+2W, ... of each agent; an agent's loss is a weighted SUM over all the step's samples, so the
one-process gradient is the SUM of the ranks' gradients (all_reduce(SUM), not DDP's mean); every
rank clips the identical summed gradient and takes the same AdamW step, so the adapters stay
identical without shipping weights; rank 0 alone writes adapter versions, store rows and logs.

Not DistributedDataParallel: a rank may have fewer micro-batches than another (or none), and DDP
needs the same forward/backward calls on every rank. Control messages and Python objects go over
a gloo group, so followers waiting for a command block on a CPU socket, not in a GPU kernel.
Left out: tensor/pipeline parallelism of the base model, and gradient compression. Each rule and
its reason: docs/ARCHITECTURE.md "Data-parallel updates".
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

TIMEOUT = timedelta(hours=1)
"""How long a rank waits in a collective: rank 0 evaluates (`collab train`), self-plays or polls
an empty store (`collab trainer` sends an idle message every poll) while the others wait."""

_control = None   # the gloo group for objects (None: the default group)


def init() -> int:
    """Join torchrun's process group if this process was started by torchrun with WORLD_SIZE > 1
    (nccl when a GPU is visible, each rank on cuda:LOCAL_RANK; else gloo). Returns the world size."""
    global _control
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=TIMEOUT)
        _control = dist.new_group(backend="gloo", timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    log.info("data parallel: rank %d of %d (%s)", rank(), world_size(), dist.get_backend())
    return dist.get_world_size()


def close() -> None:
    """Leave the process group (end of a command); no-op when none was joined."""
    global _control
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _control = None


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0: the one process that writes adapter versions, store rows, logs and prints."""
    return rank() == 0


def shard(items: list) -> list:
    """This rank's share: items r, r+W, r+2W, ... (all of them when W = 1)."""
    return items[rank()::world_size()]


def _device() -> torch.device:
    """Where the default group's tensors must live (nccl: this rank's GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Element-wise sum / max / min of `values` over the ranks (float64)."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return t.tolist()


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the parameters' gradients over the ranks, in place, in one flat all_reduce. A rank
    that ran no micro-batch of this agent contributes zeros; a parameter that no rank reached
    keeps grad None (exactly as in one process, where AdamW then skips it)."""
    if world_size() == 1:
        return
    reached = all_reduce([float(p.grad is not None) for p in params], "max")
    for p, r in zip(params, reached):
        if r and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))


@torch.no_grad()
def broadcast_(tensors: list[torch.Tensor]) -> None:
    """Overwrite the tensors with rank 0's, in place (one flat broadcast)."""
    if world_size() == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(_device())
    dist.broadcast(flat, src=0)
    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(chunk.view_as(t))


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (the others pass anything, e.g. None). Picklable objects only;
    tensors in it should be on the CPU (`to_cpu`): a CUDA tensor would arrive on rank 0's GPU."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


def all_gather_objects(obj: Any) -> list:
    """[rank 0's obj, rank 1's obj, ...] on every rank."""
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj, group=_control)
    return out


def to_cpu(obj: Any) -> Any:
    """A copy of a nested dict/list/tuple (an optimizer state_dict) with every tensor on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def scratch_dir(what: str) -> str:
    """A private temp dir of this rank, removed when the process exits (ranks > 0 keep their copies
    of the adapter versions there: rank 0's adapters_dir may not even be mounted on their node)."""
    path = tempfile.mkdtemp(prefix=f"collab-rank{rank()}-{what}-")
    atexit.register(shutil.rmtree, path, True)
    return path
