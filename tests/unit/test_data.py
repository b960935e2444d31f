"""The packer's invariants and errors, the synthetic corpus, and the `datasets` adapter."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastsft_lab.data import (IGNORE_INDEX, Example, benchmark_batches, best_fit_decreasing,
                              pack_dataset, pack_examples, sample_lengths, synthetic_corpus, unpack,
                              validate_lengths)
from fastsft_lab.packing import normalize_row_lengths


def _examples(lengths, vocab=100):
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = tuple(torch.randint(4, vocab, (n,), generator=g).tolist())
        out.append(Example(ids, ids))
    return out


def _check_batch_invariants(batch, examples):
    B, T = batch.shape
    assert batch.labels.shape == batch.position_ids.shape == (B, T)
    for b in range(B):
        row = batch.seq_lengths[b]
        assert sum(row) == T
        start = 0
        for j, n in enumerate(row):
            # position ids restart at 0 in every segment
            assert batch.position_ids[b, start:start + n].tolist() == list(range(n))
            # each segment's first token takes no loss (it would be the previous segment's target)
            assert batch.labels[b, start].item() == IGNORE_INDEX
            start += n
        pad = batch.pad_lengths[b]
        if pad:
            assert (batch.labels[b, T - pad:] == IGNORE_INDEX).all()
            assert row[-1] == pad
    # every example lands exactly once, with its tokens intact
    runs = unpack(batch)
    ids = [i for row in batch.example_ids for i in row]
    assert len(runs) == len(ids)
    for run, i in zip(runs, ids):
        assert run.input_ids[0].tolist() == list(examples[i].input_ids)
        assert run.labels[0, 1:].tolist() == list(examples[i].labels[1:])


@given(st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=60), st.integers(64, 200))
@settings(max_examples=60, deadline=None)
def test_best_fit_decreasing_is_a_valid_packing(lengths, cap):
    bins = best_fit_decreasing(lengths, cap)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)
    # best fit never needs more than twice the lower bound
    lower = -(-sum(lengths) // cap)
    assert len(bins) <= max(1, 2 * lower)


@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=5), min_size=1, max_size=12), st.randoms())
@settings(max_examples=80, deadline=None)
def test_best_fit_decreasing_quality_on_instances_with_a_known_optimum(bins_spec, rnd):
    # Build an instance whose optimum is known: bins filled exactly to the capacity, then shuffled. Best-fit
    # decreasing is guaranteed at most 11/9 OPT + 6/9 bins (Dosa 2007); worst fit and first fit are not.
    cap = max(sum(b) for b in bins_spec)
    lengths = [x for b in bins_spec for x in b]
    pieces = [cap - sum(b) for b in bins_spec if sum(b) < cap]
    lengths += pieces                                  # every bin now sums to cap exactly: OPT = len(bins_spec)
    rnd.shuffle(lengths)
    opt = len(bins_spec)
    assert sum(lengths) == opt * cap
    bins = best_fit_decreasing(lengths, cap)
    assert len(bins) <= 11 * opt / 9 + 6 / 9


@pytest.mark.parametrize("lengths, cap, rows", [
    ([6, 5, 4, 3, 2], 10, [[0, 2], [1, 3, 4]]),        # worst fit puts 4 beside 5 and opens a third row
    ([7, 5, 3, 3, 2], 10, [[0, 2], [1, 3, 4]]),        # best fit puts the first 3 beside the 7 (3 left -> 0 left)
    ([50, 30, 30, 20, 20, 20, 15, 15], 100, [[0, 1, 3], [2, 4, 5, 6, 7]]),
])
def test_best_fit_decreasing_picks_the_tightest_row(lengths, cap, rows):
    assert [sorted(b) for b in best_fit_decreasing(lengths, cap)] == rows


@given(st.lists(st.integers(min_value=1, max_value=48), min_size=1, max_size=40), st.integers(1, 3))
@settings(max_examples=30, deadline=None)
def test_packed_batches_keep_every_token(lengths, rows):
    examples = _examples(lengths)
    batches = pack_examples(examples, 48, rows_per_batch=rows)
    seen = 0
    for batch in batches:
        _check_batch_invariants(batch, examples)
        seen += batch.num_sequences
    assert seen == len(examples)


@pytest.mark.parametrize("lengths", [[1], [1] * 32, [32], [31], [5, 27], [1, 1, 30]])
def test_edge_cases(lengths):
    examples = _examples(lengths)
    for batch in pack_examples(examples, 32):
        _check_batch_invariants(batch, examples)


def test_bad_lengths_raise_clear_errors():
    with pytest.raises(ValueError, match="empty"):
        validate_lengths([3, 0, 2], 8)
    with pytest.raises(ValueError, match="more than a packed row holds"):
        validate_lengths([3, 9], 8)
    with pytest.raises(ValueError, match="max_tokens"):
        validate_lengths([3], 0)
    with pytest.raises(ValueError, match="sum to 7 but the row holds 8"):
        normalize_row_lengths([(3, 4)], 8)
    with pytest.raises(ValueError, match="segment of length 0"):
        normalize_row_lengths([(8, 0)], 8)
    with pytest.raises(ValueError, match="more than a packed row holds"):
        pack_examples(_examples([10]), 8)
    with pytest.raises(ValueError, match="differ in length"):
        Example((1, 2, 3), (1, 2))


def test_synthetic_corpus_is_deterministic_and_realistic():
    a = synthetic_corpus(200, vocab_size=1000, seed=1)
    b = synthetic_corpus(200, vocab_size=1000, seed=1)
    assert a == b
    assert synthetic_corpus(5, vocab_size=1000, seed=2) != a[:5]
    totals = sorted(p + r for p, r in sample_lengths(4000, "realistic", seed=0))
    median = totals[len(totals) // 2]
    assert 250 < median < 500  # documented: median ~360 tokens, long tail
    assert totals[int(0.9 * len(totals))] > 2 * median
    for ex in a[:20]:
        n_prompt = sum(1 for lab in ex.labels if lab == IGNORE_INDEX)
        assert 0 < n_prompt < len(ex)  # loss on the response only
    with pytest.raises(ValueError, match="unknown length mix"):
        sample_lengths(3, "weird")


def test_benchmark_batches_have_the_requested_shape():
    batches = benchmark_batches(tokens_per_step=1024, row_tokens=512, steps=3, vocab_size=300, mix="short")
    assert len(batches) == 3
    for b in batches:
        assert b.shape == (2, 512)
        assert b.length_stats()["fill"] > 0.9
    with pytest.raises(ValueError, match="multiple"):
        benchmark_batches(tokens_per_step=1000, row_tokens=512, steps=1, vocab_size=300)


def _tiny_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(50)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(tmp_path / "tok")
    return PreTrainedTokenizerFast.from_pretrained(tmp_path / "tok")


def test_pack_dataset_through_a_local_tokenizer(tmp_path):
    from datasets import Dataset

    tok = _tiny_tokenizer(tmp_path)
    ds = Dataset.from_dict({
        "prompt": ["w1 w2 w3", "w4", "w5 w6"],
        "completion": ["w7 w8", "w9 w10 w11", "w12"],
    })
    batches = pack_dataset(ds, tok, max_tokens=16)
    runs = [r for b in batches for r in unpack(b)]
    assert sorted(r.length for r in runs) == [4, 5, 6]
    first = next(r for r in runs if r.length == 6)  # "w1 w2 w3" + "w7 w8" + eos
    assert first.input_ids[0].tolist() == tok("w1 w2 w3 w7 w8")["input_ids"] + [tok.eos_token_id]
    assert first.labels[0].tolist() == [IGNORE_INDEX] * 3 + tok("w7 w8")["input_ids"] + [tok.eos_token_id]

    text = Dataset.from_dict({"text": ["w1 w2", "w3 w4 w5"]})
    assert sum(b.num_real_tokens for b in pack_dataset(text, tok, max_tokens=8)) == 3 + 4
    with pytest.raises(ValueError, match="supported layouts"):
        pack_dataset(Dataset.from_dict({"foo": ["w1"]}), tok, max_tokens=8)
    with pytest.raises(ValueError, match="more than a packed row holds"):
        pack_dataset(text, tok, max_tokens=3)
    assert pack_dataset(text, tok, max_tokens=3, truncate=True)
