"""Sequence parallelism (plain torch.distributed; no ComfyUI, no Raylight): the Ulysses all-to-all in yunchang's
``all_to_all_4D`` layout and the reducer that makes cache decisions identical on every rank.

* ``ulysses.py``  seq -> head and head -> seq all-to-all of ``[B, S, H, D]`` shards, the padded length Raylight
                  uses, the valid rows of a rank's shard;
* ``reduce.py``   :class:`~.reduce.Reducer`: sums over the sequence-parallel group, decisions over the world group
                  (TeaCache and every future cache decide through it).

The Raylight glue (inner-attention processor, registration) is host-side: ``bridge/raylight.py``.
"""

if "." not in __name__:  # the checkout's root is on sys.path: never shadow ComfyUI's `nodes` & co.
    raise ImportError(f"{__name__!r} is a subpackage of ditkit, not a top-level module: import ditkit.{__name__} "
                      "(remove the ditkit checkout's own folder from sys.path / PYTHONPATH)")
