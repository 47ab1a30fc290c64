"""How `make test` splits the machine between its pytest-xdist workers (tests/conftest.py "two lanes")."""
from __future__ import annotations

WORKER_GIB = 10   # memory per worker: a worker process peaked at 10.7 GB (test_engine.py's second vLLM engine)


def auto_num_workers(cores: int, mem_gib: float) -> int:
    """One worker per core while each has WORKER_GIB of memory; at least one (= a plain run)."""
    return max(1, min(cores, int(mem_gib // WORKER_GIB)))


def worker_cores(index: int, count: int, cores: list[int]) -> list[int]:
    """Worker `index` of `count`: every count-th core from its index (disjoint; together all of
    them); more workers than cores share round-robin."""
    return cores[index::count] if count <= len(cores) else [cores[index % len(cores)]]


PORTS_FROM = 10000   # test servers' ports start here (below it: well-known services' ports)


def port_slice(index: int, count: int, ephemeral_lo: int) -> tuple[int, int] | None:
    """Worker `index` of `count`: its own range [lo, hi) of ports for test servers, between
    PORTS_FROM and the kernel's ephemeral range (tests/helpers/launch.free_port); disjoint. None
    where that gap leaves a worker fewer than 100 ports (an ephemeral range reaching down to them)."""
    count = max(1, count)
    width = (ephemeral_lo - PORTS_FROM) // count
    if width < 100:
        return None
    lo = PORTS_FROM + (index % count) * width
    return lo, lo + width
