"""DitKitActivationChunking in the real ComfyUI 0.33 host (in process, CPU, tiny H3, one thread): sampling with the
feed-forwards chunked over tokens is bit-identical (``torch.equal``) to the same pipeline unchunked, alone and
composed with TeaCache, sparse attention (VSA reference backend), a DiffSynth LoRA and quantize-on-load weights
(fp8 / int8). The oracle is the unchunked pipeline, run by ComfyUI's own MLP; the chunked path must have run
(counted feed-forward calls split into > 1 chunk), so an install that silently did nothing fails."""
from __future__ import annotations

import pytest
import torch

from ditkit.tiny import ckpt_h3 as c

CFG = c.CONFIG
MODEL = "h3_tiny_comfy.safetensors"
W = H_PX = 256
LENGTH, STEPS, TEXT = 22, 4, 10


@pytest.fixture(scope="module")
def env(comfy, tmp_path_factory):
    import folder_paths

    from ditkit.loaders.safetensors_io import save_file
    from ditkit.tiny.checkpoints import generate_all

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("chunking")
    generate_all(root, only=["h3_dit"])
    loras = root / "loras"
    loras.mkdir()
    g = torch.Generator().manual_seed(3)
    sd = {}
    for mod, o, n in (("blocks.1.mlp.fc1", 2 * CFG["ffn_hidden_size"], CFG["hidden_size"]),
                      ("blocks.0.mlp.fc2", CFG["hidden_size"], CFG["ffn_hidden_size"])):
        sd[f"{mod}.lora_A.default.weight"] = torch.randn(4, n, generator=g) * 0.1
        sd[f"{mod}.lora_B.default.weight"] = torch.randn(o, 4, generator=g) * 0.1
    save_file(sd, loras / "chunk_lora.safetensors")
    added = [("diffusion_models", str(root / "diffusion_models")), ("loras", str(loras))]
    for kind, p in added:
        folder_paths.add_model_folder_path(kind, p)
    yield root
    for kind, p in added:
        paths = folder_paths.folder_names_and_paths[kind][0]
        if p in paths:
            paths.remove(p)
        folder_paths.filename_list_cache.pop(kind, None)


_MODELS: dict = {}


def load(fmt=None):
    from ditkit.nodes.h3_loaders import DitKitH3ModelLoader

    if fmt not in _MODELS:
        _MODELS[fmt] = DitKitH3ModelLoader.execute(model_name=MODEL, **({"weight_format": fmt} if fmt else {}))
    return _MODELS[fmt].args[0]


def chunked(m, tokens=64):
    from ditkit.nodes.activation_chunking import DitKitActivationChunking

    return DitKitActivationChunking.execute(m, chunk_tokens=tokens).args[0]


def teacache(m):
    from ditkit.nodes.teacache import DitKitTeaCache

    return DitKitTeaCache.execute(m, "shipped:h3_tiny_calibrated", 0.3, 0.3, 0.0, 1.0, "model", False).args[0]


def vsa(m):
    from ditkit.nodes.sparse_attention import DitKitSparseAttention

    return DitKitSparseAttention.execute(m, recipe="custom", keep_percent=25.0, backend="reference").args[0]


def lora(m):
    from ditkit.nodes.adapters import DitKitAdapterLoader

    return DitKitAdapterLoader.execute(m, "chunk_lora.safetensors", 1.0).args[0]


def sample(model):
    import nodes
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    lat = EmptyMiniMaxH3LatentAV.execute(W, H_PX, LENGTH).result[0]
    cond = [[torch.randn(1, TEXT, CFG["text_dim"], generator=torch.Generator().manual_seed(0)), {}]]
    r = nodes.common_ksampler(model, 7, STEPS, 1.0, "euler", "simple", cond, cond, lat)[0]["samples"]
    return [t.clone() for t in r.unbind()]


def stats(m):
    from ditkit.bridge.chunking import WRAPPER_KEY

    return m.model_options["transformer_options"][WRAPPER_KEY]["stats"]


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), f"max |diff| {(x.double() - y.double()).abs().max()}"


@pytest.mark.parametrize("tokens", [16, 64, 100, 0])
def test_chunked_sampling_is_bit_identical(env, tokens):
    base = load()
    m = chunked(base, tokens)
    st = stats(m)
    out = sample(m)
    assert st.calls > 0
    if tokens:
        assert st.chunked_calls > 0 and st.chunks > st.chunked_calls   # the chunks really ran
    assert_same(out, sample(base))


@pytest.mark.parametrize("compose", ["teacache", "vsa", "lora", "all"])
def test_chunking_composes(env, compose):
    f = {"teacache": teacache, "vsa": vsa, "lora": lora, "all": lambda m: teacache(vsa(lora(m)))}[compose]
    base = load()
    m = chunked(f(base))
    out = sample(m)
    assert stats(m).chunked_calls > 0
    assert_same(out, sample(f(base)))
    # chunking applied first, the others after: same numbers too
    m2 = f(chunked(base))
    assert_same(sample(m2), out)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise"])
def test_chunking_on_quantized_weights(env, fmt):
    base = load(fmt)
    m = chunked(teacache(base))
    out = sample(m)
    assert stats(m).chunked_calls > 0
    assert_same(out, sample(teacache(base)))


def test_state_dict_keys_unchanged_and_refusals(env):
    from ditkit.errors import DitKitError
    from ditkit.nodes.activation_chunking import DitKitActivationChunking

    base = load()
    m = chunked(base)
    assert set(m.model_state_dict()) == set(base.model_state_dict())
    again = chunked(m, 32)     # re-chunking wraps the original module, not the wrapper
    from ditkit.bridge.chunking import ChunkedFeedForward

    wrapped = again.get_model_object("diffusion_model.blocks.0.mlp")
    assert isinstance(wrapped, ChunkedFeedForward) and not isinstance(wrapped.original, ChunkedFeedForward)
    for bad in (-1, True, 1.5):
        with pytest.raises(DitKitError, match="chunk_tokens"):
            DitKitActivationChunking.execute(base, chunk_tokens=bad)
    with pytest.raises(DitKitError, match="not an H3"):
        DitKitActivationChunking.execute(object(), chunk_tokens=16)


def heads(m, n=1, tokens=64):
    from ditkit.nodes.activation_chunking import DitKitActivationChunking

    return DitKitActivationChunking.execute(m, chunk_tokens=tokens, attention_heads_per_call=n).args[0]


@pytest.mark.parametrize("n", [1, 2])
def test_attention_head_groups_bit_identical(env, n):
    """The tiny H3 has 3 heads: groups of 1 and of 2 (+1) against ComfyUI's own attention on all heads at once."""
    from ditkit.bridge.chunking import ATTN_KEY

    base = load()
    m = heads(base, n)
    ov = m.model_options["transformer_options"][ATTN_KEY]
    out = sample(m)
    assert ov.grouped > 0                                   # the grouped path ran
    assert_same(out, sample(base))


def test_head_groups_compose_with_sparse_attention_and_teacache(env):
    from ditkit.errors import DitKitError

    base = load()
    m = teacache(vsa(heads(base, 1)))                       # VSA's dense calls go to the head groups
    assert_same(sample(m), sample(teacache(vsa(base))))
    with pytest.raises(DitKitError, match="before it"):
        heads(vsa(base), 1)                                 # the other order is refused, named


def _run_report(m):
    """Sample ``m`` with its chunking run report captured: ``(summary, data)`` of the one report the run sends."""
    from ditkit.bridge.chunking import WRAPPER_KEY

    got = []
    m.model_options["transformer_options"][WRAPPER_KEY]["report"] = (None, lambda *a: got.append(a))
    sample(m)
    assert len(got) == 1
    _, node, kind, summary, data = got[0]
    assert (node, kind) == ("DitKitActivationChunking", "activation_chunking")
    return summary, data


def test_run_report_counts_the_head_grouped_attention_calls(env):
    """Groups of 1 head on the 3-head tiny H3: the run report counts the attention calls that ran in groups (the
    override's own counters over the run) and says so in its summary."""
    from ditkit.bridge.chunking import ATTN_KEY

    m = heads(load(), 1)
    ov = m.model_options["transformer_options"][ATTN_KEY]
    c0, g0 = ov.calls, ov.grouped
    summary, data = _run_report(m)
    att = data["attention"]
    assert att == {"calls": ov.calls - c0, "grouped": ov.grouped - g0, "heads_per_call": 1}
    assert 0 < att["grouped"] <= att["calls"]
    assert summary.endswith(f"; attention: {att['grouped']}/{att['calls']} calls in groups of 1 heads")


def test_run_report_says_head_groups_had_no_effect(env):
    """Groups of 3 heads on a 3-head model split nothing: the run says so (never reported as head-grouped), and a
    chunking install without head groups has no attention line."""
    summary, data = _run_report(heads(load(), 3))
    att = data["attention"]
    assert att["grouped"] == 0 and att["calls"] > 0 and att["heads_per_call"] == 3
    assert summary.endswith(f"attention: 0/{att['calls']} calls in groups of 3 heads (no effect: no call was packed "
                            "[B, H, S, D] self-attention without a mask and with more heads than a group)")
    summary, data = _run_report(chunked(load()))
    assert "attention" not in data and "attention" not in summary


def test_head_groups_summary_each_case():
    from ditkit.bridge.chunking import head_groups_summary

    assert head_groups_summary(5, 5, 2) == "attention: 5/5 calls in groups of 2 heads"
    assert head_groups_summary(5, 1, 4) == "attention: 1/5 calls in groups of 4 heads"
    assert head_groups_summary(5, 0, 4) == ("attention: 0/5 calls in groups of 4 heads (no effect: no call was packed "
                                            "[B, H, S, D] self-attention without a mask and with more heads than a "
                                            "group)")
    assert head_groups_summary(0, 0, 1) == ("attention: 0/0 calls in groups of 1 heads (no effect: no attention call "
                                            "reached the head groups)")
