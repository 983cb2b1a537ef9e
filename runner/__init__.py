"""The headless runner behind ``python -m ditkit.run`` and the integration tests, in one-way layers:

* ``common``        exit statuses, the runner's exceptions, the checkout path (imports nothing of the package);
* ``client``        HTTP / websocket client of a ComfyUI server: /prompt, progress, /history, /view downloads;
* ``server``        start and stop a headless ComfyUI (work dir, custom_nodes link, model paths YAML, tiny
                    checkpoints); uses ``client`` to wait for it;
* ``workflows``     API <-> UI workflow conversion, the example twins, ``python -m ditkit.workflows`` (schemas from
                    ``/object_info`` through ``client`` / ``server``);
* ``workflow_file`` read and check a workflow file before any server is involved;
* ``cli``           ``python -m ditkit.run``: arguments, the run, output lines, exit status.

Each module imports only the ones listed above it (``tests/unit/test_import_cycles.py`` checks the whole package
has no import cycle). Standard library only; no ComfyUI import.
"""

if "." not in __name__:  # the checkout's root is on sys.path: never shadow ComfyUI's `nodes` & co.
    raise ImportError(f"{__name__!r} is a subpackage of ditkit, not a top-level module: import ditkit.{__name__} "
                      "(remove the ditkit checkout's own folder from sys.path / PYTHONPATH)")
