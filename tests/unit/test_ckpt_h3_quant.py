"""``tiny/ckpt_h3_quant``: the tiny int8 ConvRot / mxfp8 / nvfp4 H3 repacks are registered, deterministic and carry
the Comfy-Org key set and markers (every quantized layer: ``weight``, ``weight_scale`` (nvfp4 also
``weight_scale_2``), ``comfy_quant``). That the scales are the host's own is checked in the host
(``tests/integration/test_tiny_repacks_host.py``)."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from ditkit.tiny import ckpt_h3 as h3
from ditkit.tiny import ckpt_h3_quant as q
from ditkit.tiny.checkpoints import GENERATORS, generate_all

pytest.importorskip("comfy_kitchen")
NAMES = [f"h3_dit_{f}" for f in q.FILES]


def test_registered_and_byte_identical(tmp_path):
    a = generate_all(tmp_path / "a", only=NAMES)
    b = generate_all(tmp_path / "b", only=NAMES)
    assert set(NAMES) <= set(GENERATORS) and sorted(a) == sorted(NAMES)
    for n in NAMES:
        (pa,), (pb,) = a[n], b[n]
        assert pa.relative_to(tmp_path / "a") == pb.relative_to(tmp_path / "b")
        assert str(pa.relative_to(tmp_path / "a")) == q.FILES[n[len("h3_dit_"):]]
        assert hashlib.sha256(pa.read_bytes()).digest() == hashlib.sha256(pb.read_bytes()).digest()


@pytest.mark.parametrize("fmt", list(q.FILES))
def test_comfy_org_key_set_and_markers(fmt):
    sd = q.repack_state_dict(fmt)
    base = h3.base_state_dict()
    layers = h3.quantized_layer_keys(base)
    assert layers and any("adaln_proj" in k for k in layers)          # unpruned: the full-width AdaLN too
    for k in layers:
        p = k[: -len("weight")]
        conf = json.loads(bytes(sd[p + "comfy_quant"].tolist()).decode())
        rows, cols = base[k].shape
        if fmt == "int8_convrot":
            g = conf["convrot_groupsize"]
            assert conf["format"] == "int8_tensorwise" and conf["convrot"] is True
            assert cols % g == 0 and g in (16, 64, 256) and (g <= 64 or "adaln" not in k)
            assert sd[k].dtype == torch.int8 and tuple(sd[k].shape) == (rows, cols)
            assert sd[p + "weight_scale"].dtype == torch.float32 and sd[p + "weight_scale"].numel() == rows
        elif fmt == "mxfp8":
            assert conf == {"format": "mxfp8"} and sd[k].dtype == torch.float8_e4m3fn
        else:
            assert conf == {"format": "nvfp4"} and sd[k].dtype == torch.uint8 and sd[k].shape[1] == cols // 2
            assert sd[p + "weight_scale"].dtype == torch.float8_e4m3fn and sd[p + "weight_scale_2"].numel() == 1
    untouched = [k for k in base if k not in layers]
    assert all(torch.equal(sd[k], base[k]) for k in untouched)


def test_kitchen_layout_quantize_refuses_other_formats():
    w = torch.randn(128, 64)
    assert set(q.kitchen_layout_quantize(w, "nvfp4")) == {"", "_scale", "_scale_2"}
    assert set(q.kitchen_layout_quantize(w, "int8_convrot", 16)) == {"", "_scale"}
    with pytest.raises(ValueError, match="'float8_e4m3fn' is not one of"):
        q.kitchen_layout_quantize(w, "float8_e4m3fn")


def test_without_comfy_kitchen_nothing_is_written(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "comfy_kitchen.tensor", None)   # import fails
    assert GENERATORS["h3_dit_nvfp4"](tmp_path) == []
    assert not list(tmp_path.rglob("*.safetensors"))
    assert "h3_tiny_nvfp4.safetensors not written: comfy_kitchen" in capsys.readouterr().err
