"""ditkit vae (plain torch; no ComfyUI imports)."""
