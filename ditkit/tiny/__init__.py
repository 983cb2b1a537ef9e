"""Deterministic tiny checkpoints with the real key names and layouts (the runner and the tests generate them)."""
