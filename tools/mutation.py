#!/usr/bin/env python3
"""Mutation testing of one core module with the unit tests that cover it (mutmut 3).

    nice -n 19 python tools/mutation.py guards.py                 # the mapped unit tests
    nice -n 19 python tools/mutation.py loaders/safe_fs.py --tests tests/unit/test_safe_fs.py
    python tools/mutation.py --list                               # the module -> tests map

Why a script and not a bare ``[tool.mutmut]`` section: the repository root *is* the package ``ditkit``, and mutmut 3
derives a mutant's module name from its path relative to the folder it runs in (``guards.py`` -> ``guards``), while
the tests import ``ditkit.guards``. Run from the root, every mutant would be "no tests" (mutmut stops on that) or,
worse, the tests would import the unmutated checkout. So the script stages the run:

    ~/.cache/ditkit/mutation/<checkout>-<hash>/<slug>/   (outside the checkout; --workdir)
        pyproject.toml               [tool.mutmut]: source_paths = ["ditkit/<module>"], the tests, also_copy ditkit/
        ditkit/                      a copy of the checkout (tests/ included, no .git)
        mutants/ditkit/...           mutmut's own copy: the mutated module + everything else

mutmut runs pytest from ``<slug>/mutants``; ``tests/conftest.py`` there makes ``import ditkit`` mean
``<slug>/mutants/ditkit`` (its own checkout), i.e. the mutated copy, and the module name is
``ditkit.<module>`` on both sides. The script checks this before trusting a figure: the staged tests are run once
with ``MUTANT_UNDER_TEST=fail`` (every trampoline of the mutated module raises) and must fail, and
``ditkit.<module>.__file__`` as the tests see it must be the mutated copy. mutmut itself also refuses to go on when
no recorded test hit matches a mutant name, and runs its own forced-fail check.

Kill rate = killed / (mutants - listed equivalents). "no tests" and "timeout" count as not killed (a timeout is
usually an infinite loop the tests would never finish: mutmut calls it killed; it is reported separately here).
Equivalent mutants (no behaviour change possible) are listed in ``EQUIVALENT`` below with the reason.
Not part of the default CI run (minutes per module). Needs ``pip install mutmut`` (3.x) in the venv.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# module (path relative to the package root) -> the unit test files that cover it. Keep it to the tests that exercise
# the module directly: mutmut runs, per mutant, only the tests that reached the mutated function in its first pass.
TESTS: dict[str, list[str]] = {
    "guards.py": ["tests/unit/test_guards.py", "tests/unit/test_teacache_guards.py"],
    "strict_json.py": ["tests/unit/test_strict_json.py"],
    "loaders/safe_fs.py": ["tests/unit/test_safe_fs.py", "tests/unit/test_safe_writes.py",
                           "tests/unit/test_public_direct.py", "tests/unit/test_safe_fs_paths.py",
                           "tests/unit/test_user_files_once.py"],
    "kernels/vsa_select.py": ["tests/unit/test_kernels_vsa_select.py", "tests/unit/test_public_direct_kernels.py"],
    "kernels/tile_pack.py": ["tests/unit/test_kernels_vsa.py", "tests/unit/test_kernels_int64.py",
                             "tests/unit/test_vsa_layout_buffers.py"],
    "kernels/delta_fuse.py": ["tests/unit/test_kernels_delta_fuse.py", "tests/unit/test_kernels_delta_fuse_layouts.py",
                              "tests/unit/test_public_direct.py"],
    "kernels/quant.py": ["tests/unit/test_quant.py", "tests/unit/test_public_direct.py", "tests/unit/test_quant_fast.py",
                         "tests/unit/test_quant_nvfp4_cpu.py", "tests/unit/test_quant_speed_helpers.py",
                         "tests/unit/test_requant_helpers_direct.py"],
    "cache/teacache.py": ["tests/unit/test_teacache.py", "tests/unit/test_teacache_guards.py"],
    "cache/coefficients.py": ["tests/unit/test_teacache_files.py", "tests/unit/test_coefficient_safety.py",
                              "tests/unit/test_public_direct_cache_vae.py", "tests/unit/test_coefficients_exact.py"],
    "cache/audio_guard.py": ["tests/unit/test_audio_guard.py", "tests/unit/test_audio_guard_exact.py"],
    "cache/adaln.py": ["tests/unit/test_adaln_core.py", "tests/unit/test_h3_modulation_memo.py",
                       "tests/unit/test_adaln_exact.py"],
    "vae/t1_decode.py": ["tests/unit/test_vae_t1.py", "tests/unit/test_vae_t1_dtypes.py", "tests/unit/test_preflight.py",
                         "tests/unit/test_vae_t1_report.py", "tests/unit/test_progress_callbacks.py"],
    "vae/preflight.py": ["tests/unit/test_preflight.py", "tests/unit/test_public_direct.py",
                         "tests/unit/test_preflight_exact.py"],
    "vae/h3_layout.py": ["tests/unit/test_ckpt_h3_vae.py"],
    "sampling/fasth3.py": ["tests/unit/test_fasth3_schedule.py", "tests/unit/test_public_direct.py",
                           "tests/unit/test_fasth3_exact.py"],
    "sampling/fasth3_recipe.py": ["tests/unit/test_fasth3_recipe.py", "tests/unit/test_fasth3_recipe_bounds.py",
                                  "tests/unit/test_fasth3_recipe_texts.py"],
    "offload/streamer.py": ["tests/unit/test_offload_streamer.py", "tests/unit/test_offload_streamer_layouts.py"],
    "loaders/safetensors_io.py": ["tests/unit/test_safetensors_io.py", "tests/unit/test_safe_reader_open_once.py"],
    "loaders/h3.py": ["tests/unit/test_loaders_h3.py", "tests/unit/test_public_direct_loaders.py"],
    # not measured yet: run it whole with this map (the "before"), then add test_h3_turbo_curve_exact.py and --recheck
    "loaders/h3_turbo_curve.py": ["tests/unit/test_h3_turbo_curve.py"],
    "loaders/lokr_math.py": ["tests/unit/test_public_direct.py", "tests/unit/test_lokr.py",
                           "tests/unit/test_lokr_add_delta.py", "tests/unit/test_lokr_factorization.py",
                           "tests/unit/test_lokr_rebuild.py"],
    "loaders/quant_cache.py": ["tests/unit/test_quant_cache.py"],
    "bridge/quant_scales.py": ["tests/unit/test_quant_scales_bytes.py"],
    "loaders/read_progress.py": ["tests/unit/test_progress_callbacks.py"],
    # not test_quantize_memory.py: its peak-RSS tests import the pack in a child process, where mutmut's trampoline
    # (MUTANT_UNDER_TEST inherited) cannot find its configuration and the stats pass fails
    "loaders/host_memory.py": ["tests/unit/test_public_direct_loaders.py", "tests/unit/test_quant_speed_helpers.py",
                               "tests/unit/test_host_memory_exact.py"],
    "kernels/registry.py": ["tests/unit/test_kernels_registry.py", "tests/unit/test_public_direct_kernels.py",
                            "tests/unit/test_kernels_registry_exact.py"],
    "vae/metadata.py": ["tests/unit/test_vae_metadata.py", "tests/unit/test_vae_metadata_exact.py",
                        "tests/unit/test_public_direct_cache_vae.py"],
}

# mutant name -> why it cannot change behaviour (reviewed by hand; a listed name that no longer exists is reported)
_ELSE_BRANCH = ("guard_node's else branch is reached only when execute is not a classmethod (a function or a "
                "staticmethod): cls.execute then has no __func__ either way, so func is None and TypeError follows; "
                "with the classmethod check disabled, cls.execute.__func__ is the same function as raw.__func__")
_PEP446 = "Python opens every descriptor non-inheritable (PEP 446: os.open adds O_CLOEXEC itself)"
_EOP = "EOPNOTSUPP == ENOTSUP (95) on Linux, where the attribute exists: the same tuple"
_LINK = ("the path fallback's os.link(src, dst) with follow_symlinks True: without dir_fd CPython "
         "calls link(2), which never follows a symlink on Linux (the descriptor branch's linkat is tested)")
_FALSY = "follow_symlinks=None is falsy: the same call as follow_symlinks=False"
_SLOT = ("a work-buffer slot name (None / renamed) only picks which per-thread buffer holds the values: the idx and vals slots stay distinct, the values are the same")
_CAST = "memoryview(...).cast('b') for cast('B'): the same bytes are hashed"
_UTF8 = "'UTF-8' and 'utf-8' name the same codec"
_SHORT_HEAD = ("_sampled_sha256's header length for a file shorter than 8 bytes: hdr_end is clamped to the size, "
               "so hdr_end <= size < 8 whatever n is: the same bytes are hashed")
_REPLACED = ("read's own record error text / where: strict_json's ValueError is caught and replaced by read's own "
             "QuantCacheError message naming the file")
_STAMP_NONE = ("read_stamp's error text / class / where: every QuantCacheError / ValueError there is caught and the "
               "stamp is None (the file is hashed in full); the text is never seen")
_SAME_RANK = ("'>=' for '>' on the ranks: at equal rank w1.reshape(*w1.shape, *[]) is w1's own shape, a "
              "no-op view")
_PAIR_SUM = ("factorization's sum test is dead: below sqrt a divisor pair's sum falls as m grows, and the next "
             "divisor above sqrt is its partner (same sum, same pair)")
_MENU_GROUPS = ("Registry.menu's group() returns 0, 1, 3 or 4, never 2: '< 2' / '<= 2' / '< 3' pick the same "
                "impls, as do '>= 2' / '> 2' / '>= 3', and a placeholder's 4 or 5 sorts after every unverified 3")
_AG = "ditkit.cache.audio_guard."
_LASTDIM2 = "on a 2-D tensor dim +1 is dim -1: the same axis"
_WHERE0 = ("torch.where(finite, x, zeros(()) of float32): a 0-d tensor does not promote the float64 operand; the "
           "result is float64 zeros where x was not finite, as with dtype=x.dtype")
_DEAD_SILENT = ("the 'silent (item k)' text is unreachable: the RMS is clamped at 1e-12 and the samples are finite, "
                "so rms_dbfs is >= -240 (or +inf on overflow, never below a threshold): math.isfinite(r) is always "
                "true when the flag is raised")
_CO = "ditkit.cache.coefficients."
_EXISTING = "is_coefficient_file's where text: every CoefficientError is caught and False returned; the text is never seen"
_SAVE_WHAT = ("save's open_root(what=...): with parts=() SafeDir names `what` only when the folder cannot be opened "
              "after os.makedirs(exist_ok=True) made or found it (a race); no other message of save carries it")
_MORE_CANDS = ("a looser imaginary-part tolerance only adds evaluation points inside [lo, hi]; the polynomial's minimum "
               "there is at an end or a real critical point, both candidates already: the same minimum")
_AD = "ditkit.cache.adaln."
_PIN = ("pin_memory off for the parked host copy: pinning changes the kind of host memory (transfer speed), never a "
        "value; on a CPU device pin_memory is False either way")
_BOOLBYTES = "a bool tensor viewed as uint8 / read by numpy is the same 0 / 1 bytes as .to(torch.uint8)"
EQUIVALENT: dict[str, str] = {
    "ditkit.kernels.registry.xǁRegistryǁmenu__mutmut_3": _MENU_GROUPS,     # placeholder group 5
    "ditkit.kernels.registry.xǁRegistryǁmenu__mutmut_23": _MENU_GROUPS,    # group(i) <= 2
    "ditkit.kernels.registry.xǁRegistryǁmenu__mutmut_24": _MENU_GROUPS,    # group(i) < 3
    "ditkit.kernels.registry.xǁRegistryǁmenu__mutmut_26": _MENU_GROUPS,    # group(i) > 2
    "ditkit.kernels.registry.xǁRegistryǁmenu__mutmut_27": _MENU_GROUPS,    # group(i) >= 3
    "ditkit.kernels.registry.x_triton_check__mutmut_15": ("need_cuda(q) for need_cuda(q, (8, 0)): (8, 0) is "
                                                          "need_cuda's default"),
    "ditkit.guards.x_guard_node__mutmut_11": _ELSE_BRANCH,   # raw = None
    "ditkit.guards.x_guard_node__mutmut_19": _ELSE_BRANCH,   # isinstance(...) and False
    "ditkit.guards.x_guard_node__mutmut_21": _ELSE_BRANCH,   # getattr(None, "__func__", None)
    "ditkit.guards.x_guard_node__mutmut_26": _ELSE_BRANCH,   # "XX__func__XX"
    "ditkit.guards.x_guard_node__mutmut_27": _ELSE_BRANCH,   # "__FUNC__"
    "ditkit.sampling.fasth3_recipe.x_normalize_id__mutmut_17": ("split('@') vs split('@', 1): element [0] is the "
                                                                 "same string either way"),
    "ditkit.sampling.fasth3_recipe.x_normalize_id__mutmut_20": ("split('@', 2) vs split('@', 1): element [0] is "
                                                                 "the same string either way"),
    "ditkit.sampling.fasth3_recipe.x_load_provenance__mutmut_22": "'UTF-8' and 'utf-8' name the same codec",
    "ditkit.sampling.fasth3_recipe.x__id_candidates__mutmut_18": ("MODEL_IDS.get(... or 'XXXX') for or '': neither "
                                                                   "'' nor 'XXXX' is a release id, None either way"),
    "ditkit.sampling.fasth3_recipe.x_decide__mutmut_120": ("the else branch of said = ... if k2 in RECIPES: only the "
                                                            "contract's own candidates ('contract', 'contract_dense') "
                                                            "are not in RECIPES, and at strength 3 the contract is the "
                                                            "unique strongest, always cands[0], never a conflict"),
    "ditkit.sampling.fasth3_recipe.x_choose__mutmut_67": ("isclose without rel_tol=0 (default 1e-9): the checkpoint's "
                                                           "sparsity is < 1 (checked), so 1e-9 * max(|a|, |b|) exceeds "
                                                           "abs_tol 1e-9 only on a window narrower than 1e-18 just "
                                                           "above 1, which holds no pair of doubles"),
    # loaders/safe_fs.py (reviewed 2026-12-04)
    "ditkit.loaders.safe_fs.xǁSafeDirǁsubdir__mutmut_12": "os.mkdir's default mode is 0o777: the same folder mode",
    "ditkit.loaders.safe_fs.xǁSafeDirǁsubdir__mutmut_18": "os.mkdir's default mode is 0o777: the same folder mode",
    "ditkit.loaders.safe_fs.x__is_reparse__mutmut_11": ("getattr(st, 'st_file_attributes', 1): 1 & "
                                                       "FILE_ATTRIBUTE_REPARSE_POINT (0x400) is 0, as 0 is"),
    "ditkit.loaders.safe_fs.x__is_reparse__mutmut_14": ("stat.FILE_ATTRIBUTE_REPARSE_POINT is defined by every "
                                                       "Python's stat.py: the getattr default is never used"),
    "ditkit.loaders.safe_fs.x__is_reparse__mutmut_17": ("stat.FILE_ATTRIBUTE_REPARSE_POINT is defined by every "
                                                       "Python's stat.py: the getattr default is never used"),
    "ditkit.loaders.safe_fs.x__is_reparse__mutmut_20": ("stat.FILE_ATTRIBUTE_REPARSE_POINT is defined by every "
                                                       "Python's stat.py: the getattr default is never used"),
    "ditkit.loaders.safe_fs.x__write_chunk__mutmut_5": "cast('b') vs cast('B'): os.write writes the same bytes",
    "ditkit.loaders.safe_fs.x_read_fd__mutmut_14": "2 MiB read pieces instead of 1 MiB: the same bytes are returned",
    "ditkit.loaders.safe_fs.x_read_fd__mutmut_15": "2 MiB read pieces instead of 1 MiB: the same bytes are returned",
    "ditkit.loaders.safe_fs.x_validate_name__mutmut_22": "'UTF-8' and 'utf-8' name the same codec",
    "ditkit.loaders.safe_fs.x__rename2__mutmut_26": ("getattr(errno, 'EOPNOTSUPP') without a default: defined "
                                                    "wherever renameat2 exists (Linux: 95)"),
    "ditkit.loaders.safe_fs.x__rename2__mutmut_21": _EOP,
    "ditkit.loaders.safe_fs.x__rename2__mutmut_23": _EOP,
    "ditkit.loaders.safe_fs.x__rename2__mutmut_27": _EOP,
    "ditkit.loaders.safe_fs.x__rename2__mutmut_28": _EOP,
    "ditkit.loaders.safe_fs.x_open_model_file__mutmut_5": "O_CLOEXEC lost: " + _PEP446,
    "ditkit.loaders.safe_fs.xǁSafeDirǁopen_new__mutmut_3": "O_CLOEXEC lost: " + _PEP446,
    "ditkit.loaders.safe_fs.xǁSafeDirǁopen_read__mutmut_2": "O_CLOEXEC lost: " + _PEP446,
    "ditkit.loaders.safe_fs.xǁSafeDirǁopen_new__mutmut_4": ("O_NOFOLLOW and O_CLOEXEC lost: O_CREAT | O_EXCL never "
                                                           "follows a symlink (EEXIST, POSIX), and " + _PEP446),
    "ditkit.loaders.safe_fs.xǁSafeDirǁlstat__mutmut_4": _FALSY,
    "ditkit.loaders.safe_fs.xǁSafeDirǁpublish_noreplace__mutmut_18": _FALSY,
    "ditkit.loaders.safe_fs.xǁSafeDirǁpublish_noreplace__mutmut_47": _FALSY,
    "ditkit.loaders.safe_fs.xǁSafeDirǁpublish_noreplace__mutmut_50": _LINK,
    "ditkit.loaders.safe_fs.xǁSafeDirǁpublish_noreplace__mutmut_51": _LINK,
    "ditkit.loaders.safe_fs.xǁSafeDirǁfd_path__mutmut_1": ("'and' -> 'or' before the /proc test: with fd None or -1, "
                                                          "/proc/self/fd/None and /proc/self/fd/-1 never exist"),
    # vae/t1_decode.py (reviewed 2026-12-04)
    "ditkit.vae.t1_decode.x_tiled_decode_frame__mutmut_66": ("above = None: row 0 never reads it (i > 0 only) and "
                                                            "every later row reads the list the row before set"),
    "ditkit.vae.t1_decode.x_tiled_decode_frame__mutmut_69": ("tile = '' before the loops: always assigned before use;"
                                                            " with no tile at all both None and '' raise on .shape"),
    "ditkit.vae.t1_decode.x_tiled_decode_frame__mutmut_76": ("left = '' at a row start: read only for j > 0, after "
                                                            "left = right set it"),
    "ditkit.vae.t1_decode.x__check_latent__mutmut_17": ("check_latent_shape(shape, node) without 'samples': its "
                                                       "input_name default is 'samples'"),
    "ditkit.vae.t1_decode.x_unwhiten__mutmut_8": ("mean.view(-1, 1, 1, 1) vs view(1, -1, 1, 1, 1): against the 5-D "
                                                 "latent (checked) both broadcast over dim 1"),
    "ditkit.vae.t1_decode.x_unwhiten__mutmut_26": ("std.view(-1, 1, 1, 1) vs view(1, -1, 1, 1, 1): against the 5-D "
                                                  "latent (checked) both broadcast over dim 1"),
    "ditkit.guards.x_guard_node__mutmut_42": ("bind_partial(None, ...): only the value bound to execute's first "
                                              "parameter (cls) changes; no FLOAT input can have that name"),
    # loaders/quant_cache.py (reviewed 2026-12-04; names from the run in ~/.cache/ditkit/mutation/main-f2af6c09)
    "ditkit.loaders.quant_cache.x_digest_of__mutmut_5": _CAST,
    "ditkit.loaders.quant_cache.x_write__mutmut_35": _CAST,
    "ditkit.loaders.quant_cache.xǁDigestǁupdate__mutmut_5": _CAST,
    "ditkit.loaders.quant_cache.x_read_stamp__mutmut_27": _UTF8,
    "ditkit.loaders.quant_cache.x_source_key__mutmut_40": _UTF8,
    "ditkit.loaders.quant_cache.x_write_stamp__mutmut_7": _UTF8,
    "ditkit.loaders.quant_cache.x__sampled_sha256__mutmut_19": _SHORT_HEAD,   # ... if (len(head) == 8) or True else 0
    "ditkit.loaders.quant_cache.x__sampled_sha256__mutmut_28": _SHORT_HEAD,   # ... else 1
    "ditkit.loaders.quant_cache.x__sampled_sha256__mutmut_38": ("while pos <= hdr_end: at pos == hdr_end the pread asks for 0 bytes, gets "
                                         "b'' and the loop breaks: nothing more is hashed"),
    "ditkit.loaders.quant_cache.x__sampled_sha256__mutmut_51": "2 MiB header read pieces instead of 1 MiB: the same byte stream is hashed",
    "ditkit.loaders.quant_cache.x__sampled_sha256__mutmut_52": "2 MiB header read pieces instead of 1 MiB: the same byte stream is hashed",
    "ditkit.loaders.quant_cache.x__sampled_sha256__mutmut_55": ("return for break on a short header read: unreachable, hdr_end <= size so a "
                                         "pread below hdr_end never returns b'' on a file that is not shrinking"),
    "ditkit.loaders.quant_cache.x__sampled_sha256__mutmut_61": "data >= 0 for data > 0: with data == 0 the samples are 0 bytes, nothing hashed",
    "ditkit.loaders.quant_cache.x__sampled_sha256__mutmut_77": "max(2, SAMPLES - 1) for max(1, ...): SAMPLES - 1 is 63 either way",
    "ditkit.loaders.quant_cache.x_cache_location__mutmut_8": ("p.lstrip(os.sep) for rstrip(os.sep): a realpath has no trailing separator "
                                       "but '/', and basename ignores the leading ones"),
    "ditkit.bridge.quant_scales.x__same_bytes__mutmut_1": "shapes equal, element sizes differ, same device: a 1-byte a compares its n bytes "
        "with b's k*n (never equal); a wider a needs a.dtype == b.dtype, false for other element sizes",
    "ditkit.bridge.quant_scales.x__same_bytes__mutmut_27": "numel() / 8 == 0 only for an empty tensor: the byte comparison instead of the "
        "int64 one, the same answer (a speed path)",
    "ditkit.bridge.quant_scales.x__same_bytes__mutmut_31": "x.storage_offset() / 8 == 0 only at offset 0, where % 8 == 0 too: the int64 path "
        "taken less often, the same answer",
    "ditkit.bridge.quant_scales.x__same_bytes__mutmut_35": "y.storage_offset() / 8 == 0 only at offset 0: the int64 path taken less often, the "
        "same answer",
    "ditkit.bridge.quant_scales.xǁScaleSharingǁhook__mutmut_63": "pop(key) without a default: the key is present (get() found it just before)",
    "ditkit.bridge.quant_scales.xǁScaleSharingǁhook__mutmut_67": "trim(force=None): None and False are both false in `force and ...`",
    "ditkit.bridge.quant_scales.xǁScaleSharingǁhook__mutmut_69": "return for break: the loop is the function's last statement, which returns "
        "None",
    "ditkit.kernels.quant.x__dequant_slice_work__mutmut_41": _SLOT,
    "ditkit.kernels.quant.x__dequant_slice_work__mutmut_45": _SLOT,
    "ditkit.kernels.quant.x__dequant_slice_work__mutmut_46": _SLOT,
    "ditkit.kernels.quant.x__dequant_slice_work__mutmut_73": _SLOT,
    "ditkit.kernels.quant.x__dequant_slice_work__mutmut_77": _SLOT,
    "ditkit.kernels.quant.x__dequant_slice_work__mutmut_78": _SLOT,
    "ditkit.kernels.quant.x__dequant_slice_work__mutmut_93": _SLOT,
    "ditkit.kernels.quant.x__dequant_slice_work__mutmut_99": _SLOT,
    "ditkit.kernels.quant.x__dequant_slice_work__mutmut_100": _SLOT,
    "ditkit.loaders.quant_cache.x_source_key__mutmut_6": "a pool of 1 thread for n == 1: the same calls in order",
    "ditkit.loaders.quant_cache.x_source_key__mutmut_60": "'UTF-8' for 'utf-8': the same codec",
    "ditkit.loaders.quant_cache.x_cached_quantize__mutmut_80": "round(seconds, 4) for 3 in the hit report: a timing figure, not a result",
    "ditkit.loaders.quant_cache.x_read__mutmut_113": ("the stored digest sliced 33 bytes long: the digest tensor is the file's last 32 "
                               "bytes (checked), so the slice ends at the end of the map either way"),
    "ditkit.loaders.quant_cache.x_read__mutmut_6": _REPLACED,
    "ditkit.loaders.quant_cache.x_read__mutmut_7": _REPLACED,
    "ditkit.loaders.quant_cache.x_read__mutmut_15": _REPLACED,   # get(META_KEY, "XXXX"): invalid JSON as "" is
    "ditkit.loaders.quant_cache.x_read__mutmut_16": _REPLACED,
    "ditkit.loaders.quant_cache.x_read__mutmut_17": _REPLACED,
    "ditkit.loaders.quant_cache.x_read_stamp__mutmut_7": _STAMP_NONE,
    "ditkit.loaders.quant_cache.x_read_stamp__mutmut_13": _STAMP_NONE,   # read_inside's default class DitKitError is a ValueError: caught
    "ditkit.loaders.quant_cache.x_read_stamp__mutmut_16": _STAMP_NONE,
    "ditkit.loaders.quant_cache.x_read_stamp__mutmut_17": _STAMP_NONE,
    "ditkit.loaders.quant_cache.x_read_stamp__mutmut_20": _STAMP_NONE,
    "ditkit.loaders.quant_cache.x_read_stamp__mutmut_21": _STAMP_NONE,
    "ditkit.loaders.quant_cache.x_read_stamp__mutmut_29": _STAMP_NONE,
    "ditkit.loaders.quant_cache.x_read_stamp__mutmut_30": _STAMP_NONE,
    "ditkit.loaders.quant_cache.x_write_stamp__mutmut_23": ("SafeDir.open_root without error=QuantCacheError: its default DitKitError is "
                                     "caught by the same except (OSError, DitKitError) and reported with the same "
                                     "message text"),
    "ditkit.loaders.lokr_math.x_delta_weight__mutmut_11": _SAME_RANK,   # w2.dim() >= w1.dim()
    "ditkit.loaders.lokr_math.x_add_delta___mutmut_11": _SAME_RANK,     # w2.dim() >= w1.dim()
    "ditkit.loaders.lokr_math.x_add_delta___mutmut_46": "torch.cat(...) without dim=0: its default dim is 0",
    "ditkit.loaders.lokr_math.x_factorization__mutmut_11": "m < n for m <= n: at m == n both orders are (m, m)",
    "ditkit.loaders.lokr_math.x_factorization__mutmut_3": ("factor > 1 for factor > 0: factor 1 then takes the "
                                                          "search, whose bound m <= 1 stops at (1, dimension): the "
                                                          "pair the direct branch returns"),
    # the sum test never fires: below sqrt the sum of a divisor pair falls as m grows, and the first divisor above
    # sqrt is the partner of the last one below it (divisors pair up as x, d / x): the same sum, the same pair
    "ditkit.loaders.lokr_math.x_factorization__mutmut_32": _PAIR_SUM,   # new_m - new_n > length
    "ditkit.loaders.lokr_math.x_factorization__mutmut_33": _PAIR_SUM,   # >= length: stops one step early, same pair
    "ditkit.loaders.lokr_math.x_factorization__mutmut_34": ("new_m >= factor: a divisor equal to factor means factor "
                                                           "divides (the direct branch) or factor = dimension (-1), "
                                                           "reached only for a prime, whose pair is (1, d) either way"),
    "ditkit.loaders.lokr_math.x_factorization__mutmut_39": "m >= n swaps m == n: the same pair",
    "ditkit.loaders.lokr_math.x_rebuild_w2__mutmut_30": "einsum labels in upper case: the same contraction",
    "ditkit.vae.metadata.x_validate_image_vae_metadata__mutmut_163": ("floats('latents_mean', None) for False: the flag "
                                                                     "is read for its truth only; both are false"),
    "ditkit.loaders.host_memory.x\u01c1Scratch\u01c1take__mutmut_19": ("self._buf = '' for None before the new mapping: "
                                                                  "either drops the old mapping, then overwritten"),
    "ditkit.vae.preflight.x_check_latent_shape__mutmut_14": ("strip('XX[]XX') for strip('[]'): every dims text "
                                                            "starts with '[' and ends with ']' (never an 'X')"),
    "ditkit.loaders.lokr_math.x_rebuild_w2__mutmut_31": ("b.dim() >= 2: a 2-D w2_b through flatten(1) / reshape is "
                                                        "a @ b of the same shape"),
    # cache/audio_guard.py (reviewed 2026-12-05)
    _AG + "x__spectral_jump__mutmut_5": ("n <= n_fft + hop: at n == n_fft + hop there are 2 frames, 1 step, and "
                                         "max - median of one step is 0.0, the value returned early"),
    _AG + "x__spectral_jump__mutmut_22": "torch.hann_window's default is periodic=True: the same window",
    _AG + "x__spectral_jump__mutmut_29": "torch.fft.rfft's default dim is -1",
    _AG + "x__spectral_jump__mutmut_31": _LASTDIM2,
    _AG + "x__spectral_jump__mutmut_99": _LASTDIM2,
    _AG + "x_check_waveform__mutmut_60": _WHERE0,
    _AG + "x_check_waveform__mutmut_62": _WHERE0,
    _AG + "x_check_waveform__mutmut_87": _LASTDIM2 + " (rms_db is [B, C])",
    _AG + "x_check_waveform__mutmut_121": _LASTDIM2 + " (dc is [B, C])",
    _AG + "x_check_waveform__mutmut_127": _LASTDIM2 + " (clip is [B, C])",
    _AG + "x_check_waveform__mutmut_136": _LASTDIM2 + " (jumps is [B, C])",
    _AG + "x_check_waveform__mutmut_168": _DEAD_SILENT,
    _AG + "x_check_waveform__mutmut_172": _DEAD_SILENT,
    _AG + "x_check_waveform__mutmut_173": _DEAD_SILENT,
    _AG + "x_latent_spectrum_db__mutmut_56": _WHERE0,
    _AG + "x_latent_spectrum_db__mutmut_58": _WHERE0,
    _AG + "x_latent_spectrum_db__mutmut_67": "torch.fft.rfft's default dim is -1",
    _AG + "x_latent_spectrum_db__mutmut_68": _LASTDIM2 + " (t is reshaped to [rows, T])",
    # cache/coefficients.py (reviewed 2026-12-05)
    _CO + "x_is_coefficient_file__mutmut_2": _EXISTING,
    _CO + "x_is_coefficient_file__mutmut_5": _EXISTING,
    _CO + "x_is_coefficient_file__mutmut_6": _EXISTING,
    _CO + "x_parse_bytes__mutmut_8": _UTF8,
    _CO + "x_save__mutmut_16": _UTF8,
    _CO + "x_save__mutmut_8": "json.dumps(allow_nan=None): falsy, the same as False",
    _CO + "x_save__mutmut_20": _SAVE_WHAT,
    _CO + "x_save__mutmut_24": _SAVE_WHAT,
    _CO + "x_save__mutmut_28": _SAVE_WHAT,
    _CO + "x_save__mutmut_29": _SAVE_WHAT,
    _CO + "x_save__mutmut_30": _SAVE_WHAT,
    _CO + "x_polynomial_negative__mutmut_7": "np.asarray of Python floats is float64 without dtype=",
    _CO + "x_polynomial_negative__mutmut_9": "np.asarray of Python floats is float64 without dtype=",
    _CO + "x_polynomial_negative__mutmut_12": "np.trim_zeros upper-cases its trim argument: 'F' is 'f'",
    _CO + "x_polynomial_negative__mutmut_30": ("c[0] <= 0 for < 0: after trim_zeros('f') a non-empty c never starts "
                                              "with 0"),
    _CO + "x_polynomial_negative__mutmut_45": "x doubles from 1: 2**39 < 1e12 < 2**40, never equal to 1e12",
    _CO + "x_polynomial_negative__mutmut_46": "x doubles from 1: no power of two lies in [1e12, 1e12 + 1)",
    _CO + "x_polynomial_negative__mutmut_57": ("c.size >= 2: the derivative of a line is a constant, np.roots gives "
                                              "no root"),
    _CO + "x_polynomial_negative__mutmut_65": _MORE_CANDS,
    _CO + "x_polynomial_negative__mutmut_70": _MORE_CANDS,
    _CO + "x_polynomial_negative__mutmut_72": "a root exactly at lo: lo is a candidate already",
    _CO + "x_polynomial_negative__mutmut_73": "a root exactly at hi: hi is a candidate already (top = hi)",
    # cache/adaln.py (reviewed 2026-12-05)
    _AD + "x_fp32_bits__mutmut_3": ".tolist() copies to the host whatever the device: the same ints",
    _AD + "x_fp32_bits__mutmut_5": ".tolist() copies to the host whatever the device: the same ints",
    _AD + "x_tensor_key__mutmut_7": _BOOLBYTES,
    _AD + "x_tensor_key__mutmut_10": _BOOLBYTES,
    _AD + "xǁAdalnScheduleCacheǁ_park_one__mutmut_4": _PIN,
    _AD + "xǁAdalnScheduleCacheǁ_park_one__mutmut_7": _PIN,
    _AD + "xǁAdalnScheduleCacheǁ_park_one__mutmut_10": _PIN,
    _AD + "xǁAdalnScheduleCacheǁ_park_one__mutmut_11": _PIN,
    _AD + "xǁAdalnScheduleCacheǁunpark__mutmut_14": "Tensor.to's default is non_blocking=False",
    _AD + "xǁCachedAdalnProjǁsplit__mutmut_13": _LASTDIM2 + " (x is viewed as [M * modalities, expand * hidden])",
    # sampling/fasth3.py (reviewed 2026-12-05)
    "ditkit.sampling.fasth3.x_load_contract__mutmut_19": _UTF8,
}

_SKIP = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", "mutants", ".pytest_cache", ".ruff_cache",
                               ".hypothesis", "_out", ".tiny", ".whl", ".gl", "build", "dist", "*.egg-info")


def default_workdir() -> Path:
    """Outside the checkout (a copy of the pack inside it would be scanned by the pack's own tests): one folder per
    checkout under the user's cache."""
    import hashlib

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ditkit" / "mutation" / f"{REPO.name}-{hashlib.sha256(str(REPO).encode()).hexdigest()[:8]}"


def _module(arg: str) -> str:
    m = arg.removeprefix("./").removeprefix("ditkit/")
    if not m.endswith(".py"):
        m = m.replace(".", "/") + ".py"
    if not (REPO / m).is_file():
        raise SystemExit(f"mutation: no module {m} in {REPO}")
    return m


def _stage(module: str, tests: list[str], root: Path, tests_rev: str | None = None) -> list[str]:
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    shutil.copytree(REPO, root / "ditkit", ignore=_SKIP, symlinks=True)
    if tests_rev:   # the tests of another commit (e.g. main, for a "before" figure) against this code
        shutil.rmtree(root / "ditkit" / "tests")
        tar = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", tests_rev, "--", "tests"],
                             check=True, capture_output=True).stdout
        subprocess.run(["tar", "-xf", "-", "-C", str(root / "ditkit")], input=tar, check=True)
        # this checkout's conftest: the one that can run from a folder named ditkit (see tools/ docstring)
        shutil.copy2(REPO / "tests" / "conftest.py", root / "ditkit" / "tests" / "conftest.py")
        tests = [t for t in tests if (root / "ditkit" / t).is_file()]
        if not tests:
            raise SystemExit(f"mutation: none of the mapped tests exists at {tests_rev}")
    lst = lambda xs: "[" + ", ".join(json.dumps(x) for x in xs) + "]"
    (root / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        f"source_paths = {lst(['ditkit/' + module])}\n"
        f"pytest_add_cli_args_test_selection = {lst(['ditkit/' + t for t in tests])}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q"]\n'
        'also_copy = ["ditkit/"]\n'
        'process_isolation = "forkserver"\n'
        # the machine is shared: a mutant is a timeout only well past the clean run's time. mutmut 3.8 kills a
        # child after (estimate + constant) * multiplier wall seconds: >= 100 s here (40 / 20 made a mutant that
        # blocks on a FIFO hold a worker for 13+ minutes)
        "timeout_multiplier = 10.0\ntimeout_constant = 10.0\n"
        "use_git_change_detection = false\n", encoding="utf-8")
    return tests


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")
    env.pop("PYTHONPATH", None)
    return env


def _check_the_mutants_are_imported(root: Path, module: str, tests: list[str]) -> None:
    """The staged tests, with every function of the mutated module forced to raise, must fail; and the module they
    import must be the mutated copy. Run after mutmut generated the copy (mutants/ exists)."""
    work = root / "mutants"
    dotted = "ditkit." + module[:-3].replace("/", ".").removesuffix(".__init__")
    probe = work / "ditkit" / "tests" / "unit" / "test__mutation_probe.py"
    probe.write_text(
        "import importlib\n\n\n"
        "def test_probe():\n"
        f"    m = importlib.import_module({dotted!r})\n"
        "    print('MUTATION-PROBE', m.__file__)\n", encoding="utf-8")
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                              str(probe.relative_to(work))], cwd=work, env=_env(), capture_output=True, text=True)
        seen = [ln.split(None, 1)[1] for ln in out.stdout.splitlines() if ln.startswith("MUTATION-PROBE")]
        want = (work / "ditkit" / module).resolve()
        if not seen or Path(seen[0]).resolve() != want:
            raise SystemExit(f"mutation: the tests import {dotted} from {seen or out.stdout[-2000:]}, not the mutated "
                             f"copy {want}: every figure would be wrong")
        if "mutmut" not in want.read_text(encoding="utf-8"):
            raise SystemExit(f"mutation: {want} carries no mutmut trampoline")
    finally:
        probe.unlink(missing_ok=True)
    env = _env() | {"MUTANT_UNDER_TEST": "fail"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *["ditkit/" + t for t in tests]], cwd=work, env=env, capture_output=True, text=True)
    if out.returncode == 0:
        raise SystemExit("mutation: the tests pass with every trampoline of the module forced to fail: they do not "
                         "run the mutated copy")
    print(f"mutation: checked: the tests import {dotted} from the mutated copy and fail when it is forced to fail")


def _results(root: Path, module: str) -> dict:
    try:                                   # mutmut is a tool dependency only; the table moved between 3.x releases
        from mutmut.stats import status_by_exit_code
    except ImportError:
        from mutmut.__main__ import status_by_exit_code

    meta = json.loads((root / "mutants" / "ditkit" / (module + ".meta")).read_text(encoding="utf-8"))
    by = {}
    for name, code in meta["exit_code_by_key"].items():
        by.setdefault(status_by_exit_code[code], []).append(name)
    return by


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("module", nargs="?", help="module path relative to the package root, e.g. loaders/safe_fs.py")
    ap.add_argument("--tests", nargs="+", help="unit test files (default: the map in this script)")
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--workdir", type=Path, help="default: ~/.cache/ditkit/mutation/<checkout>-<hash>/<slug>")
    ap.add_argument("--list", action="store_true", help="print the module -> tests map and exit")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    ap.add_argument("--tests-from", metavar="REV", help="run the tests as they are at git REV (a 'before' figure)")
    ap.add_argument("--resume", action="store_true", help="go on with the last run in the workdir (no re-staging: "
                    "the mutants not yet checked are run with the tests staged then)")
    ap.add_argument("--recheck", type=Path, metavar="JSON", help="a previous --json summary of this module: restage "
                    "with the current tests and run only its mutants that were not killed (the code must be unchanged:"
                    " the mutant count is compared); the figure combines both runs")
    ap.add_argument("--only", nargs="+", metavar="GLOB", help="only the mutants whose names match (fnmatch, e.g. "
                    "'ditkit.kernels.quant.x_to_blocked__mutmut_*'): the functions a change touched in a module too "
                    "big to run whole; the summary counts those mutants alone and says so")
    ap.add_argument("--summary-only", action="store_true", help="summarize the last run in the workdir, run nothing")
    a = ap.parse_args(argv)
    if a.list or not a.module:
        for m, t in TESTS.items():
            print(f"{m}: {' '.join(t)}")
        return 0
    module = _module(a.module)
    tests = a.tests or TESTS.get(module)
    if not tests:
        raise SystemExit(f"mutation: no tests mapped for {module}; pass --tests")
    mutmut = Path(sys.executable).with_name("mutmut")
    if not mutmut.exists():
        raise SystemExit(f"mutation: {mutmut} missing: `{sys.executable} -m pip install mutmut` (3.x)")
    slug = module[:-3].replace("/", "__") + ("@" + a.tests_from.replace("/", "_") if a.tests_from else "")
    root = (a.workdir or default_workdir() / slug).resolve()
    if not a.summary_only:
        if not (a.resume and (root / "mutants").is_dir()):
            tests = _stage(module, tests, root, a.tests_from)
        prev = json.loads(a.recheck.read_text(encoding="utf-8")) if a.recheck else None
        names = prev["not_killed"] + prev.get("equivalent_names", []) if prev else []
        if a.only:
            names = [n for n in names if _matches(n, a.only)] if prev else list(a.only)
        if prev is not None and not names:
            raise SystemExit("mutation: the previous run left nothing to recheck")
        run = subprocess.run([str(mutmut), "run", "--max-children", str(a.max_children), *names], cwd=root,
                             env=_env())
        if not (root / "mutants" / "ditkit" / (module + ".meta")).exists():
            print(f"mutation: mutmut produced no results (exit {run.returncode})", file=sys.stderr)
            return 2
        _check_the_mutants_are_imported(root, module, tests)
    by = _results(root, module)
    if a.only:
        by = {s: [n for n in v if _matches(n, a.only)] for s, v in by.items()}
    total = sum(len(v) for v in by.values())
    every = {n for v in by.values() for n in v}
    if a.recheck:
        prev = json.loads(a.recheck.read_text(encoding="utf-8"))
        if prev["module"] != module or prev["mutants"] != total:
            raise SystemExit(f"mutation: {a.recheck} is for {prev['module']} with {prev['mutants']} mutants, this "
                             f"code has {total}: the code changed, run it whole")
        rechecked = set(prev["not_killed"]) | set(prev.get("equivalent_names", []))
        by = {s: [n for n in v if n in rechecked] for s, v in by.items()}
        by["killed"] = by.get("killed", []) + [f"(killed before) {i}" for i in range(prev["killed"])]
    killed = by.get("killed", [])
    names = {n for v in by.values() for n in v}
    equivalent = sorted(n for n in EQUIVALENT if n in names and n not in killed)
    stale = sorted(n for n in EQUIVALENT if n.startswith("ditkit." + module[:-3].replace("/", ".") + ".")
                   and n not in every and (not a.only or _matches(n, a.only)))
    counted = total - len(equivalent)
    rate = 100.0 * len(killed) / counted if counted else 0.0
    left = sorted(n for s, v in by.items() if s != "killed" for n in v if n not in equivalent)
    summary = {"module": module, "tests": tests, "only": list(a.only or []), "mutants": total, "killed": len(killed),
               "equivalent": len(equivalent), "equivalent_names": equivalent, "not_killed": left,
               "status": {s: len(v) for s, v in sorted(by.items())}, "kill_rate": round(rate, 1)}
    for name in left:
        status = next(s for s, v in by.items() if name in v)
        print(f"--- {status}: {name}")
        subprocess.run([str(mutmut), "show", name], cwd=root, env=_env())
    for name in stale:
        print(f"mutation: EQUIVALENT lists {name}, which no longer exists (re-review)")
    only = f" (only {', '.join(a.only)})" if a.only else ""
    print(f"| {module}{only} | {total} | {len(killed)} | {len(left)} | {len(equivalent)} | {rate:.1f} % |")
    print(json.dumps(summary))
    if a.json:
        a.json.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return 0 if rate >= 90.0 else 1


def _matches(name: str, globs) -> bool:
    """Whether mutant ``name`` matches one of ``globs`` (fnmatch, as mutmut matches the names given to ``run``)."""
    import fnmatch

    return any(fnmatch.fnmatchcase(name, g) for g in globs)


if __name__ == "__main__":
    raise SystemExit(main())
