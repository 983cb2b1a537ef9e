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
        strict_json_loads('{"a": 1, "a": 2}', "w")
    with pytest.raises(CheckpointError, match=r"^w: non-finite JSON constant -Infinity in the safetensors header$"):
        strict_json_loads('{"a": -Infinity}', "w")
    with pytest.raises(CheckpointError, match=r"^w: invalid JSON \(Expecting value: line 1 column 1 \(char 0\)\)$"):
        strict_json_loads("", "w")
    assert not hasattr(fasth3, "_strict_pairs") and not hasattr(fasth3, "_reject_constant")


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
