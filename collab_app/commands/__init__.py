"""Offline commands: benches, `collab train`, `collab eval` (DESIGN §2)."""
