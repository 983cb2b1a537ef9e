"""The registered tiny H3 repacks (``tiny/ckpt_h3_quant``: int8 ConvRot, mxfp8, nvfp4) in the real host: each file
is, byte for byte, the host's own ``comfy.quant_ops`` layout quantize of the tiny H3's layers
(``tests/support/quant_oracle.host_quantize_layer``), and DitKitH3ModelLoader loads it by name with every marked
layer a QuantizedTensor of the format's layout."""
from __future__ import annotations

import pytest
import torch

from ditkit.loaders.safetensors_io import load_file
from ditkit.tiny import ckpt_h3 as c
from ditkit.tiny import ckpt_h3_quant as q
from tests.support.quant_oracle import LAYOUTS, bits, host_quantize_layer


@pytest.mark.parametrize("fmt", list(q.FILES))
def test_registered_repack_is_the_hosts_quantize(comfy, tiny_ckpts, fmt):
    got = load_file(tiny_ckpts / q.FILES[fmt])
    want = c.comfy_quant_state_dict(c.base_state_dict(), fmt, host_quantize_layer)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and tuple(got[k].shape) == tuple(want[k].shape), k
        assert torch.equal(bits(got[k]), bits(want[k])), k


@pytest.mark.parametrize("fmt", list(q.FILES))
def test_h3_loader_loads_the_repack_by_name(comfy, tiny_ckpts, fmt):
    import comfy.utils
    import folder_paths

    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader

    folder_paths.add_model_folder_path("diffusion_models", str(tiny_ckpts / "diffusion_models"), is_default=True)
    name = q.FILES[fmt].split("/", 1)[1]
    m = DitKitH3ModelLoader.execute(model_name=name).args[0]
    layers = c.quantized_layer_keys(c.base_state_dict())
    for k in layers:
        w = comfy.utils.get_attr(m.model, "diffusion_model." + k).data
        assert type(w).__name__ == "QuantizedTensor" and w._layout_cls == LAYOUTS[fmt], k
