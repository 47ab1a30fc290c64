"""Launch the real app in this process on a free local port."""
from __future__ import annotations

import socket


def free_port() -> int:
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
