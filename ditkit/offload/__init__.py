"""ditkit offload (plain torch; no ComfyUI imports)."""
