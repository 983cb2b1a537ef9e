"""The per-forward H3 modulation memo (``bridge/blocks.py``) without ComfyUI: reuse only for the same block and the
same ``t_emb`` object, a fresh memo per forward that the caller's ``transformer_options`` never sees."""
import torch

from ditkit.bridge.blocks import MEMO_KEY, ModulationMemo, block_modulation, memo_wrapper


class Proj(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, t):
        self.calls += 1
        return (t * 2.0, t + 1.0)


class Blk(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.adaln_proj = Proj()


def test_memo_reuses_only_the_same_block_and_t_emb_object():
    memo, a, b = ModulationMemo(), Blk(), Blk()
    t = torch.ones(2, 3)
    first = memo.get(0, a, t)
    assert memo.get(0, a, t) is first and a.adaln_proj.calls == 1
    memo.get(0, a, t.clone())            # equal values, another tensor: computed again
    assert a.adaln_proj.calls == 2
    memo.get(0, b, t)                    # another block module under the same index: computed
    assert b.adaln_proj.calls == 1
    got = memo.take(0, b, t)             # the block's own run takes the entry out
    assert b.adaln_proj.calls == 1 and torch.equal(got[0], t * 2.0)
    memo.get(0, b, t)
    assert b.adaln_proj.calls == 2


def test_block_modulation_without_memo_computes():
    blk, t = Blk(), torch.ones(1, 2)
    block_modulation({"t_emb": t, "transformer_options": {}}, blk, 0)
    block_modulation({"t_emb": t, "transformer_options": {}}, blk, 0)
    assert blk.adaln_proj.calls == 2


def test_wrapper_gives_each_forward_its_own_memo_and_clears_it():
    seen = []

    def executor(x, timestep, context, to, **kw):
        memo = to[MEMO_KEY]
        memo.get(0, Blk(), torch.ones(1))
        seen.append(memo)
        return x

    caller = {"sigmas": torch.ones(1)}
    memo_wrapper(executor, 1, 2, 3, caller)
    memo_wrapper(executor, 1, 2, 3, caller)
    assert MEMO_KEY not in caller, "the caller's transformer_options are not written"
    assert seen[0] is not seen[1] and not seen[0]._mods and not seen[1]._mods
    outer = ModulationMemo()
    memo_wrapper(executor, 1, 2, 3, {MEMO_KEY: outer})  # nested install: the outer memo is used
    assert seen[-1] is outer
