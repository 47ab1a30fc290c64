"""MAGRPO (arXiv 2508.04652) on per-agent LoRA adapters. Knows nothing of Gradio or the store."""
