"""Offline commands: benches, `collab train`, `collab eval` (docs/ARCHITECTURE.md "Rooms")."""
