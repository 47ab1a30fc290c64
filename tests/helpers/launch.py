"""Launch the real app in this process on a free local port."""
from __future__ import annotations

import os
import random
import socket

from helpers.lanes import port_slice

_RNG = random.Random()   # its own: a test that seeds `random` gets the same draws whether or not it starts a server


def _ephemeral_range() -> tuple[int, int] | None:
    """The kernel's range for clients' source ports (Linux), or None where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return None


def free_port() -> int:
    """A loopback port for a test's server, free now. Why not just bind port 0: the kernel then
    hands out a port from its ephemeral range, where every client connection also takes its source
    port, so between this call and the server's bind (a vLLM server binds ~20-35 s later) another
    test's connection, or the other pytest-xdist worker's free_port, could take it. So the port
    comes from below the ephemeral range (no connection is given one there) and from this worker's
    own slice of it (tests/helpers/lanes.port_slice); bind port 0 only where neither can be had."""
    eph = _ephemeral_range()
    if eph is not None:
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
        ports = port_slice(index, count, eph[0])
        for port in _RNG.sample(range(*ports), 64) if ports else ():
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(home, num_generations: int = 2, max_new_tokens: int = 24, admin_token: str | None = None,
              torch_threads: int | None = 1, wrap_engine=None, model: str | None = None, **ctx_fields):
    """Build the real context (engine, store under `home`) and launch the app in this process.
    Returns (demo, url, ctx); `demo.close()` stops it. One torch thread by default: the server,
    the test client (and a browser) share the 2 cores; see tests/web/conftest.py::engine.
    `wrap_engine(engine)` replaces the engine the app generates with (tests/e2e/test_browser.py holds
    a stream there); `model`: the base (default the embedded model; tests of plumbing, not of text,
    pass the tiny model, tests/helpers/tiny_model.py); `ctx_fields` set AppContext fields (limits)."""
    from collab_app.web.context import build_context
    from collab_app.web.ui import launch

    if torch_threads:
        import torch
        torch.set_num_threads(torch_threads)
    ctx = build_context(model=model, engine="transformers", store_url=f"sqlite:///{home}/store.db",
                        task_names=("humaneval", "tldr"), num_generations=num_generations,
                        max_new_tokens=max_new_tokens, home=str(home))
    ctx.admin_token = admin_token
    for k, v in ctx_fields.items():
        setattr(ctx, k, v)
    if wrap_engine is not None:
        ctx.engine = wrap_engine(ctx.engine)
    demo = launch(ctx, server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    return demo, demo.local_url, ctx
