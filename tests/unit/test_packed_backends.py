"""The packed attention kernels (unit): every backend against attention computed one sequence at a time (float64),
their gradients, their masks against transformers' own mask functions, random lengths, and what the registry's
attention function refuses."""

from __future__ import annotations

import pytest
import torch

from fastsft_lab.packing import BACKENDS, PackedMetadata, available_backends
from fastsft_lab.packing.backends import eager as E, flex as FX, sdpa as S, segments as SG, varlen as V, xformers as XF
from fastsft_lab.packing.backends.sdpa import naive_dense_mask

from _packed_helpers import make_batch, per_sequence_reference, random_qkv


# --- masks ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_dense_mask_has_transformers_semantics(window):
    """Same boolean mask as transformers' own mask functions: packed_sequence AND causal AND sliding window."""
    from transformers.masking_utils import and_masks, causal_mask_function, packed_sequence_mask_function, \
        sliding_window_causal_mask_function

    batch = make_batch()
    ids = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in batch.seq_lengths])
    base = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    fn = and_masks(base, packed_sequence_mask_function(ids))
    rows, t = ids.shape
    q = torch.arange(t)[:, None].expand(t, t)
    k = torch.arange(t)[None, :].expand(t, t)
    expected = torch.stack([fn(torch.tensor(r), torch.tensor(0), q, k) for r in range(rows)])[:, None]
    got = S.allowed(PackedMetadata.from_batch(batch), "cpu", window)
    assert torch.equal(got, expected)


def test_xformers_bias_matches_dense_mask():
    pytest.importorskip("xformers.ops.fmha.attn_bias")
    meta = PackedMetadata.from_lengths([[3, 9, 4], [16]])
    n = meta.num_tokens
    for window in (None, 2, 5):
        bias = XF.xformers_bias(meta, "cpu", window).materialize((n, n))
        allowed = torch.block_diag(*[m[0] for m in S.allowed(meta, "cpu", window).float()]).bool()
        assert torch.equal(bias == 0, allowed)


# --- kernels: every backend vs a per-sequence reference, random lengths --------------------------------------------
def run_backend(name, q, k, v, meta, scale, window, sinks):
    if name == "sdpa":
        mask = S.dense_mask(meta, "cpu", q.dtype, window, sink=sinks is not None)
        return S.sdpa_attention(q, k, v, mask, scale=scale, sinks=sinks)
    if name == "eager":
        return E.eager_attention(q, k, v, S.dense_mask(meta, "cpu", q.dtype, window), scale=scale, sinks=sinks)[0]
    if name == "varlen":
        return V.varlen_attention(q, k, v, meta.tensors("cpu").cu_seqlens, meta.max_seqlen, scale=scale,
                                  window=window, sinks=sinks)
    if name == "flex":
        with torch.no_grad():
            return FX.flex_attention_packed(q, k, v, FX.block_mask(meta, "cpu", window), scale=scale, sinks=sinks)
    if name == "segments":
        return SG.segments_attention(q, k, v, SG.segment_spans(meta), scale=scale, window=window, sinks=sinks)
    raise ValueError(name)


CASES = {
    "length-1 sequences": [[1, 1, 1, 1, 1, 1, 1, 1]],
    "one sequence": [[24]],
    "padding tail": [[7, 9, 3, 5], [20, 4]],
    "hundreds of short": [[1, 2, 3] * 60 + [2] * 40],
    # segments that cross 128-token tiles (flash kernels work in tiles: a max_seqlen one short cuts the last one)
    "across 128-token tiles": [[129, 257, 30]],
}


@pytest.mark.parametrize("sinks_on", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["sdpa", "eager", "varlen", "flex", "segments"])
def test_kernels_match_per_sequence_reference(backend, case, window, sinks_on):
    meta = PackedMetadata.from_lengths(CASES[case])
    q, k, v, sinks = random_qkv(meta.num_rows, meta.row_tokens, grad=False)
    sinks = sinks if sinks_on else None
    scale = 0.3
    got = run_backend(backend, q, k, v, meta, scale, window, sinks)
    ref = per_sequence_reference(q, k, v, meta.seq_lengths, scale, window, sinks)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("backend", ["sdpa", "varlen", "segments"])
def test_kernel_gradients_incl_sinks_match_eager(backend, window):
    """dq, dk, dv and d sink: the SDPA virtual sink key and the varlen (out', lse') backward are exact."""
    meta = PackedMetadata.from_lengths([[5, 1, 9, 3], [2, 16]])
    q, k, v, sinks = random_qkv(meta.num_rows, meta.row_tokens)
    dout = torch.randn(meta.num_rows, meta.row_tokens, 4, 8)
    ref = E.eager_attention(q, k, v, S.dense_mask(meta, "cpu", q.dtype, window), scale=0.35, sinks=sinks)[0]
    ref_grads = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    got = run_backend(backend, q, k, v, meta, 0.35, window, sinks)
    got_grads = torch.autograd.grad(got, (q, k, v, sinks), dout)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip("qkv", got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"d{name}")
    torch.testing.assert_close(got_grads[3], ref_grads[3], rtol=1e-4, atol=1e-5, msg="dsinks")


try:
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None


if given is not None:
    rows_strategy = st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=8), min_size=1, max_size=3)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(rows=rows_strategy, window=st.one_of(st.none(), st.integers(1, 6)), sinks_on=st.booleans(),
           pad=st.integers(0, 5))
    def test_property_random_lengths(rows, window, sinks_on, pad):
        t = max(sum(r) for r in rows) + pad
        seq_lengths = [r + [t - sum(r)] if t > sum(r) else r for r in rows]   # padding tail as its own segment
        meta = PackedMetadata.from_lengths(seq_lengths)
        assert meta.cu_seqlens[-1] == meta.num_tokens and meta.max_seqlen == max(meta.lengths)
        t_ = meta.tensors("cpu")
        assert torch.equal(t_.cu_seqlens[1:] - t_.cu_seqlens[:-1], torch.tensor(meta.lengths, dtype=torch.int32))
        q, k, v, sinks = random_qkv(meta.num_rows, meta.row_tokens, grad=False, seed=len(meta.lengths))
        sinks = sinks if sinks_on else None
        ref = per_sequence_reference(q, k, v, meta.seq_lengths, 0.4, window, sinks)
        for backend in ("sdpa", "varlen"):
            got = run_backend(backend, q, k, v, meta, 0.4, window, sinks)
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
        batch_pos = torch.tensor([[p for n in row for p in range(n)] for row in meta.seq_lengths])
        assert torch.equal(naive_dense_mask(batch_pos, torch.float32, window), S.dense_mask(meta, "cpu", torch.float32,
                                                                                              window))


def test_available_backends_say_why():
    status = available_backends("cpu")
    assert set(status) == set(BACKENDS)
    assert status["sdpa"].available and status["sdpa"].training
    assert status["varlen"].available and "reference" in status["varlen"].reason
    assert status["flex"].available and not status["flex"].training and "backward" in status["flex"].reason
    for name in ("xformers", "flash"):
        assert status[name].reason


# --- the registry's attention function: what it does not implement is refused --------------------------------------
def test_kv_cache_is_refused_clearly():
    q = torch.randn(1, 4, 1, 16)
    k = torch.randn(1, 2, 5, 16)
    from fastsft_lab.packing.registry import packed_attention

    with pytest.raises(RuntimeError, match="KV cache"):
        packed_attention("sdpa", torch.nn.Module(), q, k, k, None, packed_metadata=PackedMetadata.from_lengths([1]))


def test_an_unknown_attention_argument_is_refused():
    from fastsft_lab.packing.registry import packed_attention

    q = torch.randn(1, 2, 4, 8)
    meta = PackedMetadata.from_lengths([2, 2])
    out, _ = packed_attention("sdpa", torch.nn.Module(), q, q, q, None, packed_metadata=meta, use_cache=False)
    assert out.shape == (1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        packed_attention("sdpa", torch.nn.Module(), q, q, q, None, packed_metadata=meta, alibi_slopes=torch.ones(2))
    with pytest.raises(NotImplementedError, match="non-causal"):
        packed_attention("sdpa", torch.nn.Module(), q, q, q, None, packed_metadata=meta, is_causal=False)
