"""Hugging Face Spaces entry (README front matter: `app_file: app.py`; see docs/SPACES.md).

Same app as `collab serve` without the trainer: engine + store from env (COLLAB_HOME, COLLAB_MODEL,
COLLAB_ENGINE, COLLAB_STORE_URL, COLLAB_ADMIN_TOKEN). The __main__ guard matters: vLLM starts
its engine process with `spawn`.
"""
import os

from collab_app.context import build_context, is_public
from collab_app.ui import launch

if __name__ == "__main__":
    host = os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0")   # a Space serves on 0.0.0.0:7860
    ctx = build_context(engine=os.environ.get("COLLAB_ENGINE", "auto"),
                        store_url=os.environ.get("COLLAB_STORE_URL") or None,
                        public=is_public(host, share=False))
    launch(ctx, server_name=host, server_port=int(os.environ.get("PORT", "7860")))
