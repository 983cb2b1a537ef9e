"""In-process ComfyUI harness for the TeaCache benchmark and host tests (CPU, tiny checkpoints).

Loads a DiT through ComfyUI's own loaders, builds synthetic "prompts" (seeded random text states of the
model's context width; the tiny models have no matching text encoder) and empty latents with the stock
nodes, samples with ComfyUI's sampler stack (``comfy.sample.sample`` via ``nodes.common_ksampler``) and
counts block evaluations with forward pre-hooks on the block modules (a skipped stack calls no block).
"""
from __future__ import annotations

import os
import sys

import torch

FAMILY_FILES = {"h3": "h3_tiny_comfy.safetensors", "ltx2": "ltx2_tiny.safetensors",
                "zimage": "zimage_tiny.safetensors", "flux2": "flux2_tiny.safetensors"}


def import_comfy(comfyui_path: str):
    if comfyui_path not in sys.path:
        sys.path.insert(0, comfyui_path)
    from comfy.cli_args import args

    args.cpu = True
    import comfy.model_management  # noqa: F401
    import comfy.sd  # noqa: F401
    import comfy.utils

    comfy.utils.PROGRESS_BAR_ENABLED = False


def load_model(family: str, ckpt_dir: str):
    import comfy.sd

    path = os.path.join(ckpt_dir, "diffusion_models", FAMILY_FILES[family])
    if family == "zimage":
        from ditkit.nodes.image_loaders import load_zimage

        return load_zimage(path)[0]
    return comfy.sd.load_diffusion_model(path)


def blocks_of(model):
    dm = model.model.diffusion_model
    for name in ("blocks", "transformer_blocks", "layers"):
        if hasattr(dm, name) and isinstance(getattr(dm, name), torch.nn.ModuleList):
            return list(getattr(dm, name))
    return list(dm.double_blocks) + list(dm.single_blocks)


class BlockCounter:
    def __init__(self, model):
        self.n = 0
        self.handles = [b.register_forward_pre_hook(self._hook) for b in blocks_of(model)]
        self.per_stack = len(self.handles)

    def _hook(self, mod, inp):
        self.n += 1

    def close(self):
        for h in self.handles:
            h.remove()


def context_width(model, family: str) -> int:
    dm = model.model.diffusion_model
    if family == "h3":
        return dm.condition_proj.weight.shape[1]
    if family == "ltx2":
        return dm.caption_channels
    if family == "zimage":
        return dm.cap_embedder[-1].weight.shape[1]
    return dm.txt_in.weight.shape[1]


def make_inputs(model, family: str, prompt_seed: int, text_len: int = 8, size: str = "tiny"):
    """(positive, negative, latent dict) for one synthetic prompt."""
    g = torch.Generator().manual_seed(10_000 + prompt_seed)
    w = context_width(model, family)
    pos = [[torch.randn(1, text_len, w, generator=g), {}]]
    neg = [[torch.randn(1, text_len, w, generator=g) * 0.5, {}]]
    if family == "h3":
        from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

        lat = EmptyMiniMaxH3LatentAV.execute(width=256, height=256, length=22).result[0]
    elif family == "ltx2":
        from comfy_extras.nodes_lt import EmptyLTXVLatentVideo, LTXVConcatAVLatent

        v = EmptyLTXVLatentVideo.execute(width=256, height=256, length=9, batch_size=1).result[0]
        a = {"samples": torch.zeros(1, 8, 10, 16), "type": "audio"}  # 8 ch x 16 mel bins, 10 latent frames
        lat = LTXVConcatAVLatent.execute(video_latent=v, audio_latent=a).result[0]
    elif family == "zimage":
        lat = {"samples": torch.zeros(1, 16, 16, 16)}
    else:
        lat = {"samples": torch.zeros(1, 128, 8, 8)}
    return pos, neg, lat


def sample(model, pos, neg, latent, steps: int, cfg: float = 1.0, sampler: str = "euler",
           scheduler: str = "simple", seed: int = 0):
    import nodes

    out = nodes.common_ksampler(model, seed, steps, cfg, sampler, scheduler, pos, neg, latent, denoise=1.0)[0]
    s = out["samples"]
    if getattr(s, "is_nested", False):
        return [t.clone() for t in s.unbind()]
    return [s.clone()]
