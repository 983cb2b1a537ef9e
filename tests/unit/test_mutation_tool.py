"""tools/mutation.py's ``--only`` filter: the mutant names it keeps are mutmut's own fnmatch match, case-sensitive
(the names are Python identifiers)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("ditkit_mutation_tool",
                                               Path(__file__).resolve().parents[2] / "tools" / "mutation.py")
M = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(M)


@pytest.mark.parametrize("name, globs, want", [
    ("ditkit.kernels.quant.x_to_blocked__mutmut_3", ["ditkit.kernels.quant.x_to_blocked__mutmut_*"], True),
    ("ditkit.kernels.quant.x_to_blocked_rows__mutmut_3", ["ditkit.kernels.quant.x_to_blocked__mutmut_*"], False),
    ("ditkit.kernels.quant.x_To_blocked__mutmut_3", ["ditkit.kernels.quant.x_to_blocked__mutmut_*"], False),
    ("ditkit.kernels.quant.x_b__mutmut_1", ["*.x_a__*", "*.x_b__*"], True),
    ("ditkit.kernels.quant.x_c__mutmut_1", ["*.x_a__*", "*.x_b__*"], False),
    ("ditkit.kernels.quant.x_a__mutmut_1", [], False),
])
def test_only_keeps_the_names_a_glob_matches(name, globs, want):
    assert M._matches(name, globs) is want
