"""Which model family a file holds, from its safetensors header only (no tensor is read), for the loader lists:
a loader lists only files of the family it loads (the stock loaders list every file of the folder).

The header is read with ditkit's safe reader (``loaders/safetensors_io.read_header``: the 8-byte length and the
JSON, checked against the file size) and the verdict is cached per (path, size, mtime), so refreshing the node
definitions re-reads only new or changed files. A file whose header cannot be read is not listed (its loader
would refuse it). Families are told apart by tensor names the loaders themselves rely on:

* ``h3_dit``: MiniMax H3 DiT in ditkit's official or ComfyUI names (``audio_patch_proj.*``) or diffusers names
  (``audio_proj_in.*``); LTX-2's ``audio_patchify_proj`` is a different name.
* ``zimage``: NextDiT (``cap_embedder.*``, ``noise_refiner.*``, ``x_embedder.*``).
* ``ltx2``: LTX-2 / LTX-Video (``adaln_single.emb.timestep_embedder.linear_1.bias``, ComfyUI's own marker).
* ``flux2``: FLUX.2 (``double_stream_modulation_img.lin.weight``, ComfyUI's own marker).
* ``h3_vae``: H3 video / image / audio VAEs (``vae/h3_layout.classify_vae_keys``).
* ``lokr``: LoKr factors (``*.lokr_w1``, ``*.lokr_w1_a``, ``*.lokr_w2``, ...; ``loaders/lokr_apply.FACTOR_KEYS``).
* ``h3_te``: the MiniMax H3 Qwen3-VL-32B text encoder: the keys ``DitKitH3TextEncoderLoader`` requires and
  ComfyUI's ``detect_te_model`` keys QWEN3VL_32B on (``visual.deepstack_merger_list.0.norm.weight``,
  ``model.layers.49.self_attn.q_proj.weight``, ``model.embed_tokens.weight``).
* ``ltx_te``: a Gemma decoder (``model.layers.0.post_feedforward_layernorm.weight``, ``model.embed_tokens.weight``)
  that ``DitKitLTXTextEncoderLoader`` builds: a Gemma 4 variant (ComfyUI's ``detect_te_model`` key rules, which
  test key presence only), or a 48-layer Gemma 3 with the ``spiece_model`` tokenizer and the LTX
  ``text_embedding_projection.*`` in the file.

A ``model.diffusion_model.`` prefix (full checkpoints) is ignored. Folders (sharded checkpoints) are listed by the
loader itself, once. The text-encoder loaders read single files only: a shard of an indexed folder is not listed
(:func:`family_files` with ``skip_shards``), and the folder is not either (they cannot load it).
"""
from __future__ import annotations

import os
import re
import threading

from ..loaders.lokr_apply import FACTOR_KEYS
from ..loaders.safetensors_io import read_header
from ..vae.h3_layout import classify_vae_keys

PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_cache: dict[tuple[str, int, int], frozenset[str]] = {}
_lock = threading.Lock()


def _strip(k: str) -> str:
    for p in PREFIXES:
        if k.startswith(p):
            return k[len(p):]
    return k


def header_keys(path: str) -> frozenset[str] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _cache:
            return _cache[key]
    try:
        keys = frozenset(read_header(path).keys())
    except Exception:  # noqa: BLE001 - unreadable header: not listed; check_listed() says why when it is asked for
        return None
    with _lock:
        if len(_cache) > 4096:
            _cache.clear()
        _cache[key] = keys
    return keys


def _gemma_ltx(ks) -> bool:
    """The Gemma files DitKitLTXTextEncoderLoader builds, by key presence (its shape checks come at load)."""
    if not {"model.layers.0.post_feedforward_layernorm.weight", "model.embed_tokens.weight"} <= ks:
        return False
    qn = {i for i in (34, 41, 47, 48, 59) if f"model.layers.{i}.self_attn.q_norm.weight" in ks}
    gemma4 = (59 in qn or (47 in qn and "model.layers.5.self_attn.v_proj.weight" not in ks)
              or (41 in qn and 47 not in qn) or (34 in qn and 41 not in qn))
    gemma3_12b = 47 in qn and 48 not in qn and "spiece_model" in ks and any(
        k.startswith("text_embedding_projection.") for k in ks)
    return gemma4 or gemma3_12b


def family_of_keys(keys) -> set[str]:
    raw = set(keys)
    if {"visual.deepstack_merger_list.0.norm.weight", "model.layers.49.self_attn.q_proj.weight",
            "model.embed_tokens.weight"} <= raw:
        return {"h3_te"}
    if _gemma_ltx(raw):
        return {"ltx_te"}
    ks = {_strip(k) for k in keys}
    tops = {k.split(".", 1)[0] for k in ks}
    out = set()
    if "audio_patch_proj" in tops or "audio_proj_in" in tops:
        out.add("h3_dit")
    if {"cap_embedder", "noise_refiner", "x_embedder"} <= tops:
        out.add("zimage")
    if "adaln_single.emb.timestep_embedder.linear_1.bias" in ks:
        out.add("ltx2")
    if "double_stream_modulation_img.lin.weight" in ks:
        out.add("flux2")
    if classify_vae_keys(ks) in ("h3_video", "h3_audio"):
        out.add("h3_vae")
    if any(k.rsplit(".", 1)[-1] in FACTOR_KEYS for k in ks):
        out.add("lokr")
    return out


def is_family(path: str, family: str) -> bool:
    """Whether the header says ``family``. A file whose header cannot be read is not listed: the list promises
    files of the family, and that cannot be decided; a prompt naming it gets :func:`check_listed`'s reason."""
    keys = header_keys(path)
    return keys is not None and family in family_of_keys(keys)


def check_listed(node_id: str, input_name: str, folder: str, family: str, name, skip_shards: bool = False):
    """A loader's ``validate_inputs``: True when ``name`` is one of :func:`family_files`; else why it is not
    offered, naming the node, the input and the file (an API prompt may name any file; the host then reports this
    line instead of a bare "value not in list"). None (input missing): True, the host reports the missing input."""
    if name is None or name in family_files(folder, family, skip_shards):
        return True
    from ..errors import CheckpointError
    from ..loaders.safetensors_io import read_header
    from . import _files

    head = f"{node_id}: input '{input_name}' {str(name)[:200]!r} is not offered"
    if not isinstance(name, str):
        return f"{head}: not a file name"
    try:
        path = _files.find(folder, name, node_id)
    except CheckpointError as e:
        return f"{head}: {e}"
    if path is None or not _files.is_safetensors_name(name):
        return f"{head}: no such .safetensors file in models/{folder}"
    if skip_shards and is_shard(path):
        return f"{head}: it is a shard of an indexed folder (this loader reads single files)"
    try:
        keys = frozenset(read_header(path).keys())
    except Exception as e:  # noqa: BLE001 - the reason is the message
        return f"{head}: its safetensors header cannot be read ({e})"
    fams = sorted(family_of_keys(keys))
    return f"{head}: its header holds no {family} tensors" + (f" (it looks like {', '.join(fams)})" if fams else "")


_SHARD = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")


def is_shard(path: str) -> bool:
    """``path`` is named like a shard (``*-00001-of-00004.safetensors``) and sits next to a ``*.index.json``."""
    if not _SHARD.search(os.path.basename(path)):
        return False
    try:
        return any(n.endswith(".safetensors.index.json") for n in os.listdir(os.path.dirname(path) or "."))
    except OSError:
        return False


def family_files(folder: str, family: str, skip_shards: bool = False) -> list[str]:
    """``_files.safetensors_files(folder)`` restricted to the files whose header says ``family`` (and, with
    ``skip_shards``, that are not a shard of an indexed folder: a loader that reads single files only)."""
    from ..bridge.files import folder_roots
    from . import _files

    roots = folder_roots(folder)
    out = []
    for name in _files.safetensors_files(folder):
        path = next((os.path.join(r, name) for r in roots if _files.is_regular_file(os.path.join(r, name))), None)
        if path is not None and skip_shards and is_shard(path):
            continue
        if path is not None and is_family(path, family):
            out.append(name)
    return out
