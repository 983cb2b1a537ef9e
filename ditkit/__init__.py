"""ditkit — a ComfyUI node pack for MiniMax H3, LTX-2/2.5, Z-Image and FLUX.2.

This inner folder is the package. ComfyUI loads the repository folder (its ``__init__.py`` imports this package
relatively, under any folder name); after ``pip install -e .`` it imports as ``ditkit`` (tests, CLI). Every
import inside the package is relative.

Importing this module never imports ComfyUI: the node classes are built only when ComfyUI calls
:func:`comfy_entrypoint`, so ``import ditkit`` works in plain Python.
"""
__version__ = "0.1.0"


async def comfy_entrypoint():
    """ComfyUI V3 entry point: returns the extension that lists every ditkit node."""
    from .nodes import DitKitExtension

    return DitKitExtension()


__all__ = ["comfy_entrypoint", "__version__"]
