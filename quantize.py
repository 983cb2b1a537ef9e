"""``python -m ditkit.quantize SRC OUT.safetensors --format FORMAT``: write a ComfyUI-loadable comfy_quant
checkpoint from a full-precision H3 (official shards, diffusers folder, ComfyUI file), LTX-2, Z-Image or FLUX.2
DiT, streaming.

* reads, converts (H3 layouts: qkv de-interleave, diffusers renames), quantizes and writes one tensor at a
  time: the safetensors header is laid out first from the shapes, then each tensor's bytes follow (peak RAM
  about one tensor and its float32 working copies);
* which layers are quantized follows the family's recipe (``loaders/quantize.py`` ``RECIPES``, weight-only, no
  activation scales); the report (per layer class: tensors quantized / kept, bytes, reconstruction error) is
  printed (the error measured while quantizing, on a sample of rows by default: ``--error full`` for all) and
  recorded in the file's metadata (``ditkit_quantize``) with the source files' SHA-256, the format
  and the recipe; ``_quantization_metadata`` lists the quantized layers (ComfyUI's checkpoint format);
* never overwrites: an existing OUT is refused before anything is read; the bytes go to a temp file in OUT's
  folder and are published by a no-replace rename, so a failure (out of disk, a bad tensor) leaves nothing;
* refused (exit 2, one line): an unknown format, a source already quantized in any scheme, a NaN/Inf weight
  (named), a model that is none of the four families.

Exit status: 0 written, 2 refused / bad arguments, 1 an OS error while writing (nothing left behind).
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time

from ._cli import run_cli
from .errors import DitKitError
from .kernels.quant import FORMATS
from .loaders import quantize as core
from .loaders.safe_fs import SafeDir, write_stream
from .loaders.safetensors_io import stream_chunks

FORMAT_VERSION = 1


def convert(src_path: str, out_path: str, fmt: str, *, hash_sources: bool = True, measure_error="sampled",
            log=print) -> tuple[str, core.QuantReport]:
    """The converter (also used by tests and benchmarks): -> (written path, report)."""
    if fmt not in FORMATS:
        raise DitKitError(f"--format {fmt!r} is not one of {sorted(FORMATS)}")
    out_path = os.path.abspath(out_path)
    folder, name = os.path.split(out_path)
    if not name.endswith((".safetensors", ".sft")):
        raise DitKitError(f"output '{out_path}' must end with .safetensors")
    if not os.path.isdir(folder):
        raise DitKitError(f"output folder '{folder}' does not exist")
    d = SafeDir.open_root(folder, error=DitKitError, what="output folder")
    try:
        if d.lstat(name) is not None:
            raise DitKitError(f"'{out_path}' already exists; ditkit never replaces a file (choose another name)")
        src = core.open_source(src_path)
        plan = core.make_plan(src.family, fmt, src.inventory, src.prefix)
        report = core.QuantReport(src.family, fmt, core.RECIPES[src.family]["source"])
        inv = plan.output_inventory()
        hashes = []
        for f in src.files:
            hashes.append({"name": os.path.basename(f), "bytes": os.path.getsize(f),
                           "sha256": core.file_sha256(f) if hash_sources else None})
        layers = plan.quantized_layers()
        record = {"version": FORMAT_VERSION, "format": fmt, "family": src.family, "recipe": report.recipe,
                  "activation_scales": "none (weight-only)", "source": {"path": os.path.basename(src.path),
                                                                        "files": hashes},
                  "quantized_layers": len(layers)}
        meta = {k: v for k, v in src.metadata.items() if k not in ("_quantization_metadata", "ditkit_quantize")}
        meta["ditkit_quantize"] = json.dumps(record, sort_keys=True)
        meta["_quantization_metadata"] = json.dumps({"format_version": "1.0",
                                                     "layers": {layer: {"format": fmt} for layer in layers}})
        t0 = time.monotonic()
        items = core.quantize_stream(src.reader(scratch_keys=plan.quantized_keys()), plan, report, src.path, measure_error=measure_error)
        path = write_stream(d, name, stream_chunks(inv, items, meta, where=out_path))
        log(f"wrote {path} in {time.monotonic() - t0:.1f} s")
        return path, report
    finally:
        d.close()


def main(argv=None) -> int:
    """The CLI; Ctrl-C / SIGTERM remove the partial output and end with one line (exit 130 / 143)."""
    return run_cli(_main, argv, "python -m ditkit.quantize", "the partial output file was removed")


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ditkit.quantize", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="H3 folder (official / diffusers) or a .safetensors DiT (H3, LTX-2, Z-Image, FLUX.2)")
    ap.add_argument("out", help="new .safetensors file (its folder must exist; never overwritten)")
    ap.add_argument("--format", required=True, choices=sorted(FORMATS), help="ComfyUI QUANT_ALGOS format")
    ap.add_argument("--no-hash", action="store_true", help="do not hash the source files (metadata says null)")
    ap.add_argument("--error", choices=core.ERROR_MODES, default="sampled",
                    help="reconstruction error reported: measured on about 1/8 of each weight's rows (sampled, the "
                         "default), on every row (full), or not at all (off); measured while quantizing")
    a = ap.parse_args(argv)
    try:
        _, report = convert(a.src, a.out, a.format, hash_sources=not a.no_hash, measure_error=a.error)
    except DitKitError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        why = "out of disk space" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        print(f"ERROR: writing '{a.out}' failed ({why}); nothing was written", file=sys.stderr)
        return 1
    print(report.summary())
    for name, c in report.classes.items():
        d = c.as_dict()
        err = (f", rel. RMS error {d['rel_rms_error']:.3e} (rows measured {d['error_rows']})"
               if "rel_rms_error" in d else "")
        print(f"  {name}: {c.quantized}/{c.tensors} quantized, {c.bytes_in} -> {c.bytes_out} bytes{err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
