"""Models for the in-process host tests: a folder of tiny checkpoints made visible to ComfyUI's ``folder_paths`` for
the duration of a fixture, and the tiny H3 loaded through ditkit's own loader node."""
from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def model_folder(kind: str, root: str | os.PathLike):
    """``root`` listed as a ``kind`` folder (e.g. ``diffusion_models``) while the block runs, removed after (only
    that entry: other folders of the kind are left as they are)."""
    import folder_paths

    root = str(root)
    folder_paths.add_model_folder_path(kind, root)
    try:
        yield root
    finally:
        paths = folder_paths.folder_names_and_paths[kind][0]
        if root in paths:
            paths.remove(root)


def load_h3(name: str):
    """The MODEL of ``DitKitH3ModelLoader`` for the file ``name`` of a listed ``diffusion_models`` folder."""
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader

    return DitKitH3ModelLoader.execute(model_name=name).args[0]
