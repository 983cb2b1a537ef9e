"""ditkit cache (plain torch; no ComfyUI imports)."""
