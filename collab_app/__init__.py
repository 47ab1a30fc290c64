"""collab: a team of LLM agents that co-writes / co-codes with a person and learns online (MAGRPO).

Importing it sets nothing: the CPU settings a process needs before torch loads are made by the
entry points (collab_app/cpu/process.py)."""

__version__ = "0.1.0"
