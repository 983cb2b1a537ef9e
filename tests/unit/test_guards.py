"""guards.py without ComfyUI (issue #17 item 9): the FLOAT inputs of a schema are found by duck typing, and a guarded
execute refuses NaN / +-Inf in any of them, by keyword or position, sync or async, before the node's own code."""
from __future__ import annotations

import asyncio
import inspect
import math
from types import SimpleNamespace

import pytest

from ditkit.errors import DitKitError
from ditkit.guards import GUARD_ATTR, check_finite_inputs, float_inputs, guard_node, non_finite
from ditkit.guards import nested_inputs


def _inp(id, io_type, **kw):
    return SimpleNamespace(id=id, io_type=io_type, **kw)


SCHEMA = SimpleNamespace(inputs=[_inp("model", "MODEL"), _inp("strength", "FLOAT"), _inp("steps", "INT"),
                                 _inp("name", "STRING"), _inp("fps", "FLOAT"),
                                 _inp("dyn", "COMFY_DYNAMICCOMBO_V3", inputs=[_inp("inner", "FLOAT")])])


def test_float_inputs_are_found_by_io_type():
    assert float_inputs(SCHEMA) == ("strength", "fps", "inner")
    assert float_inputs(SimpleNamespace(inputs=None)) == ()


@pytest.mark.parametrize("v,bad", [(math.nan, True), (math.inf, True), (-math.inf, True), (1e308, False), (0, False),
                                   (True, False), ([1.0, math.nan], True), ((2.0,), False), (None, False), ("x", False)])
def test_non_finite(v, bad):
    assert non_finite(v) is bad


class Node:
    calls = []

    @classmethod
    def execute(cls, model, strength, steps=1, name="", fps=24.0):
        Node.calls.append((model, strength, fps))
        return "ran"


class AsyncNode:
    @classmethod
    async def execute(cls, fps):
        return fps * 2


def test_guarded_execute_refuses_before_the_node_runs():
    guard_node(Node, "DitKitX", float_inputs(SCHEMA))
    assert getattr(Node, GUARD_ATTR) == ("strength", "fps", "inner")
    Node.calls.clear()
    for kwargs, name in (({"strength": math.nan}, "strength"), ({"strength": 1.0, "fps": math.inf}, "fps"),
                         ({"strength": 1.0, "fps": -math.inf}, "fps")):
        with pytest.raises(DitKitError) as ei:
            Node.execute(model="m", **kwargs)
        assert f"DitKitX: input '{name}'" in str(ei.value) and "finite" in str(ei.value)
    with pytest.raises(DitKitError, match="input 'strength'"):
        Node.execute("m", math.nan)                       # positional arguments are bound to their names
    assert Node.calls == []
    assert Node.execute(model="m", strength=0.5) == "ran" and Node.calls == [("m", 0.5, 24.0)]


def test_guard_is_idempotent_and_keeps_the_signature_kind():
    guard_node(Node, "DitKitX", ("strength", "fps"))
    guard_node(Node, "DitKitX", ("strength", "fps"))
    with pytest.raises(DitKitError):
        Node.execute(model="m", strength=math.nan)
    assert Node.execute(model="m", strength=2.0) == "ran"   # one wrapper deep: the original still runs once
    guard_node(AsyncNode, "DitKitA", ("fps",))
    assert inspect.iscoroutinefunction(AsyncNode.execute)   # ComfyUI picks EXECUTE_NORMALIZED_ASYNC from this
    assert asyncio.run(AsyncNode.execute(fps=2.0)) == 4.0
    with pytest.raises(DitKitError, match="input 'fps'"):
        asyncio.run(AsyncNode.execute(fps=math.nan))


def test_subclass_clone_inherits_the_guard():
    """ComfyUI executes a shallow subclass clone of the node class (PREPARE_CLASS_CLONE)."""
    guard_node(Node, "DitKitX", ("strength",))
    clone = type("Clone", (Node,), {})
    with pytest.raises(DitKitError):
        clone.execute(model="m", strength=math.inf)


def test_check_finite_inputs_ignores_absent_and_non_float_values():
    check_finite_inputs("N", ("a", "b"), {"a": 1.0})
    with pytest.raises(DitKitError, match="input 'b' is nan"):
        check_finite_inputs("N", ("a", "b"), {"a": 1.0, "b": float("nan")})


def test_before_runs_first_and_its_refusal_stops_everything():
    """``before`` (the host contract's require in nodes/__init__.py) runs before the float check and the node."""
    class N:
        ran = []

        @classmethod
        def execute(cls, strength):
            N.ran.append(strength)
            return "ran"

    class A:
        @classmethod
        async def execute(cls, fps):
            return fps

    order = []

    def refuse():
        order.append("before")
        raise DitKitError("DitKitX cannot run on ComfyUI 9.9: comfy.x: gone")

    guard_node(N, "DitKitX", ("strength",), before=refuse)
    with pytest.raises(DitKitError, match="cannot run on ComfyUI 9.9"):
        N.execute(strength=math.nan)           # the contract refusal comes first, not the NaN message
    assert order == ["before"] and N.ran == []
    guard_node(A, "DitKitA", ("fps",), before=refuse)
    with pytest.raises(DitKitError, match="cannot run"):
        asyncio.run(A.execute(fps=1.0))

    ok = []
    guard_node(N, "DitKitX", ("strength",), before=lambda: ok.append(1))   # re-guarded with another check
    assert N.execute(strength=0.5) == "ran" and ok == [1] and N.ran == [0.5]
    with pytest.raises(DitKitError, match="finite"):
        N.execute(strength=math.inf)           # the float check still runs after a passing before
    assert ok == [1, 1] and N.ran == [0.5]


def test_guard_with_the_same_before_is_idempotent():
    class N:
        @classmethod
        def execute(cls, strength):
            return strength

    calls = []

    def before():
        calls.append(1)

    guard_node(N, "DitKitX", ("strength",), before=before)
    first = N.__dict__["execute"]
    guard_node(N, "DitKitX", ("strength",), before=before)
    assert N.__dict__["execute"] is first
    assert N.execute(strength=2.0) == 2.0 and calls == [1]   # wrapped once: before ran once


# --- issue 29: the attack the guard exists for, in every shape a value reaches execute -------------------------------
# The V3 API's dynamic inputs, as comfy_api.latest._io (ComfyUI 0.33) builds them: Autogrow.Input.template is a
# TemplatePrefix/TemplateNames *object* (get_all() -> one input per name), DynamicCombo.Input.options is a list of
# Option(key, inputs), DynamicSlot.Input has .slot and .inputs; every Input has get_all(). execute receives their
# values nested: {top_id: {inner_id: value}} (build_nested_inputs).

class _In:
    def __init__(self, id, io_type):
        self.id, self.io_type = id, io_type

    def get_all(self):
        return [self]


class _Template:                                          # Autogrow.TemplatePrefix(input, prefix="v", max=3)
    def __init__(self, inp, prefix, n):
        self.input, self.names = inp, [f"{prefix}{i}" for i in range(n)]
        self.cached = [_In(name, inp.io_type) for name in self.names]

    def get_all(self):
        return list(self.cached)


class _Autogrow(_In):
    def __init__(self, id, template):
        super().__init__(id, "COMFY_AUTOGROW_V3")
        self.template = template

    def get_all(self):
        return [self] + self.template.get_all()


class _Option:
    def __init__(self, key, inputs):
        self.key, self.inputs = key, inputs


class _Combo(_In):
    def __init__(self, id, options):
        super().__init__(id, "COMFY_DYNAMICCOMBO_V3")
        self.options = options

    def get_all(self):
        return [self] + [i for o in self.options for i in o.inputs]


class _Slot(_In):
    def __init__(self, slot, inputs):
        super().__init__(slot.id, "COMFY_DYNAMICSLOT_V3")
        self.slot, self.inputs = slot, inputs

    def get_all(self):
        return [self.slot] + self.inputs


def test_float_inputs_walks_every_dynamic_input_class_comfyui_builds():
    """Fails on main: an Autogrow template is an object, not a list, and DynamicCombo keeps its inputs under
    ``options``: neither was walked, so their FLOAT inputs were never checked."""
    schema = SimpleNamespace(inputs=[
        _In("a", "FLOAT"),
        _Autogrow("grow", _Template(_In("w", "FLOAT"), "w", 3)),
        _Combo("mode", [_Option("x", [_In("cx", "FLOAT"), _In("ci", "INT")]), _Option("y", [_In("cy", "FLOAT")])]),
        _Slot(_In("s", "FLOAT"), [_In("sf", "FLOAT")]),
        _Autogrow("ints", _Template(_In("i", "INT"), "i", 2)),
    ])
    assert float_inputs(schema) == ("a", "w0", "w1", "w2", "cx", "cy", "s", "sf")
    # duck-typed (no get_all): plain lists under 'inputs' and 'template', nested
    duck = SimpleNamespace(inputs=[_inp("t", "X", template=[_inp("t0", "FLOAT"), _inp("t1", "INT")]),
                                   _inp("i", "X", inputs=[_inp("i0", "X", inputs=[_inp("deep", "FLOAT")])]),
                                   _inp("n", "X", template=_inp("not_a_list", "FLOAT"))])
    assert float_inputs(duck) == ("t0", "deep")
    # an id two DynamicCombo options share is listed once
    shared = SimpleNamespace(inputs=[_Combo("m", [_Option("x", [_In("s", "FLOAT")]), _Option("y", [_In("s", "FLOAT")])])])
    assert float_inputs(shared) == ("s",)


@pytest.mark.parametrize("value", [
    (1.0, math.nan), (math.inf,), ((1.0, (2.0, -math.inf)),), [[math.nan]],      # tuples / nested (INPUT_IS_LIST)
    {"w0": 1.0, "w1": math.nan}, {"inner": {"x": math.inf}},                      # Autogrow dicts
    (math.nan, "w0"),                                                              # create_dynamic_tuple (value, key)
])
def test_non_finite_inside_containers(value):
    assert non_finite(value) is True


@pytest.mark.parametrize("value", [(1.0, 2.0), {"w0": 1.0, "w1": "x"}, {}, (), (True, None), {"a": (1, 2.5)}])
def test_finite_containers_pass(value):
    assert non_finite(value) is False


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_numpy_scalars_of_every_float_dtype(dtype, bad):
    """Fails on main: a numpy float32/float16 scalar (what a linked node may output) is not a Python float, so NaN
    passed; float64 subclasses float and was the only one caught."""
    np = pytest.importorskip("numpy")
    assert non_finite(np.dtype(dtype).type(bad)) is True
    assert non_finite(np.dtype(dtype).type(1.5)) is False
    assert non_finite(np.finfo(dtype).max) is False           # the largest finite value of the dtype: finite


def test_boundary_the_largest_float_is_finite_and_one_step_more_is_not():
    assert non_finite(1.7976931348623157e308) is False
    assert non_finite(1.7976931348623157e308 * 2) is True
    assert non_finite(-1.7976931348623157e308) is False
    assert non_finite(2 ** 1023) is False        # an int float() can hold
    assert non_finite(2 ** 1024) is True         # one it cannot: inf in the node (main: a raw OverflowError)
    assert non_finite(-(2 ** 1024)) is True


def test_guarded_execute_refuses_nan_inside_dynamic_inputs_as_comfyui_passes_them():
    """Fails on main: execute gets ``{top_id: {inner_id: value}}`` for dynamic inputs; the guard only looked at
    top-level names, so NaN inside an Autogrow/DynamicCombo reached the node."""
    schema = SimpleNamespace(inputs=[_Autogrow("grow", _Template(_In("w", "FLOAT"), "w", 2)),
                                     _Combo("mode", [_Option("x", [_In("cx", "FLOAT")])])])
    ran = []

    class Dyn:
        @classmethod
        def execute(cls, grow, mode):
            ran.append((grow, mode))
            return "ran"

    guard_node(Dyn, "DitKitDyn", float_inputs(schema))
    with pytest.raises(DitKitError, match="input 'w1' is nan"):
        Dyn.execute(grow={"w0": 1.0, "w1": math.nan}, mode={"mode": "x", "cx": 1.0})
    with pytest.raises(DitKitError, match="input 'cx' is inf"):
        Dyn.execute(grow={"w0": 1.0}, mode={"mode": "x", "cx": math.inf})
    with pytest.raises(DitKitError, match="input 'w0'"):                 # create_dynamic_tuple: (value, key)
        Dyn.execute(grow={"w0": (math.nan, "grow.w0")}, mode={"mode": "x"})
    assert ran == []
    assert Dyn.execute(grow={"w0": 1.0, "w1": 2.0}, mode={"mode": "x", "cx": 0.0}) == "ran"


def test_guarded_execute_refuses_nan_inside_a_tuple_input():
    class Listy:
        @classmethod
        def execute(cls, strength):
            return "ran"

    guard_node(Listy, "DitKitL", ("strength",))
    with pytest.raises(DitKitError, match="input 'strength'"):
        Listy.execute(strength=(0.5, math.nan))
    assert Listy.execute(strength=(0.5, 1.0)) == "ran"


def test_guard_non_classmethod_execute_is_refused_and_rewrapping_with_new_names_takes_them():
    class Plain:
        def execute(self, x):
            return x

    with pytest.raises(TypeError, match="Plain.execute is not a classmethod"):
        guard_node(Plain, "P", ("x",))

    class Two:
        @classmethod
        def execute(cls, a=0.0, b=0.0):
            return a + b

    guard_node(Two, "T", ("a",))
    assert Two.execute(b=math.nan) != Two.execute(b=math.nan)           # 'b' not guarded yet: NaN + 0 -> NaN
    guard_node(Two, "T", ("a", "b"))                                     # new names: wrapped again (one level)
    with pytest.raises(DitKitError, match="input 'b'"):
        Two.execute(b=math.nan)
    assert getattr(Two, GUARD_ATTR) == ("a", "b") and Two.execute(a=1.0, b=2.0) == 3.0


def test_the_refusal_message_says_why_in_full():
    with pytest.raises(DitKitError) as ei:
        check_finite_inputs("DitKitN", ("x",), {"x": math.inf})
    assert str(ei.value) == ("DitKitN: input 'x' is inf; it must be a finite number (NaN and Infinity pass "
                             "ComfyUI's min/max check, so ditkit refuses them here)")


def test_float_inputs_tolerates_inputs_without_io_type_and_schemas_without_inputs():
    assert float_inputs(SimpleNamespace()) == ()
    assert float_inputs(SimpleNamespace(inputs=[SimpleNamespace(id="hidden"), _inp("f", "FLOAT")])) == ("f",)


def test_guard_wraps_once_and_rewrapping_keeps_the_original_underneath(monkeypatch):
    from ditkit import guards

    class Once:
        @classmethod
        def execute(cls, a=0.0, b=0.0):
            return a + b

    original = Once.__dict__["execute"].__func__
    guard_node(Once, "O", ("a",))
    first = Once.__dict__["execute"]
    guard_node(Once, "O", ("a",))                                        # same names: nothing changes
    assert Once.__dict__["execute"] is first
    guard_node(Once, "O", ("a", "b"))                                    # new names: the original is re-wrapped
    assert Once.__dict__["execute"].__func__.__wrapped_by_ditkit__ is original
    calls = []
    real = guards.check_finite_inputs
    monkeypatch.setattr(guards, "check_finite_inputs", lambda *a: calls.append(a) or real(*a))
    assert Once.execute(a=1.0, b=2.0) == 3.0 and len(calls) == 1         # one check per call, not one per wrap


def test_guard_refuses_a_staticmethod_execute():
    class Static:
        @staticmethod
        def execute(x):
            return x

    with pytest.raises(TypeError, match="Static.execute is not a classmethod"):
        guard_node(Static, "S", ("x",))


def test_arguments_that_do_not_bind_are_still_checked_by_keyword():
    """A call the signature cannot bind (an unexpected keyword) is checked from its keywords, then the node's own
    TypeError (or the refusal, first) follows."""
    class Strict:
        @classmethod
        def execute(cls, strength):
            return strength

    guard_node(Strict, "DitKitS", ("strength", "extra"))
    with pytest.raises(DitKitError, match="input 'extra'"):
        Strict.execute(strength=1.0, extra=math.nan)
    with pytest.raises(TypeError):
        Strict.execute(strength=1.0, extra=1.0)


def test_var_keyword_inputs_are_checked():
    class Kw:
        @classmethod
        def execute(cls, **kwargs):
            return sorted(kwargs)

    guard_node(Kw, "DitKitKw", ("f",))
    with pytest.raises(DitKitError, match="input 'f'"):
        Kw.execute(f=math.nan)
    assert Kw.execute(f=1.0, g=math.nan) == ["f", "g"]                  # only declared FLOAT inputs are checked


def test_nested_inputs_directly():
    a = _Autogrow("g", _Template(_In("w", "FLOAT"), "w", 2))
    assert [x.id for x in nested_inputs(a)] == ["w0", "w1"]                 # get_all() minus the input itself
    assert nested_inputs(_In("x", "FLOAT")) == []
    duck = _inp("d", "X", inputs=[_inp("i", "FLOAT")], template=(_inp("t", "INT"),))
    assert [x.id for x in nested_inputs(duck)] == ["i", "t"]
    assert nested_inputs(_inp("d", "X", inputs="not a list")) == []
