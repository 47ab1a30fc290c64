"""The app: access rules (access.py), shared objects (context.py), the core of a round and of
feedback (core.py), its two doors (the page: handlers.py + ui.py; /v1: openai_api.py), `collab
serve` (docs/ARCHITECTURE.md "Rooms")."""
