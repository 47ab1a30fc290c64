"""Hugging Face Spaces entry (README front matter `app_file: app.py`; docs/SPACES.md).

The same as `collab serve` (engine + Gradio app + trainer service + adapter hot-swap) on the
address a Space serves (0.0.0.0:7860). More flags via env COLLAB_SERVE_ARGS, e.g.
"--engine vllm --trainer off". Data goes to COLLAB_HOME (set it to /data on a Space with
persistent storage). The __main__ guard matters: vLLM starts its engine with `spawn`.

Admin actions need the secret COLLAB_ADMIN_TOKEN (a strong one: `collab serve` refuses a weak
one at start); never add `--loopback-admin` to a hosted app: where a proxy in front of it runs on
the same machine, every visitor looks local. A person's own coding problem is
offered only where the sandbox has strong isolation (or COLLAB_SANDBOX_ALLOW_WEAK=1).
"""
import os
import shlex
import sys

from collab_app.web.serve import cli_main

if __name__ == "__main__":
    if os.environ.get("COLLAB_HOME"):   # a Space's /data: what the machine measured survives a restart there too
        os.environ.setdefault("COLLAB_MACHINE_DIR", os.path.join(os.environ["COLLAB_HOME"], "machine"))
    argv = ["--host", os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"), "--port", os.environ.get("PORT", "7860")]
    sys.exit(cli_main(argv + shlex.split(os.environ.get("COLLAB_SERVE_ARGS", ""))))
