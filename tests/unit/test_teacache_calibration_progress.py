"""CalibrationRecorder.on_step: one live-progress call per sampling step, counts equal to the pairs recorded."""
from __future__ import annotations

import torch

from ditkit.cache.calibrate import CalibrationRecorder


def test_on_step_called_once_per_step_with_pair_counts():
    rec = CalibrationRecorder("h3")
    sigmas = [1.0, 0.75, 0.5, 0.25, 0.0]
    rec.begin(sigmas)
    seen = []
    rec.on_step = lambda pairs, step, steps: seen.append((pairs, step, steps))
    g = torch.Generator().manual_seed(0)
    expected_pairs = 0
    for i, sigma in enumerate(sigmas[:-1]):
        for j, key in enumerate(("cond", "uncond")):  # two model calls in one step: one notification, at the first
            mods = {s: [torch.randn(4, generator=g)] for s in ("video", "audio")}
            rec.record_inputs([key], sigma, mods)
            rec.record_outputs({s: [torch.randn(4, generator=g)] for s in ("video", "audio")})
            if i > 0:
                expected_pairs += 2  # one (x, y) pair per stream once a previous call of this key exists
            if j == 0:
                at_first_call = expected_pairs
        assert seen[-1] == (at_first_call, i + 1, len(sigmas) - 1)
    assert [s[1] for s in seen] == [1, 2, 3, 4]
    assert rec.n_pairs() == expected_pairs == 12
    rec.begin(sigmas)  # a new run notifies again from step 1
    rec.record_inputs(["cond"], 1.0, {"video": [torch.ones(4)], "audio": [torch.ones(4)]})
    rec.record_outputs({"video": [torch.ones(4)], "audio": [torch.ones(4)]})
    assert seen[-1] == (0, 1, 4)
