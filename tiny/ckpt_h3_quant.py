"""Tiny H3 repacks in the quantized formats users download (issue #30): the Comfy-Org key set and markers
(``tiny/ckpt_h3.comfy_quant_state_dict``) quantized by the host's own layout classes.

* ``h3_dit_int8_convrot``: ``diffusion_models/h3_tiny_int8_convrot.safetensors``, the unpruned repack
  (``minimax_h3_{fl2va,ref2va}_int8_convrot``): every block linear and the full-width AdaLN int8 per-channel with
  ConvRot (the largest power-of-4 group <= 256 / 64 that divides the tiny width);
* ``h3_dit_mxfp8``: ``diffusion_models/h3_tiny_mxfp8.safetensors``;
* ``h3_dit_nvfp4``: ``diffusion_models/h3_tiny_nvfp4.safetensors`` (the community nvfp4 files' layout:
  ``weight`` uint8, ``weight_scale`` e4m3 blocks, ``weight_scale_2``).

The quantizer is comfy_kitchen's (``TensorWiseINT8Layout`` / ``TensorCoreMXFP8Layout`` / ``TensorCoreNVFP4Layout``,
the classes ComfyUI's ``comfy.quant_ops`` registers; ``scale="recalculate"``, no stochastic rounding), so no scale
here is ditkit's: ``tests/integration/test_tiny_repacks_host.py`` checks every file equals the host's own
``comfy.quant_ops`` quantize of the same weights byte for byte. comfy_kitchen ships with ComfyUI, not with ditkit:
without it these generators write nothing and print one line on stderr saying so.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from . import ckpt_h3 as h3
from .checkpoints import register, write_one

LAYOUT_CLASSES = {"int8_convrot": "TensorWiseINT8Layout", "mxfp8": "TensorCoreMXFP8Layout",
                  "nvfp4": "TensorCoreNVFP4Layout"}
FILES = {"int8_convrot": "diffusion_models/h3_tiny_int8_convrot.safetensors",
         "mxfp8": "diffusion_models/h3_tiny_mxfp8.safetensors",
         "nvfp4": "diffusion_models/h3_tiny_nvfp4.safetensors"}


def kitchen_layout_quantize(w: torch.Tensor, fmt: str, group: int = 0) -> dict[str, torch.Tensor]:
    """One layer through comfy_kitchen's layout quantize -> ``{suffix: tensor}`` as ComfyUI's state dict writes
    them (``""``, ``"_scale"``, ``"_scale_2"``): the ``quantize`` callable of ``ckpt_h3.comfy_quant_state_dict``.
    Raises ImportError without comfy_kitchen, ValueError for a format not in :data:`LAYOUT_CLASSES`."""
    if fmt not in LAYOUT_CLASSES:
        raise ValueError(f"{fmt!r} is not one of {sorted(LAYOUT_CLASSES)}")
    import comfy_kitchen.tensor as ckt

    cls = getattr(ckt, LAYOUT_CLASSES[fmt])
    kw = dict(per_channel=True, convrot=True, convrot_groupsize=group) if fmt == "int8_convrot" else {}
    qd, params = cls.quantize(w.clone(), scale="recalculate", **kw)
    return {k: v.contiguous() for k, v in cls.state_dict_tensors(qd, params).items()}


def repack_state_dict(fmt: str) -> dict[str, torch.Tensor]:
    """The tiny H3 (``ckpt_h3.base_state_dict``) as a Comfy-Org style ``fmt`` repack."""
    return h3.comfy_quant_state_dict(h3.base_state_dict(), fmt, kitchen_layout_quantize)


def _gen(fmt: str):
    def gen(out: Path) -> list[Path]:
        try:
            sd = repack_state_dict(fmt)
        except ImportError as e:
            print(f"h3_dit_{fmt}: {FILES[fmt]} not written: comfy_kitchen (ComfyUI's quantizer) is not importable "
                  f"({e})", file=sys.stderr)
            return []
        return write_one(out, FILES[fmt], sd)

    gen.__name__ = f"gen_h3_dit_{fmt}"
    return gen


for _fmt in FILES:
    register(f"h3_dit_{_fmt}")(_gen(_fmt))
