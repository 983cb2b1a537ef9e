"""ComfyUI's model and output folders (``folder_paths``), as the node modules need them.

The loaders list and resolve model files themselves (``nodes/_files.py``: safetensors only, no name leaving the
folders); which folders a kind has, the stock file list of a kind and the output folder are ComfyUI's own answers,
read here.
"""
from __future__ import annotations


def folder_roots(kind: str) -> list[str]:
    """The folders of model kind ``kind`` ("vae", "diffusion_models", ...), in ComfyUI's order."""
    import folder_paths

    return list(folder_paths.get_folder_paths(kind))


def filename_list(kind: str) -> list[str]:
    """ComfyUI's file list of model kind ``kind`` (names relative to one of its folders)."""
    import folder_paths

    return list(folder_paths.get_filename_list(kind))


def output_directory() -> str:
    """ComfyUI's output folder (``--output-directory``)."""
    import folder_paths

    return folder_paths.get_output_directory()
