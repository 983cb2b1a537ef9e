"""bridge/load_progress.py without a host: the text a quantizing load shows and its throttle (issue #34)."""
from __future__ import annotations

import pytest

from ditkit.bridge import load_progress as LP


def test_progress_text_says_tensors_rate_and_bytes():
    assert LP.progress_text("quantizing to nvfp4", 12, 86, 420_000_000, 4.0) == \
        "quantizing to nvfp4: 12/86 tensors, 105.0 MB/s, 0.42 GB read in 4.0 s"
    assert LP.progress_text("x", 0, 3, 0, 0.0) == "x: 0/3 tensors, 0.0 MB/s, 0.00 GB read in 0.0 s"


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_throttle_sends_first_every_half_second_and_last():
    clock, sent = _Clock(), []
    p = LP.LoadProgress("q", sent.append, every=0.5, clock=clock)
    clock.t = 100.1
    p(1, 5, 10_000_000)                   # first: sent
    clock.t = 100.5999
    p(2, 5, 20_000_000)                   # 0.4999 s after the last send: not sent
    clock.t = 100.6
    p(3, 5, 30_000_000)                   # exactly 0.5 s: sent
    clock.t = 100.7
    p(4, 5, 40_000_000)                   # not sent
    clock.t = 100.8
    p(5, 5, 50_000_000)                   # the last tensor: always sent
    assert [s.split(":")[1].split(",")[0].strip() for s in sent] == ["1/5 tensors", "3/5 tensors", "5/5 tensors"]
    assert p.sent == 3 and p.bytes_done == 50_000_000
    assert p.seconds == pytest.approx(0.8)
    assert p.last == sent[-1] and "62.5 MB/s" in p.last


def test_without_a_sender_only_the_last_text_is_kept():
    p = LP.LoadProgress("q", None)
    p(1, 1, 5)
    assert p.sent == 0 and p.last.startswith("q: 1/1 tensors")


def test_every_must_be_a_non_negative_number():
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="every"):
            LP.LoadProgress("q", None, every=bad)
    LP.LoadProgress("q", None, every=0.0)


def test_load_progress_outside_a_server_sends_nothing():
    p = LP.load_progress("quantizing to mxfp8")
    p(1, 2, 3)
    assert p.emit is None and p.last.startswith("quantizing to mxfp8: 1/2")


def test_probes_outside_a_host_are_named_adaptations_not_crashes(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "server", raising=False)
    monkeypatch.setitem(sys.modules, "server", None)          # `import server` raises ImportError
    p = LP._send_progress_text_probe()
    assert p.state == "adapted" and "progress bar only" in p.note
