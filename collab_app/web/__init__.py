"""The Gradio app: UI wiring (ui.py), plain handlers (handlers.py), shared context, `collab serve`
(docs/ARCHITECTURE.md "Rooms")."""
