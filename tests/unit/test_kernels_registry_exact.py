"""kernels/registry.py on a private Registry with fake implementations: every field of a Selection, every text a
user reads (refusals, reasons, summary, explain), the explicit / auto flag each check receives, the log once per
key, and the module's capability helpers called directly (issue #29: written from the mutation run's survivors).
Oracles: the texts and orders written out here."""
from __future__ import annotations

import logging

import pytest
import torch

from ditkit.errors import BackendError
from ditkit.kernels import registry as R
from ditkit.kernels.registry import REFERENCE, Impl, Query, Registry, Selection


def ref_fn(*a):
    return "reference"


def fast_fn(*a):
    return "fast"


def _explicit_only(q, explicit):
    """A check that passes only when called with explicit=True exactly (not None, not a truthy stand-in)."""
    return None if explicit is True else "needs explicit"


def _auto_only(q, explicit):
    """A check that passes only when called with explicit=False exactly."""
    return None if explicit is False else "needs auto"


def _ok(q, explicit):
    return None


def _reg(*impls: Impl) -> Registry:
    r = Registry()
    r.op("op", ref_fn)
    for i in impls:
        r.impl("op", i)
    return r


# ------------------------------------------------------------------------------------------ module helpers

def test_device_capability_is_none_off_cuda_and_the_drivers_tuple_on_cuda(monkeypatch):
    seen = []

    def cap(dev):
        seen.append(dev)
        return [9, 0]                                       # a list: returned as a tuple

    monkeypatch.setattr(torch.cuda, "get_device_capability", cap)
    assert R.device_capability(torch.device("cpu")) is None
    assert R.device_capability(torch.device("meta")) is None
    assert seen == []
    dev = torch.device("cuda", 1)
    got = R.device_capability(dev)
    assert got == (9, 0) and isinstance(got, tuple)
    assert seen == [dev]


def test_package_available_true_false_and_a_bad_name():
    assert R.package_available("torch") is True
    assert R.package_available("ditkit_no_such_package_xyz") is False
    assert R.package_available("") is False                 # find_spec raises ValueError: not available
    assert R.package_available(".relative") is False


def _q(device_type="cuda", cap=(9, 0), dtype=torch.float16, op="op", index=0, head_dim=64):
    return Query(op, device_type, index, cap, dtype, head_dim)


def test_triton_check_texts(monkeypatch):
    monkeypatch.setattr(R, "triton_interpreter", lambda: False)
    assert R.triton_check(_q(), True, False, None) == "triton is not installed"
    assert R.triton_check(_q(), True, True, "head_dim 7 unsupported") == "head_dim 7 unsupported"
    assert R.triton_check(_q(dtype=torch.float64), True, True, None) == "dtype torch.float64 not supported"
    cpu = "CPU runs Triton only under TRITON_INTERPRET=1 and on explicit request (tests)"
    assert R.triton_check(_q("cpu", None), True, True, None) == cpu
    monkeypatch.setattr(R, "triton_interpreter", lambda: True)
    assert R.triton_check(_q("cpu", None), True, True, None) is None
    assert R.triton_check(_q("cpu", None), False, True, None) == cpu
    assert R.triton_check(_q(cap=(8, 0)), False, True, None) is None
    assert R.triton_check(_q(cap=(7, 5)), False, True, None) == "needs compute capability >= sm80 (got (7, 5))"
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        assert R.triton_check(_q(dtype=dt), False, True, None) is None


def test_need_cuda_boundary_and_texts():
    assert R.need_cuda(_q("cpu", None)) == "needs a CUDA device (got cpu)"
    assert R.need_cuda(_q(cap=None)) == "needs compute capability >= sm80 (got None)"
    assert R.need_cuda(_q(cap=(7, 9))) == "needs compute capability >= sm80 (got (7, 9))"
    assert R.need_cuda(_q(cap=(8, 0))) is None
    assert R.need_cuda(_q(cap=(8, 9)), (9, 0)) == "needs compute capability >= sm90 (got (8, 9))"
    assert R.need_cuda(_q(cap=(9, 0)), (9, 0)) is None


# ---------------------------------------------------------------------------------------------- registration

def test_op_registered_again_keeps_its_impls_and_takes_the_new_reference():
    r = _reg(Impl("fast", fast_fn, _ok))
    assert r.ops["op"].name == "op" and r.ops["op"].reference is ref_fn

    def ref2(*a):
        return "ref2"

    r.op("op", ref2)
    assert r.ops["op"].reference is ref2 and list(r.ops["op"].impls) == ["fast"]
    assert r.resolve("op", "cpu", torch.float32, 64, "reference").fn is ref2


def test_impl_before_its_op_is_refused_by_name():
    with pytest.raises(KeyError) as e:
        Registry().impl("nope", Impl("x", fast_fn, _ok))
    assert e.value.args == ("register op 'nope' (with its reference) before its implementations",)


def test_unverified_of_unknown_ops_and_backends_is_none():
    r = _reg(Impl("fast", fast_fn, _ok, unverified="no GPU"), Impl("plain", fast_fn, _ok))
    assert r.unverified("op", "fast") == "no GPU"
    assert r.unverified("op", "plain") is None
    assert r.unverified("op", "missing") is None
    assert r.unverified("no_op", "fast") is None


def test_query_fields(monkeypatch):
    monkeypatch.setattr(R, "device_capability", lambda dev: (9, 0))   # asked only for CUDA devices
    r = _reg()
    assert r.query("op", "cpu", torch.bfloat16, 64.0) == Query("op", "cpu", None, None, torch.bfloat16, 64)
    q = r.query("op", "cuda:1", torch.float16, 128)
    assert q == Query("op", "cuda", 1, (9, 0), torch.float16, 128)
    assert isinstance(q.head_dim, int)


# ------------------------------------------------------------------------------------------------ resolution

def test_resolve_unknown_op_text():
    r = _reg()
    r.op("other", ref_fn)
    with pytest.raises(KeyError) as e:
        r.resolve("zz", "cpu", torch.float32, 64)
    assert e.value.args == ("unknown kernel op 'zz'; known: ['op', 'other']",)


@pytest.mark.parametrize("auto", [None, "", "auto"])
def test_auto_spellings_and_the_flag_each_check_gets(auto):
    r = _reg(Impl("a", fast_fn, _explicit_only, priority=1), Impl("b", fast_fn, _auto_only, priority=2))
    sel = r.resolve("op", "cpu", torch.float32, 64, auto)
    assert sel.backend == "b" and sel.rejected == (("a", "needs explicit"),)
    assert sel.op == "op" and sel.fn is fast_fn and sel.exact is True
    assert sel.query == Query("op", "cpu", None, None, torch.float32, 64)
    assert sel.unverified is None and sel.verified is True


def test_explicit_request_passes_explicit_true_and_keeps_every_field():
    r = _reg(Impl("a", fast_fn, _explicit_only, exact=False, unverified="never on a GPU"))
    sel = r.resolve("op", "cpu", torch.float16, 32, "a")
    assert (sel.op, sel.backend, sel.fn, sel.exact, sel.rejected) == ("op", "a", fast_fn, False, ())
    assert sel.query == Query("op", "cpu", None, None, torch.float16, 32)
    assert sel.unverified == "never on a GPU" and sel.verified is False
    with pytest.raises(BackendError) as e:
        _reg(Impl("b", fast_fn, _auto_only)).resolve("op", "cpu", torch.bfloat16, 32, "b")
    assert str(e.value) == ("kernel backend 'b' cannot run op here: needs auto (device=cpu, dtype=bfloat16, "
                            "head_dim=32). Pick another backend explicitly or use 'auto'.")


def test_explicit_reference_selection_fields():
    r = _reg(Impl("a", fast_fn, _ok))
    sel = r.resolve("op", "cpu", torch.float32, 64, "reference")
    assert (sel.op, sel.backend, sel.fn, sel.exact, sel.rejected, sel.unverified) == \
        ("op", REFERENCE, ref_fn, True, (), None)
    assert sel.query == Query("op", "cpu", None, None, torch.float32, 64)


def test_unknown_backend_text_lists_auto_and_every_backend():
    r = _reg(Impl("b", fast_fn, _ok, priority=5), Impl("a", fast_fn, _ok, priority=1))
    with pytest.raises(BackendError) as e:
        r.resolve("op", "cpu", torch.float32, 64, "zz")
    assert str(e.value) == "kernel backend 'zz' is not known for op; choose one of ['auto', 'a', 'b', 'reference']"


def test_a_backend_without_launcher():
    r = _reg(Impl("nolaunch", None, _ok, priority=1), Impl("refuses", None, lambda q, e: "no device", priority=2))
    sel = r.resolve("op", "cpu", torch.float32, 64)
    assert sel.backend == REFERENCE and sel.fn is ref_fn and sel.exact is True
    assert sel.query == Query("op", "cpu", None, None, torch.float32, 64)
    assert sel.rejected == (("nolaunch", "no launcher is implemented for this backend"), ("refuses", "no device"))
    with pytest.raises(BackendError) as e:
        r.resolve("op", "cpu", torch.float32, 64, "nolaunch")
    assert str(e.value) == ("kernel backend 'nolaunch' cannot run op here: no launcher is implemented for this "
                            "backend (device=cpu, dtype=float32, head_dim=64). Pick another backend explicitly or "
                            "use 'auto'.")
    with pytest.raises(BackendError) as e:
        r.resolve("op", "cpu", torch.float32, 64, "refuses")
    assert "here: no device (device=cpu" in str(e.value)


def test_auto_rejects_approximate_and_unverified_with_their_texts():
    r = _reg(Impl("approx", fast_fn, _ok, exact=False, priority=1),
             Impl("new", fast_fn, _ok, unverified="no sm100 here", priority=2),
             Impl("good", fast_fn, _ok, priority=3))
    sel = r.resolve("op", "cpu", torch.float32, 64)
    assert sel.backend == "good" and sel.rejected == (
        ("approx", "approximate; only used when requested explicitly"),
        ("new", "never run on any hardware (no sm100 here); auto picks only backends that have run, request it "
                "explicitly to use it"))


def test_resolution_is_cached_per_key_and_logged_once(caplog):
    calls = []

    def check(q, explicit):
        calls.append(explicit)
        return None

    r = _reg(Impl("a", fast_fn, check))
    with caplog.at_level(logging.INFO, logger="ditkit.kernels"):
        s1 = r.resolve("op", "cpu", torch.float32, 64)
        s2 = r.resolve("op", "cpu", torch.float32, 64, "auto")
        assert s1 is s2 and calls == [False]
        r.impl("op", Impl("z", fast_fn, _ok, priority=500))          # clears the cache, not the log record
        s3 = r.resolve("op", "cpu", torch.float32, 64)
        assert s3 is not s1 and calls == [False, False]
    recs = [x for x in caplog.records if x.name == "ditkit.kernels"]
    assert [(x.levelno, x.getMessage()) for x in recs] == [(logging.INFO, "[ditkit] kernel op -> a (rejected: none)")]


def test_an_unverified_explicit_choice_is_logged_as_a_warning(caplog):
    r = _reg(Impl("a", fast_fn, _ok, unverified="no GPU"))
    with caplog.at_level(logging.INFO, logger="ditkit.kernels"):
        r.resolve("op", "cpu", torch.float32, 64, "a")
        r.resolve("op", "cpu", torch.float32, 64, "reference")
    recs = [(x.levelno, x.getMessage()) for x in caplog.records if x.name == "ditkit.kernels"]
    assert recs == [(logging.WARNING, "[ditkit] kernel op -> a [chosen explicitly, UNVERIFIED: no GPU] "
                                      "(rejected: none)"),
                    (logging.INFO, "[ditkit] kernel op -> reference (rejected: none)")]


def test_summary_texts():
    q = Query("op", "cpu", None, None, torch.float32, 64)
    assert Selection("op", "a", fast_fn, True, (), q).summary() == "op -> a (rejected: none)"
    s = Selection("op", "b", fast_fn, True, (("x", "why"), ("y", "because")), q, unverified="untested")
    assert s.summary() == "op -> b [chosen explicitly, UNVERIFIED: untested] (rejected: x: why; y: because)"


# ------------------------------------------------------------------------------------------------- explain

def test_explain_every_verdict_text_and_nothing_cached():
    seen = []

    def rec(q, explicit):
        seen.append((q.op, explicit))
        return None

    r = _reg(Impl("plain", fast_fn, rec, priority=1),
             Impl("explicit", fast_fn, _explicit_only, priority=2),
             Impl("auto", fast_fn, _auto_only, priority=3),
             Impl("nolaunch", None, _ok, priority=4),
             Impl("refused_nolaunch", None, lambda q, e: "no device", priority=5),
             Impl("unverified", fast_fn, _ok, unverified="no GPU", priority=6),
             Impl("unverified_refused", fast_fn, lambda q, e: "wrong dtype", unverified="no GPU", priority=7),
             Impl("approx", fast_fn, _ok, exact=False, priority=8))
    got = r.explain("op", "cpu", torch.float32, 64)
    assert got == {
        "plain": "ok",
        "explicit": "ok",
        "auto": "needs auto",
        "nolaunch": "no launcher is implemented for this backend",
        "refused_nolaunch": "no device",
        "unverified": "ok (explicit only, UNVERIFIED: never run on any hardware: no GPU)",
        "unverified_refused": "wrong dtype",
        "approx": "ok (approximate, explicit only)",
        "reference": "ok",
    }
    assert list(got) == ["plain", "explicit", "auto", "nolaunch", "refused_nolaunch", "unverified",
                         "unverified_refused", "approx", "reference"]
    assert seen == [("op", True)]
    assert r._cache == {}


def test_menu_groups_and_orders():
    r = _reg(Impl("ph", None, _ok, placeholder=True, priority=0),
             Impl("unv", fast_fn, _ok, unverified="x", priority=1),
             Impl("exo", fast_fn, _ok, explicit_only=True, priority=2),
             Impl("apx", fast_fn, _ok, exact=False, priority=3),
             Impl("best", fast_fn, _ok, priority=9),
             Impl("unv2", fast_fn, _ok, unverified="y", priority=0))
    assert r.menu("op") == ["best", "exo", "apx", REFERENCE, "unv2", "unv", "ph"]
    assert r.backends("op") == ["ph", "unv2", "unv", "exo", "apx", "best", REFERENCE]
