"""Host layer: everything that knows ComfyUI's objects, private methods and calling conventions.

``nodes/`` (the V3 node classes) and ``bridge/`` (what those nodes install or call on ComfyUI's objects) are the
only places that import ComfyUI or touch its internals; the core (``loaders/``, ``kernels/``, ``cache/``,
``vae/``, ``offload/``, ``sampling/``) is plain torch and is handed plain tensors, numbers and callables.
``tests/unit/test_layering.py`` checks both the imports and the host attribute names.

* ``models.py``       which model family a ComfyUI MODEL holds (H3 / LTX-2 / Z-Image / FLUX.2)
* ``fingerprint.py``  identity of a MODEL's weights and weight patches (TeaCache files, AdaLN table signature)
* ``vae.py``          the H3 video VAE's decode steps as the core's ``H3VaeOps``
* ``blocks.py``       TeaCache block replaces, per-family block adapters, the DIFFUSION_MODEL wrapper
* ``teacache.py``     TeaCache/calibration per-run state: sample wrappers, coefficient files in the output folder
* ``adaln.py``        H3 AdaLN schedule cache: per-run state holder and its wrappers
* ``attention.py``    the optimized_attention_override protocol for VSA-H3, its per-run holder, FastH3 gate replaces
* ``hostcompat.py``   host changes after 0.33 detected by feature (args["attention"], core's BlockSparseAttention,
                      published layout, stock gates, attention choice, malloc graph, VAE / patcher keywords, the
                      host's tiled decode and T=1 path), each a host-contract entry (docs/compat.md)
* ``quant_scales.py`` while ComfyUI builds a model from a quantized state dict: its layers keep the state dict's
                      block scales (ComfyUI's nn.Parameter would hold a clone of each; docs/quantize.md "Peak RSS")

Modules here import ComfyUI lazily (inside functions) where the unit tests use them without a host.
"""

if "." not in __name__:  # the checkout's root is on sys.path: never shadow ComfyUI's `nodes` & co.
    raise ImportError(f"{__name__!r} is a subpackage of ditkit, not a top-level module: import ditkit.{__name__} "
                      "(remove the ditkit checkout's own folder from sys.path / PYTHONPATH)")
