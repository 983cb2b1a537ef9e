"""ditkit testing (plain torch; no ComfyUI imports)."""
