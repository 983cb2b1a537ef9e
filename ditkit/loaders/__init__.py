"""Checkpoint readers and model-layout converters (plain torch; no ComfyUI imports)."""
