"""Every ditkit loader lists exactly what it loads (real host, in-process).

Stock ComfyUI lists every file of a model folder with a known extension (``.ckpt``, ``.pt``, ``.bin`` ...) and
follows symlinks (``folder_paths.get_full_path``). ditkit reads only ``.safetensors`` through its safe reader, so a
loader that offered the stock list would offer choices that always fail; a symlink in a model folder is the
user's choice and loads, as with the stock loaders. Per loader, a folder of the kind gets: a symlink to a real tiny
file that lives outside the folder, a pickle-style ``.ckpt``, a dangling symlink, a FIFO. Oracle: the listing of
the node's own schema, and loading the real file by its real path.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from ditkit.errors import CheckpointError

LOADERS = [  # module, node class, input, folder, tiny file
    ("ditkit.nodes.image_loaders", "DitKitZImageLoader", "unet_name", "diffusion_models", "zimage_tiny.safetensors"),
    ("ditkit.nodes.h3_loaders", "DitKitH3ModelLoader", "model_name", "diffusion_models", "h3_tiny_comfy.safetensors"),
    ("ditkit.nodes.dit_loaders", "DitKitLTX2ModelLoader", "unet_name", "diffusion_models", "ltx2_tiny.safetensors"),
    ("ditkit.nodes.dit_loaders", "DitKitFlux2ModelLoader", "unet_name", "diffusion_models", "flux2_tiny.safetensors"),
    ("ditkit.nodes.h3_vae", "DitKitH3VAELoader", "vae_name", "vae", "h3_video_vae_tiny.safetensors"),
    ("ditkit.nodes.lokr", "DitKitLoKrLoader", "lokr_name", "loras", "zimage_lokr_tiny.safetensors"),
    ("ditkit.nodes.adapters", "DitKitAdapterLoader", "adapter_name", "loras", "h3_diffsynth_lora_tiny.safetensors"),
    ("ditkit.nodes.text_encoders", "DitKitH3TextEncoderLoader", "text_encoder", "text_encoders",
     "qwen3vl_tiny_minimax_h3.safetensors"),
    ("ditkit.nodes.text_encoders", "DitKitLTXTextEncoderLoader", "text_encoder", "text_encoders",
     "gemma_tiny_ltx.safetensors"),
]
IDS = [row[1] for row in LOADERS]


@pytest.fixture
def folder(comfy, tiny_ckpts, tmp_path, request):
    """A fresh extra folder of the loader's kind holding the test entries (unregistered afterwards)."""
    import folder_paths

    module, cls, inp, kind, tiny = request.param
    d = tmp_path / kind
    d.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    real = outside / f"real_{tiny}"
    shutil.copyfile(tiny_ckpts / kind / tiny, real)
    (d / "zz_link.safetensors").symlink_to(real)
    (d / "zz_pickle.ckpt").write_bytes(b"\x80\x04\x95" + b"\x00" * 64)
    (d / "zz_weights.bin").write_bytes(b"\x00" * 64)
    (d / "zz_dangling.safetensors").symlink_to(outside / "gone.safetensors")
    os.mkfifo(d / "zz_fifo.safetensors")
    folder_paths.add_model_folder_path(kind, str(d))
    folder_paths.add_model_folder_path(kind, str(tiny_ckpts / kind))
    try:
        yield request.param, d, real
    finally:
        paths = folder_paths.folder_names_and_paths[kind][0]
        if str(d) in paths:
            paths.remove(str(d))
        folder_paths.filename_list_cache.pop(kind, None)


def _node(module, cls):
    import importlib

    return getattr(importlib.import_module(module), cls)


def _options(node, inp):
    for i in node.define_schema().inputs:
        if i.id == inp:
            return list(i.options)
    raise AssertionError(f"no input {inp}")


@pytest.mark.parametrize("folder", LOADERS, ids=IDS, indirect=True)
def test_listing_offers_only_loadable_files(folder):
    (module, cls, inp, kind, tiny), d, real = folder
    opts = _options(_node(module, cls), inp)
    assert "zz_link.safetensors" in opts and tiny in opts, opts
    for bad in ("zz_pickle.ckpt", "zz_weights.bin", "zz_dangling.safetensors", "zz_fifo.safetensors"):
        assert bad not in opts, (bad, opts)


@pytest.mark.parametrize("folder", LOADERS, ids=IDS, indirect=True)
def test_unlisted_entries_are_refused_by_name_before_reading(folder):
    from ditkit.nodes import _files

    (module, cls, inp, kind, tiny), d, real = folder
    assert _files.safetensors_path(kind, "zz_link.safetensors", cls) == os.path.realpath(real)
    for bad, why in (("zz_pickle.ckpt", "only .safetensors"), ("zz_dangling.safetensors", "not a checkpoint file"),
                     ("zz_fifo.safetensors", "not a checkpoint file"), ("../outside/" + real.name, "'..'"),
                     (str(real), "absolute")):
        with pytest.raises(CheckpointError, match=why):
            _files.safetensors_path(kind, bad, cls)


def _load(module, cls, inp, name, tiny_ckpts):
    import types

    node = _node(module, cls)
    had = node.__dict__.get("hidden", None)
    node.hidden = types.SimpleNamespace(unique_id=None)  # as ComfyUI sets it when it executes the node
    try:
        if cls == "DitKitLoKrLoader":
            from ditkit.nodes.image_loaders import load_zimage

            model, _, _ = load_zimage(str(tiny_ckpts / "diffusion_models" / "zimage_tiny.safetensors"))
            return node.execute(model, name, 1.0)
        if cls == "DitKitAdapterLoader":
            import comfy.sd

            model = comfy.sd.load_diffusion_model(str(tiny_ckpts / "diffusion_models" / "h3_tiny_comfy.safetensors"))
            return node.execute(model, name, 1.0)
        return node.execute(**{inp: name})
    finally:
        node.hidden = had


def _tensors(cls, out, path) -> dict:
    """What the loader produced, as tensors: the model / VAE / text-encoder weights, or for LoKr the patched
    weights of every key it patched (computed through ComfyUI's own patch path)."""
    first = out.args[0]
    if cls in ("DitKitLoKrLoader", "DitKitAdapterLoader"):
        return {k: first.patch_weight_to_device(k, device_to=torch.device("cpu"), return_weight=True).clone()
                for k in sorted(first.patches)}
    if type(first).__name__ == "CLIP":  # only what came from the file (modules the file lacks stay uninitialised)
        from ditkit.loaders.safetensors_io import read_header

        from_file = set(read_header(path).keys())
        sd = first.cond_stage_model.state_dict()
        return {k: v for k, v in sd.items()
                if any(".".join(k.split(".")[i:]) in from_file for i in range(len(k.split("."))))}
    if hasattr(first, "first_stage_model"):  # comfy.sd.VAE
        return first.first_stage_model.state_dict()
    return first.model.state_dict()  # ModelPatcher


@pytest.mark.parametrize("folder", LOADERS, ids=IDS, indirect=True)
def test_symlinked_file_loads_like_the_real_file(folder, tiny_ckpts):
    (module, cls, inp, kind, tiny), d, real = folder
    sa = _tensors(cls, _load(module, cls, inp, "zz_link.safetensors", tiny_ckpts), real)
    sb = _tensors(cls, _load(module, cls, inp, tiny, tiny_ckpts), tiny_ckpts / kind / tiny)
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# A loader lists only files of the family it loads, decided from the header (tensor names), not the file name.
# Oracle: which tiny generator wrote each file (ditkit.tiny), i.e. the family by construction.
FAMILY = {  # node -> (folder, files of its family, files of other families)
    "DitKitZImageLoader": ("diffusion_models", {"zimage_tiny.safetensors"},
                           {"flux2_tiny.safetensors", "ltx2_tiny.safetensors", "h3_tiny_comfy.safetensors"}),
    "DitKitH3ModelLoader": ("diffusion_models", {"h3_tiny_comfy.safetensors", "h3_tiny_curve.safetensors",
                                                 "h3_tiny_fasth3.safetensors", "h3_tiny_official", "h3_tiny_diffusers"},
                            {"flux2_tiny.safetensors", "ltx2_tiny.safetensors", "zimage_tiny.safetensors"}),
    "DitKitLTX2ModelLoader": ("diffusion_models", {"ltx2_tiny.safetensors"},
                              {"flux2_tiny.safetensors", "zimage_tiny.safetensors", "h3_tiny_comfy.safetensors"}),
    "DitKitFlux2ModelLoader": ("diffusion_models", {"flux2_tiny.safetensors"},
                               {"ltx2_tiny.safetensors", "zimage_tiny.safetensors", "h3_tiny_comfy.safetensors"}),
    "DitKitH3VAELoader": ("vae", {"h3_video_vae_tiny.safetensors", "h3_image_vae_tiny.safetensors",
                                  "h3_audio_vae_tiny.safetensors"},
                          {"zimage_vae_tiny.safetensors", "flux2_vae_tiny.safetensors",
                           "ltx2_video_vae_tiny.safetensors"}),
    "DitKitLoKrLoader": ("loras", {"zimage_lokr_tiny.safetensors", "flux2_lokr_tiny.safetensors"}, set()),
    "DitKitH3TextEncoderLoader": ("text_encoders", {"qwen3vl_tiny_minimax_h3.safetensors"},
                                  {"gemma_tiny_ltx.safetensors"}),
    "DitKitLTXTextEncoderLoader": ("text_encoders", {"gemma_tiny_ltx.safetensors"},
                                   {"qwen3vl_tiny_minimax_h3.safetensors"}),
}
# the file of another family copied in under a name that looks right (None: a diffusion model)
WRONG = {"DitKitZImageLoader": ("diffusion_models", "ltx2_tiny.safetensors"),
         "DitKitH3TextEncoderLoader": ("text_encoders", "gemma_tiny_ltx.safetensors"),
         "DitKitLTXTextEncoderLoader": ("text_encoders", "qwen3vl_tiny_minimax_h3.safetensors")}
MODULES = {row[1]: (row[0], row[2]) for row in LOADERS}


@pytest.mark.parametrize("cls", sorted(FAMILY))
def test_listing_offers_only_the_loaders_family(comfy, tiny_ckpts, tmp_path, cls):
    import folder_paths

    kind, ours, others = FAMILY[cls]
    d = tmp_path / kind
    d.mkdir()
    # a file of another family under a name that looks right, and one of the right family under a neutral name
    wrong_kind, wrong = WRONG.get(cls, ("diffusion_models", "zimage_tiny.safetensors"))
    shutil.copyfile(tiny_ckpts / wrong_kind / wrong, d / "zz_looks_like_ours.safetensors")
    (d / "zz_unreadable_header.safetensors").write_bytes(b"\xff" * 64)
    if kind == "text_encoders":
        # a sharded folder whose single shard holds a whole file of the family: the text-encoder loaders read
        # single files only, so neither the shard nor the folder is a choice
        sh = d / "zz_sharded"
        sh.mkdir()
        shutil.copyfile(tiny_ckpts / kind / sorted(ours)[0], sh / "model-00001-of-00001.safetensors")
        (sh / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    folder_paths.add_model_folder_path(kind, str(tiny_ckpts / kind))
    folder_paths.add_model_folder_path(kind, str(d))
    try:
        module, inp = MODULES[cls]
        opts = set(_options(_node(module, cls), inp))
        assert ours <= opts, (ours - opts, opts)
        assert not (others & opts), others & opts
        assert "zz_looks_like_ours.safetensors" not in opts, opts
        # a header that cannot be read cannot be classified: the list promises the family, so it is not offered;
        # a prompt naming it anyway gets validate_inputs' reason naming the input and the file (issue 29)
        assert "zz_unreadable_header.safetensors" not in opts, opts
        assert not [o for o in opts if "-of-" in o], opts          # shards never appear on their own
        node = _node(module, cls)
        why = node.validate_inputs(**{inp: "zz_unreadable_header.safetensors"})
        assert isinstance(why, str) and f"input '{inp}'" in why and "zz_unreadable_header" in why, why
        assert "header cannot be read" in why, why
        why = node.validate_inputs(**{inp: "zz_looks_like_ours.safetensors"})
        assert isinstance(why, str) and "holds no" in why, why
        assert all(node.validate_inputs(**{inp: o}) is True for o in sorted(ours & opts)), ours
        assert node.validate_inputs() is True                      # a missing input: the host names it
    finally:
        paths = folder_paths.folder_names_and_paths[kind][0]
        if str(d) in paths:
            paths.remove(str(d))
        folder_paths.filename_list_cache.pop(kind, None)
