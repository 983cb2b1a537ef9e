"""bridge/preflight.conditioning_rows / packed_rows without a host: CONDITIONING items ``[cross_attn, {...}]`` and the
sampler's converted dicts, the longest entry wins, errors name the source. Counts written out from ComfyUI 0.33's
PackedLayout (comfy/ldm/minimax/model.py): ref frame rows (h // 2) * (w // 2), audio two rows per latent frame,
keyframes on the target grid ceil(H/2) * ceil(W/2)."""
from __future__ import annotations

import pytest
import torch

from ditkit.bridge.preflight import conditioning_rows, packed_rows
from ditkit.memory.model import MemoryModelError

VIDEO = (1, 24, 7, 15, 16)            # target grid 8 x 8 = 64 rows per frame (15 padded to 16)


def test_counts_items_and_dicts():
    refs = [{"kind": "image", "latent_h": 8, "latent_w": 12}, {"kind": "audio", "ref_audio_t": 7},
            {"kind": "video", "latent_t": 2, "latent_h": 5, "latent_w": 6, "ref_audio_t": 0}]
    kfs = [{"latent": torch.zeros(1, 24, 2, 15, 16)[:, :, :, ::1], "audio_latent": torch.zeros(1, 32, 2, 3)},
           {"latent": None, "audio_latent": torch.zeros(1, 32, 2, 4).transpose(1, 2)}]
    item = [torch.zeros(1, 13, 8), {"minimax_refs": refs, "minimax_keyframes": kfs}]
    want = (13, 24 + 14 + 2 * 2 * 3, 2 * 64 + 6 + 8)
    assert packed_rows([item], VIDEO, 512) == want
    assert packed_rows([{"cross_attn": item[0], **item[1]}], VIDEO, 512) == want
    assert conditioning_rows([item], VIDEO, 512) == want


def test_longest_entry_wins_and_defaults():
    short = [torch.zeros(1, 300, 8), {}]
    longer = [torch.zeros(1, 10, 8), {"minimax_refs": [{"kind": "audio", "ref_audio_t": 146}]}]   # 10 + 292 = 302
    assert packed_rows([short, longer], VIDEO, 0) == (10, 292, 0)
    tie = [torch.zeros(1, 10, 8), {"minimax_refs": [{"kind": "audio", "ref_audio_t": 145}]}]     # 300: first kept
    assert packed_rows([short, tie], VIDEO, 0) == (300, 0, 0)
    assert packed_rows([], VIDEO, 77) == (77, 0, 0)
    assert packed_rows(None, VIDEO, 77) == (77, 0, 0)
    assert packed_rows([[None, {}]], VIDEO, 77) == (77, 0, 0)            # no cross_attn: the default text rows


@pytest.mark.parametrize("bad", [["x"], [[torch.zeros(1, 2, 8)]], [[torch.zeros(1, 2, 8), {"minimax_refs": {}}]],
                                 [[None, {"minimax_keyframes": [{"latent": torch.zeros(3, 4)}]}]],
                                 [[None, {"minimax_keyframes": [{"audio_latent": torch.tensor(3.0)}]}]],
                                 [[None, {"minimax_refs": [{"kind": "image", "latent_h": 1.0, "latent_w": 8}]}]]])
def test_bad_conditioning_names_the_source(bad):
    with pytest.raises(MemoryModelError, match=r"^DitKitPreflight: the sampler's conditioning: "):
        conditioning_rows(bad, VIDEO, 0, "the sampler's conditioning")
