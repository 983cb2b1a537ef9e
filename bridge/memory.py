"""Memory budgets for the pre-flight checks (``vae/preflight.py``), from ComfyUI's memory management: free RAM on
the CPU, the total memory of an accelerator (ComfyUI offloads other models to make room)."""
from __future__ import annotations


def device_budget(device) -> tuple[int, str]:
    """(bytes, wording) a decode/encode may plan to use on ``device``, for the pre-flight memory checks
    (``vae/preflight.py``): the total memory of an accelerator (ComfyUI offloads other models to make room), the
    free RAM on the CPU."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return free_memory(dev), "of RAM free"
    return total_memory(dev), f"of memory on {dev}"


def free_memory(device) -> int:
    """ComfyUI's free memory on ``device`` (bytes)."""
    import comfy.model_management as mm

    return int(mm.get_free_memory(device))


def total_memory(device) -> int:
    """ComfyUI's total memory of ``device`` (bytes)."""
    import comfy.model_management as mm

    return int(mm.get_total_memory(device))


def intermediate_device():
    """Where ComfyUI keeps intermediate results (latents made by nodes)."""
    import comfy.model_management as mm

    return mm.intermediate_device()


def check_memory_split(node: str, input_name: str, shape, device, device_parts: dict, host_parts: dict) -> None:
    """``vae/preflight.check_memory`` against the right budgets: everything against free RAM when ``device`` is the
    CPU; else what lives on the device against its memory and what lives on the host against free RAM."""
    import torch

    from ..vae import preflight

    if torch.device(device).type == "cpu":
        budget, where = device_budget("cpu")
        preflight.check_memory(node, input_name, shape, {**device_parts, **host_parts}, budget, where)
        return
    budget, where = device_budget(device)
    preflight.check_memory(node, input_name, shape, device_parts, budget, where)
    if host_parts:
        budget, where = device_budget("cpu")
        preflight.check_memory(node, input_name, shape, host_parts, budget, where)
