"""ditkit — a ComfyUI node pack for MiniMax H3, LTX-2/2.5, Z-Image and FLUX.2.

The repository root is the package (the design card's layout: ``nodes/``, ``kernels/``, ``vae/``, ``loaders/``,
``offload/``, ``web/`` at the top). ComfyUI loads this folder under whatever name it was cloned to; after
``pip install -e .`` it imports as ``ditkit`` (``package-dir = {ditkit = "."}``: the only name installed). Every
import inside the package is relative, and every subpackage refuses to be imported as a top-level module
(the two lines after each docstring), so ``nodes`` (ComfyUI's own module), ``kernels`` or ``vae`` can never shadow or be
shadowed, whichever folder Python is started from.

Importing this module never imports ComfyUI or torch: the node classes are built only when ComfyUI calls
:func:`comfy_entrypoint`, so ``import ditkit`` works in plain Python.
"""
__version__ = "0.1.0"
WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """ComfyUI V3 entry point: returns the extension that lists every ditkit node."""
    from .nodes import DitKitExtension

    return DitKitExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint", "__version__"]
