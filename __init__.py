"""ComfyUI entry point of the ditkit pack.

ComfyUI imports this folder under whatever name it was cloned to; the package itself is the inner folder
``ditkit/`` (imported here relatively, so any folder name works). After ``pip install -e .`` the same inner
folder imports as ``ditkit`` (CLI, tests). Keeping the code one level down means that Python run from this
folder sees only ``ditkit``, ``tests`` and ``benchmarks`` as top-level names, never ``nodes`` (ComfyUI's own
module name), ``kernels`` or ``cache``.

Importing this module never imports ComfyUI: the node classes are built only when ComfyUI calls
:func:`comfy_entrypoint`.
"""
WEB_DIRECTORY = "./web"

if __package__:  # ComfyUI (and any package import) always gives the folder a package name
    from .ditkit import __version__, comfy_entrypoint

    __all__ = ["WEB_DIRECTORY", "comfy_entrypoint", "__version__"]
else:
    # pytest collects this folder as a Python package and imports this file for its setup; under a folder name
    # that is not an identifier (``ComfyUI-ditkit``, the usual name of a cloned pack) it imports it as a lone
    # module, where a relative import cannot work and every test would error at setup. There is nothing to
    # export there: the tests import the inner package ``ditkit`` themselves.
    __all__ = ["WEB_DIRECTORY"]
