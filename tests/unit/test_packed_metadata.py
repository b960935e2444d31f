"""PackedMetadata on its own (unit): host values, cu_seqlens and position ids, recovery from position_ids,
invalid lengths, immutability, and the naive path building the same objects as the cached one."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from fastsft_lab.packing import BuildLog, PackedMetadata
from fastsft_lab.packing.backends import sdpa as S
from fastsft_lab.packing.backends.sdpa import naive_dense_mask
from fastsft_lab.packing.backends.varlen import naive_varlen_args
from fastsft_lab.profiling import SyncCounter

from _packed_helpers import make_batch


def test_metadata_host_values_and_device_tensors():
    meta = PackedMetadata.from_lengths([[3, 5, 2], [4, 6]])
    assert meta.shape == (2, 10) and meta.lengths == (3, 5, 2, 4, 6)
    assert meta.cu_seqlens == (0, 3, 8, 10, 14, 20) and meta.max_seqlen == 6 and meta.num_segments == 5
    assert not meta._cache, "nothing is built before first use"
    with SyncCounter(device="cpu") as c:
        t = meta.tensors("cpu")
        S.dense_mask(meta, "cpu", torch.float32, 2)
    assert c.total == 0
    assert t.cu_seqlens.dtype == torch.int32 and t.cu_seqlens.tolist() == [0, 3, 8, 10, 14, 20]
    assert t.seq_ids.tolist() == [0] * 3 + [1] * 5 + [2] * 2 + [3] * 4 + [4] * 6
    assert t.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]
    with BuildLog() as log:
        assert meta.tensors("cpu") is t                   # cached: asking again builds nothing
    assert not log.cached and not log.naive
    flat = PackedMetadata.from_lengths([4, 4])
    assert flat.seq_lengths == ((4, 4),) and flat.row_tokens == 8


def test_metadata_from_batch_and_from_position_ids_agree():
    batch = make_batch()
    meta = PackedMetadata.from_batch(batch)
    assert meta.seq_lengths == batch.seq_lengths
    assert torch.equal(meta.tensors("cpu").position_ids, batch.position_ids)
    with SyncCounter(device="cpu") as c:
        recovered = PackedMetadata.from_position_ids(batch.position_ids)
    assert c.total == 1, "one read-back for the whole batch"
    assert recovered.seq_lengths == batch.seq_lengths
    right = torch.tensor([[1, 1, 1, 1, 0, 0]])
    m = PackedMetadata.from_position_ids(torch.tensor([[0, 1, 0, 1, 0, 0]]), attention_mask=right)
    assert m.seq_lengths == ((2, 2, 2),)
    with pytest.raises(ValueError, match="right-padded"):
        PackedMetadata.from_position_ids(None, attention_mask=torch.tensor([[0, 1, 1, 1]]))
    assert PackedMetadata.from_position_ids(None, shape=(2, 5)).seq_lengths == ((5,), (5,))


@pytest.mark.parametrize("lengths, row_tokens, match", [
    ([], None, "empty"),
    ([[]], None, "no segments"),
    ([[3, 0, 2]], None, ">= 1 token"),
    ([[3, -1]], None, ">= 1 token"),
    ([[3, 2], [4]], None, "sum to 4"),
    ([[3, 2]], 6, "sum to 5"),
    ([[3.5, 2]], None, "Python int"),
    ([[True, 2]], None, "Python int"),
    ([[torch.tensor(3), 2]], None, "Python int"),
    (torch.tensor([3, 2]), None, "not a tensor"),
])
def test_invalid_lengths_raise_clear_errors(lengths, row_tokens, match):
    with pytest.raises(ValueError, match=match):
        PackedMetadata.from_lengths(lengths, row_tokens)


def test_metadata_is_immutable_and_cannot_go_stale():
    lengths = [[3, 5, 2]]
    meta = PackedMetadata.from_lengths(lengths)
    with pytest.raises(dataclasses.FrozenInstanceError, match="read-only"):
        meta.seq_lengths = ((10,),)
    with pytest.raises(dataclasses.FrozenInstanceError, match="read-only"):
        del meta.lengths
    lengths[0][0] = 9  # the caller's list changes; the metadata copied it into tuples
    assert meta.seq_lengths == ((3, 5, 2),)
    mask = S.dense_mask(meta, "cpu", torch.float32)
    # A cache keyed on a tensor's identity (the bug class) would serve `mask` again after an in-place edit of the
    # lengths tensor. Ours has no tensor to edit; new lengths make a new object with its own, correct mask.
    other = PackedMetadata.from_lengths([[5, 5]])
    assert not torch.equal(S.dense_mask(other, "cpu", torch.float32), mask)
    restored = pickle.loads(pickle.dumps(meta))  # DataLoader workers: lengths travel, device caches do not
    assert restored.seq_lengths == meta.seq_lengths and not restored._cache


def test_naive_and_cached_build_the_same_objects():
    batch = make_batch()
    meta = PackedMetadata.from_batch(batch)
    for window in (None, 1, 3, 8, 500):
        for sink in (False, True):
            cached = S.dense_mask(meta, "cpu", torch.float32, window, sink=sink)
            naive = naive_dense_mask(batch.position_ids, torch.float32, None if window == 500 else window, sink=sink)
            assert torch.equal(cached, naive)
    cu, max_len = naive_varlen_args(batch.position_ids)
    assert cu.tolist() == list(meta.cu_seqlens) and max_len == meta.max_seqlen
