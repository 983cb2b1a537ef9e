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
