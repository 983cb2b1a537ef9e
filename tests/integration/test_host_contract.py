"""The host contract in the real ComfyUI 0.33 host (issue #28, Build 2).

* every entry holds on the tested host, and each names real ditkit node ids;
* drift: an unknown change made in-process on the real classes (a private attribute renamed, a signature changed)
  makes ``check_all(refresh=True)`` name exactly that entry; exactly its dependent nodes refuse at execute (through
  the guard every registered class gets) with a message naming the ComfyUI version, the symbol and what differs;
  a node that does not depend on it still runs and gives its correct result;
* ``python -m ditkit.host check --contract --comfyui PATH`` prints the table of that host, probed in its own python.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.support.pack_scan import node_declarations


@pytest.fixture
def contract(comfy):
    from ditkit.bridge import contract as c

    c.reset()
    yield c
    c.reset()   # the next user re-probes the unpatched host


@pytest.fixture
def registered(comfy):
    """The node classes as ComfyUI registers them (guarded: host contract, finite floats), by node id."""
    from ditkit import nodes

    return {cls.GET_SCHEMA().node_id: cls for cls in nodes.discover_nodes()}


def _with_hidden(monkeypatch, cls, uid="7"):
    from comfy_api.latest import io

    monkeypatch.setattr(cls, "hidden", io.HiddenHolder.from_dict({io.Hidden.unique_id: uid}))
    return cls


def test_every_entry_holds_on_the_tested_host(contract):
    table = contract.check_all(refresh=True)
    assert table.host_version == "0.33.0"
    bad = [(r.entry.symbol, r.probe.state, r.probe.note) for r in table.results if r.probe.state != "holds"]
    assert not bad, bad
    from ditkit.bridge import contract_entries

    mine = [e for e in contract.entries() if e.probe.__module__ == contract_entries.__name__]
    assert len(mine) >= 50, len(mine)
    ids = {d.node_id for d in node_declarations()}
    unknown = sorted({n for e in contract.entries() for n in e.nodes} - ids)
    assert not unknown, f"entries name node ids that do not exist: {unknown}"


def test_the_block_mirror_probe_sees_a_different_block(contract, monkeypatch):
    """The behaviour probe compares with the host's block, not with itself: a host block whose body differs (here:
    the MLP residual gated twice) breaks exactly that entry."""
    import comfy.ldm.minimax.model as h3

    real = h3.DiTBlock.forward

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}):
        out = real(self, x, t_emb, mod_segments, rope_freqs, transformer_options)
        return out * 1.0001

    monkeypatch.setattr(h3.DiTBlock, "forward", forward)
    broken = [r for r in contract.check_all(refresh=True).results if r.probe.state == "broken"]
    assert [r.entry.symbol for r in broken] == ["comfy.ldm.minimax.model.DiTBlock"], [r.row() for r in broken]
    assert "differs from ditkit's mirror" in broken[0].probe.note


def test_renamed_private_attribute_refuses_exactly_its_nodes(contract, registered, monkeypatch):
    """comfy_quant's QuantizedTensor keeps its layout under another private name: the LoKr / adapter loaders
    (which rebuild requantized tensors from those parts) refuse, naming it; the H3 empty-latent node still runs."""
    from comfy.quant_ops import QuantizedTensor

    from ditkit.errors import DitKitError

    real_init = QuantizedTensor.__init__

    @functools.wraps(real_init)
    def init(self, qdata, layout_cls, params):
        real_init(self, qdata, layout_cls, params)
        self._layout_name = self.__dict__.pop("_layout_cls")

    monkeypatch.setattr(QuantizedTensor, "__init__", init)
    table = contract.check_all(refresh=True)
    broken = [r for r in table.results if r.probe.state == "broken"]
    # the tensor's own entry and the exact-requantization probe (bridge/quant_requant.py) read the layout: both
    # break, and only the two adapter loaders depend on them
    assert sorted(r.entry.symbol for r in broken) == [
        "comfy.quant_ops.QuantizedTensor",
        "comfy_kitchen.tensor.QuantizedLayout.quantize/dequantize (int8 ConvRot, mxfp8, nvfp4)"], [r.row() for r in broken]
    assert set().union(*(r.entry.nodes for r in broken)) == {"DitKitLoKrLoader", "DitKitAdapterLoader"}

    for node_id in ("DitKitLoKrLoader", "DitKitAdapterLoader"):
        with pytest.raises(DitKitError) as ei:
            registered[node_id].execute()   # refused before any input is looked at
        msg = str(ei.value)
        assert msg.startswith(f"{node_id} cannot run on ComfyUI 0.33.0"), msg
        assert "comfy.quant_ops.QuantizedTensor: QuantizedTensor has no _layout_cls" in msg, msg

    node = _with_hidden(monkeypatch, registered["DitKitH3EmptyImageLatent"])
    out = node.execute(width=64, height=32, batch_size=2, layout="video")
    lat = out.result[0]["samples"]
    assert tuple(lat.shape) == (2, 24, 1, 2, 4) and not lat.any()


def test_changed_signature_refuses_exactly_its_nodes(contract, registered, monkeypatch, tiny_ckpts):
    """load_text_encoder_state_dicts renames a parameter ditkit passes: both text-encoder loaders refuse, naming the
    parameter; the H3 VAE loader (another host builder) still loads its file."""
    import comfy.sd

    from ditkit.errors import DitKitError

    real = comfy.sd.load_text_encoder_state_dicts

    def load_text_encoder_state_dicts(state_dicts=[], embedding_directory=None, te_type=None, model_options={},
                                      disable_dynamic=False):
        return real(state_dicts, embedding_directory, te_type, model_options, disable_dynamic=disable_dynamic)

    monkeypatch.setattr(comfy.sd, "load_text_encoder_state_dicts", load_text_encoder_state_dicts)
    table = contract.check_all(refresh=True)
    broken = [r for r in table.results if r.probe.state == "broken"]
    assert [r.entry.symbol for r in broken] == ["comfy.sd.load_text_encoder_state_dicts"], [r.row() for r in broken]
    assert "['clip_type'] missing" in broken[0].probe.note

    for node_id in ("DitKitH3TextEncoderLoader", "DitKitLTXTextEncoderLoader"):
        with pytest.raises(DitKitError, match=rf"^{node_id} cannot run on ComfyUI 0\.33\.0.*"
                                              r"comfy\.sd\.load_text_encoder_state_dicts: parameters \['clip_type'\]"):
            registered[node_id].execute()

    import folder_paths

    from ditkit.tiny import ckpt_h3_vae as ck

    vae = tiny_ckpts / "vae" / ck.VIDEO_VAE_NAME
    monkeypatch.setattr(folder_paths, "get_folder_paths",
                        lambda kind, _real=folder_paths.get_folder_paths: [str(vae.parent)] if kind == "vae"
                        else _real(kind))
    node = _with_hidden(monkeypatch, registered["DitKitH3VAELoader"])
    out = node.execute(vae_name=vae.name)
    assert type(out.result[0]).__name__ == "VAE"


def test_refusal_happens_before_the_node_runs(contract, registered, monkeypatch):
    """The guard calls require(node_id) first: a refused node never reaches its own code."""
    import ditkit.nodes.h3_vae as nv
    from ditkit.errors import DitKitError

    asked, ran = [], []

    def require(node_id):
        asked.append(node_id)
        raise DitKitError(f"{node_id}: refused")

    monkeypatch.setattr("ditkit.bridge.contract.require", require)
    monkeypatch.setattr(nv, "intermediate_device", lambda: ran.append(1) or torch.device("cpu"))
    cls = _with_hidden(monkeypatch, registered["DitKitH3EmptyImageLatent"])
    with pytest.raises(DitKitError, match="DitKitH3EmptyImageLatent: refused"):
        cls.execute(width=64, height=64, batch_size=1, layout="video")
    assert asked == ["DitKitH3EmptyImageLatent"] and ran == []
    monkeypatch.undo()


def test_cli_prints_the_table_of_the_real_host(comfyui_path, capsys):
    from ditkit import host

    rc = host.main(["check", "--contract", "--comfyui", str(comfyui_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    first = out.splitlines()[0]
    assert first.startswith(f"ditkit host contract on ComfyUI 0.33.0 at {comfyui_path}: ")
    assert " 0 broken" in first
    for symbol in ("comfy.ldm.minimax.model.DiTBlock", "comfy.sd.load_text_encoder_state_dicts",
                   "comfy.quant_ops.QuantizedTensor", "folder_paths"):
        assert any(ln.startswith("holds") and f" {symbol} " in ln for ln in out.splitlines()), symbol
    n = int(first.split(": ")[1].split(" entries")[0])
    assert n == sum(1 for ln in out.splitlines() if ln.split(" ")[0] in ("holds", "adapted", "broken"))
