"""Sampling schedules (plain torch, no ComfyUI): the FastH3 distilled ladders (:mod:`.fasth3`)."""
