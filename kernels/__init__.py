"""ditkit kernels (plain torch; no ComfyUI imports)."""
