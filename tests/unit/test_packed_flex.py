"""The flex backend on its own (unit, CPU): the BlockMask tables built on the host equal create_block_mask's, rows
padded to whole blocks, its compiled frame kept apart from transformers' own flex compile, the recompile limit,
a foreign dispatch mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fastsft_lab.packing import PackedMetadata
from fastsft_lab.packing.backends import flex as FX
from fastsft_lab.profiling import SyncCounter

from _packed_helpers import per_sequence_reference, random_qkv


def test_flex_block_mask_is_padded_to_whole_blocks_and_checked():
    """Compiled flex cannot lower rows that are not whole 128-token blocks (T = 37 failed on the H200): the
    BlockMask covers a multiple of 128 with the tail as its own segment; a mask for other rows is refused."""
    meta = PackedMetadata.from_lengths([[30, 7]])
    bm = FX.block_mask(meta, "cpu")
    assert tuple(bm.seq_lengths) == (128, 128)
    q, k, v, _ = random_qkv(1, 37, grad=False)
    got = FX.flex_attention_packed(q, k, v, bm, scale=0.3)
    assert got.shape == (1, 37, 4, 8)
    ref = per_sequence_reference(q, k, v, meta.seq_lengths, 0.3, None, None)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    q2, k2, v2, _ = random_qkv(1, 200, grad=False)
    with pytest.raises(ValueError, match="covers 128 tokens, the rows have 200"):
        FX.flex_attention_packed(q2, k2, v2, bm, scale=0.3)


def _dense_tiles(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Ordered flex tables (rows, 1, nb[, nb]) -> the set of tiles as a dense bool (rows, nb, nb)."""
    rows, _, nb, width = idx.shape
    dense = torch.zeros(rows, nb, nb, dtype=torch.bool)
    for r in range(rows):
        for i in range(nb):
            dense[r, i, idx[r, 0, i, :num[r, 0, i]].long()] = True
    return dense


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.lists(st.integers(1, 150), min_size=1, max_size=12), min_size=1, max_size=3),
       window=st.sampled_from([None, 1, 5, 64, 128, 129, 300]))
def test_host_block_tables_equal_create_block_mask(rows, window):
    """The host-built tiles (no mask_mod over T x T, no compile, no device read) are exactly create_block_mask's:
    the same partial tiles, the same full tiles, for random packed rows (padding tails, rows that are not whole
    blocks, windows smaller and larger than a block)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from fastsft_lab._util import round_up as _round_up
    from fastsft_lab.packing.backends.flex import host_block_tables, mask_mod_for as _mask_mod

    t = max(sum(r) for r in rows)
    rows = [r + [t - sum(r)] if sum(r) < t else r for r in rows]          # a padding tail as its own segment
    meta = PackedMetadata.from_lengths(rows)
    w = None if window is None or window >= t else window
    pn, pi, fn, fi = host_block_tables(meta.seq_lengths, t, w)
    tp = _round_up(t, 128)
    ids = meta.tensors("cpu").seq_ids.view(meta.shape)
    ids = torch.cat([ids, ids.new_full((len(rows), tp - t), -1)], dim=1)
    ref = create_block_mask(_mask_mod(ids, w), len(rows), None, tp, tp, device="cpu")
    assert torch.equal(_dense_tiles(pn, pi), _dense_tiles(ref.kv_num_blocks, ref.kv_indices))
    assert torch.equal(_dense_tiles(fn, fi), _dense_tiles(ref.full_kv_num_blocks, ref.full_kv_indices))
    # and the BlockMask the metadata hands to flex carries them, with its backward (q-side) tables
    bm = FX.block_mask(meta, "cpu", window)
    assert torch.equal(_dense_tiles(bm.kv_num_blocks, bm.kv_indices), _dense_tiles(pn, pi))
    assert torch.equal(_dense_tiles(bm.full_q_num_blocks, bm.full_q_indices),
                       _dense_tiles(ref.full_q_num_blocks, ref.full_q_indices))
    assert torch.equal(_dense_tiles(bm.q_num_blocks, bm.q_indices), _dense_tiles(ref.q_num_blocks, ref.q_indices))


def test_host_block_mask_builds_without_touching_the_device_or_mask_mod(monkeypatch):
    """The cached path's BlockMask is made from host lengths: create_block_mask (T x T mask_mod evaluation, compiled
    on CUDA) is never called, and no sync happens."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: pytest.fail("create_block_mask was called"))
    meta = PackedMetadata.from_lengths([[300, 1, 211], [512]])
    with SyncCounter() as c:
        bm = FX.block_mask(meta, "cpu", 64)
    assert c.total == 0
    assert tuple(bm.seq_lengths) == (512, 512) and bm.kv_num_blocks.shape == (2, 1, 4)


def test_flex_refuses_a_foreign_dispatch_mode_and_keeps_working():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Tracer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    meta = PackedMetadata.from_lengths([[64, 64]])
    q = torch.randn(1, 2, 128, 16)
    bm = FX.block_mask(meta, "cpu")
    with torch.no_grad():
        ref = FX.flex_attention_packed(q, q, q, bm, scale=0.25)
        with Tracer(), pytest.raises(RuntimeError, match="cannot run under the TorchDispatchMode Tracer"):
            FX.flex_attention_packed(q, q, q, bm, scale=0.25)
        with SyncCounter(device="cpu") as c:                         # ours is handled
            got = FX.flex_attention_packed(q, q, q, bm, scale=0.25)
        assert torch.equal(got, ref) and c.total == 0
        assert torch.equal(FX.flex_attention_packed(q, q, q, bm, scale=0.25), ref)   # flex still works afterwards


@pytest.mark.inductor
def test_our_compiled_flex_leaves_flex_attentions_own_compile_state_alone():
    """transformers compiles ``flex_attention`` itself (dynamic shapes); dynamo keeps guards and shape state per code
    object. Our compiled flex must live on a frame of its own, so neither path's state reaches the other (on the H200,
    sharing it made a second row length fail for every flex caller: benchmarks/results/h200-2026-12-03)."""
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    try:
        meta = PackedMetadata.from_lengths([[64, 64]])
        q = torch.randn(1, 2, 128, 16)
        with torch.no_grad():
            got = FX._call_flex(FX.compiled_flex(), q, q, q, block_mask=FX.block_mask(meta, "cpu"))
        assert len(_debug_get_cache_entry_list(FX._flex_frame.__code__)) == 1
        assert len(_debug_get_cache_entry_list(flex_attention.__code__)) == 0
        ref = per_sequence_reference(q, q, q, meta.seq_lengths, 16 ** -0.5, None, None)
        torch.testing.assert_close(got.transpose(1, 2).double(), ref, rtol=1e-4, atol=1e-4)
    finally:
        torch._dynamo.reset()


@pytest.mark.inductor
def test_flex_recompile_limit_is_a_clear_error_not_a_silent_fallback(monkeypatch):
    """Past the compile limit, flex must not fall back to its eager T x T path without a word."""
    import torch._dynamo
    import torch._dynamo.config as dynamo_config
    compiled = FX.compiled_flex()
    torch._dynamo.reset()
    monkeypatch.setattr(FX, "FLEX_RECOMPILE_LIMIT", 1)
    try:
        with torch.no_grad(), dynamo_config.patch(recompile_limit=1):
            for i, t in enumerate((128, 256)):
                meta = PackedMetadata.from_lengths([[t // 2, t // 2]])
                q = torch.randn(1, 2, t, 16)
                if i == 0:
                    FX._call_flex(compiled, q, q, q, block_mask=FX.block_mask(meta, "cpu"))
                else:
                    with pytest.raises(RuntimeError, match="hit 1 recompilations.*varlen"):
                        FX._call_flex(compiled, q, q, q, block_mask=FX.block_mask(meta, "cpu"))
    finally:
        torch._dynamo.reset()
