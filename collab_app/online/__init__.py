"""Engines, store and trainer service glued together: how a rating becomes a gradient (DESIGN §2)."""
