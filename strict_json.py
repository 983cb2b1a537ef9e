"""Strict JSON for every file ditkit reads (stdlib only: the headless runner imports it too).

:func:`loads` is ``json.loads`` that refuses duplicate object keys and the NaN / Infinity / -Infinity literals,
raising :class:`DuplicateKey` / :class:`NonFiniteConstant` (both ``ValueError``, like any other invalid JSON).
Each reader turns them into its own error: :func:`loads_as` does it for the readers that name the file and the
kind of JSON they read (``what=``: "safetensors header", "TeaCache coefficient file", ...), so an error never
names another kind of file. The key a file repeats is carried on the exception, so a reader that must not echo
file strings (the FastH3 contract) calls :func:`loads` and leaves it out.
"""
from __future__ import annotations

import json
from typing import Any


class DuplicateKey(ValueError):
    def __init__(self, key: str):
        r = repr(key)
        super().__init__(f"duplicate key {r if len(r) <= 60 else r[:57] + '...'}")
        self.key = key


class NonFiniteConstant(ValueError):
    def __init__(self, name: str):
        super().__init__(f"{name} is not a JSON value")
        self.name = name       # the literal as the parser names it: NaN, Infinity or -Infinity


def _pairs(pairs) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


def _constant(name: str):
    raise NonFiniteConstant(name)


def loads(text: str) -> Any:
    """``json.loads(text)`` with duplicate keys and non-finite literals refused (see the module docstring)."""
    return json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant)


def loads_as(text: str, where: str, *, what: str, error: type[Exception] = ValueError) -> Any:
    """:func:`loads`, every failure raised as ``error`` naming ``where`` (the file) and ``what`` (the kind of JSON
    read there): ``"<where>: duplicate JSON key 'k' in the <what>"``, ``"... non-finite JSON constant NaN in the
    <what>"``, ``"<where>: invalid JSON in the <what> (<parser message>)"``."""
    try:
        return loads(text)
    except DuplicateKey as e:
        raise error(f"{where}: duplicate JSON key {e.key!r} in the {what}") from None
    except NonFiniteConstant as e:
        raise error(f"{where}: non-finite JSON constant {e.name} in the {what}") from None
    except (ValueError, RecursionError) as e:
        raise error(f"{where}: invalid JSON in the {what} ({e})") from None
