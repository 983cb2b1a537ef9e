"""ditkit/strict_json.py: the one strict JSON parser (duplicate keys and NaN/Infinity literals refused) behind the
safetensors/config readers, the FastH3 contract reader and the runner. Expected values are written out here."""
from __future__ import annotations

import pytest

from ditkit import strict_json


def test_valid_json_parses_like_json():
    assert strict_json.loads('{"a": [1, 2.5, "x", null, true], "b": {"c": {}}}') == \
        {"a": [1, 2.5, "x", None, True], "b": {"c": {}}}


@pytest.mark.parametrize("text,key", [('{"a": 1, "a": 2}', "a"), ('{"x": {"k": 1, "k": 1}}', "k"),
                                      ('[{"1": 0, "1": 0}]', "1")])
def test_duplicate_keys_are_refused_at_any_depth(text, key):
    with pytest.raises(strict_json.DuplicateKey) as e:
        strict_json.loads(text)
    assert e.value.key == key and str(e.value) == f"duplicate key '{key}'"
    assert isinstance(e.value, ValueError)


def test_a_long_duplicate_key_is_shortened_in_the_message():
    key = "k" * 100
    with pytest.raises(strict_json.DuplicateKey) as e:
        strict_json.loads(f'{{"{key}": 1, "{key}": 2}}')
    assert e.value.key == key and str(e.value) == "duplicate key '" + "k" * 56 + "..."


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_literals_are_refused(literal):
    with pytest.raises(strict_json.NonFiniteConstant) as e:
        strict_json.loads(f'{{"v": [{literal}]}}')
    assert e.value.name == literal and str(e.value) == f"{literal} is not a JSON value"
    assert isinstance(e.value, ValueError)


def test_the_readers_keep_their_messages():
    # one implementation (fasth3 keeps no copy); each reader words its own message
    from ditkit.errors import CheckpointError
    from ditkit.loaders.safetensors_io import strict_json_loads
    from ditkit.sampling import fasth3

    with pytest.raises(CheckpointError, match=r"^w: duplicate JSON key 'a' in the safetensors header$"):
        strict_json_loads('{"a": 1, "a": 2}', "w", what="safetensors header")
    with pytest.raises(CheckpointError, match=r"^w: non-finite JSON constant -Infinity in the safetensors header$"):
        strict_json_loads('{"a": -Infinity}', "w", what="safetensors header")
    with pytest.raises(CheckpointError, match=r"^w: invalid JSON in the safetensors header \(Expecting value: line 1 "
                                              r"column 1 \(char 0\)\)$"):
        strict_json_loads("", "w", what="safetensors header")
    assert not hasattr(fasth3, "_strict_pairs") and not hasattr(fasth3, "_reject_constant")


class Refused(Exception):
    pass


@pytest.mark.parametrize("text, message", [
    ('{"a": 1, "a": 2}', "f.json: duplicate JSON key 'a' in the thing file"),
    ('{"a": [NaN]}', "f.json: non-finite JSON constant NaN in the thing file"),
    ('{"a": Infinity}', "f.json: non-finite JSON constant Infinity in the thing file"),
    ('{"a": 1', "f.json: invalid JSON in the thing file (Expecting ',' delimiter: line 1 column 8 (char 7))"),
    ("[" * 100_000 + "]" * 100_000, "f.json: invalid JSON in the thing file ("),   # RecursionError
])
def test_loads_as_names_the_file_and_its_kind(text, message):
    with pytest.raises(Refused) as e:
        strict_json.loads_as(text, "f.json", what="thing file", error=Refused)
    assert str(e.value).startswith(message), str(e.value)
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert strict_json.loads_as('{"a": [1.5, 1e308]}', "f.json", what="thing file", error=Refused) == \
        {"a": [1.5, 1e308]}
    with pytest.raises(ValueError):   # the default error type
        strict_json.loads_as('{"a": 1, "a": 2}', "f.json", what="thing file")


def test_no_reader_names_the_wrong_kind_of_file(tmp_path):
    """Issue #28: a TeaCache file's error said "safetensors header". Each reader now names its own kind."""
    from ditkit.cache import calibrate, coefficients
    from ditkit.errors import CoefficientError

    with pytest.raises(CoefficientError) as e:
        coefficients.parse_bytes(b'{"format": 1, "format": 2}', "c.json")
    assert "in the coefficient JSON" in str(e.value) and "safetensors" not in str(e.value)
    with pytest.raises(CoefficientError) as e:
        calibrate.parse_pair_bytes(b'{"v": NaN}', "pairs_1.json", "pairs_1.json")
    assert "in the TeaCache pair file" in str(e.value) and "safetensors" not in str(e.value)


def test_every_json_reader_goes_through_strict_json():
    """No other module parses JSON with its own duplicate-key / constant hooks (one reader, issue #28)."""
    import ast

    from tests.support.pack_scan import PACK_ROOT, pack_python_files

    found = []
    for p in pack_python_files():
        if p.name == "strict_json.py":
            continue
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, ast.keyword) and n.arg in ("object_pairs_hook", "parse_constant"):
                found.append(f"{p.relative_to(PACK_ROOT)}:{n.lineno}")
    assert not found, found


@pytest.mark.parametrize("n", [58, 59, 60])
def test_duplicate_key_message_length_bound_both_sides(n):
    """The key's repr is shown whole up to 60 characters, cut to 57 + '...' above (repr adds two quotes)."""
    key = "k" * n                                  # repr: n + 2 characters -> 60, 61, 62
    with pytest.raises(strict_json.DuplicateKey) as e:
        strict_json.loads('{"%s": 1, "%s": 2}' % (key, key))
    r = repr(key)
    want = r if len(r) <= 60 else r[:57] + "..."
    assert str(e.value) == f"duplicate key {want}"
    assert (str(e.value).endswith("...")) == (len(r) > 60)
