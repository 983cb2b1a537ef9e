"""ditkit — a ComfyUI node pack for MiniMax H3, LTX-2/2.5, Z-Image and FLUX.2.

ComfyUI imports this folder under whatever name it was cloned to; every import inside the pack is
relative. After ``pip install -e .`` the same folder imports as the package ``ditkit`` (tests, CLI).

Importing this module never imports ComfyUI: the node classes are built only when ComfyUI calls
:func:`comfy_entrypoint`, so ``import ditkit`` works in plain Python.
"""
__version__ = "0.1.0"

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """ComfyUI V3 entry point: returns the extension that lists every ditkit node."""
    from .nodes import DitKitExtension

    return DitKitExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint", "__version__"]
