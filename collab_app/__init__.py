"""collab: a team of LLM agents that co-writes / co-codes with a person and learns online (MAGRPO)."""
__version__ = "0.1.0"
