"""Host layer: what knows ComfyUI's objects, private helpers and calling conventions (the core stays plain torch)."""
