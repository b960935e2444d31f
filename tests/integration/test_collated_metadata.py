"""Metadata prebuilt in the collator (PackedCollator(prebuild=...)): equal to the lazy path, through DataLoader
workers, pinned by DataLoader(pin_memory=True), copied without a sync, and still checked against its batch."""

from __future__ import annotations

import pickle

import pytest
import torch

from fastsft_lab.data import pack_examples, synthetic_corpus
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.packing import (BuildLog, PackedCollator, PackedMetadata, disable_packed_attention, enable_packed_attention,
                                 packed_inputs, prebuild_metadata)
from fastsft_lab.packing.backends import flex as FX, sdpa as S, xformers as XF
from fastsft_lab.profiling import SyncCounter

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")

BLOCK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                "full_q_num_blocks", "full_q_indices")
ROWS = {"one-row": [[30, 7, 91]], "padding-tail": [[300, 1, 211], [512]], "not-whole-blocks": [[100, 28, 2], [130]],
        "one-token-segments": [[1] * 20 + [236]]}


def assert_same_block_mask(got, want):
    assert tuple(got.seq_lengths) == tuple(want.seq_lengths) and tuple(got.BLOCK_SIZE) == tuple(want.BLOCK_SIZE)
    for f in BLOCK_FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), f


def assert_same_tensors(got, want):
    for f in ("cu_seqlens", "seq_ids", "position_ids"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), f


def make_batch(seed: int = 1, rows: int = 2, row_tokens: int = 128):
    # short sequences, two rows, padding tails (as tests/_packed_helpers.py's batches)
    ex = synthetic_corpus(12, vocab_size=256, mix="short", max_len=60, seed=seed)
    return pack_examples(ex, row_tokens, rows_per_batch=rows)[0]


def make_model(preset: str = "tiny-qwen3"):
    model = build_model(preset, device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), seed=0)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero, which would make every lora_A gradient zero
            torch.nn.init.normal_(p, std=0.05)
    return model


def examples(n=24, seed=0):
    return [{"input_ids": list(e.input_ids)} for e in synthetic_corpus(n, vocab_size=256, mix="short", max_len=60,
                                                                       seed=seed)]


# --- host tables == the lazy path's ---------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 5, 64, 200])
@pytest.mark.parametrize("case", list(ROWS))
def test_prebuilt_tables_equal_the_lazy_ones(case, window):
    lazy = PackedMetadata.from_lengths(ROWS[case])
    pre = prebuild_metadata(PackedMetadata.from_lengths(ROWS[case]), ("flex", "xformers", "varlen"),
                            windows=(None, window))
    pre = pickle.loads(pickle.dumps(pre))                    # as it leaves a DataLoader worker
    assert {("tensors",), ("flex", None)} <= set(pre.prebuilt)
    assert not pre._cache
    assert_same_tensors(pre.tensors("cpu"), lazy.tensors("cpu"))
    for w in (None, window):
        assert_same_block_mask(FX.block_mask(pre, "cpu", w), FX.block_mask(lazy, "cpu", w))
        assert torch.equal(S.dense_mask(pre, "cpu", torch.float32, w), S.dense_mask(lazy, "cpu", torch.float32, w))
    if ("xformers", None) in pre.prebuilt:                   # where xformers imports
        for w in (None, window):
            a, b = XF.xformers_bias(pre, "cpu", w), XF.xformers_bias(lazy, "cpu", w)
            assert type(a) is type(b) and a.q_seqinfo.seqstart_py == b.q_seqinfo.seqstart_py
            assert getattr(a, "_window_size", None) == getattr(b, "_window_size", None)


def test_the_prebuilt_parts_are_what_the_backends_use(monkeypatch):
    # the step must read the prebuilt host parts, not rebuild them: building the flex tables again fails, and on
    # the CPU the device tensors are the prebuilt host tensors themselves
    pre = prebuild_metadata(PackedMetadata.from_lengths(ROWS["padding-tail"]), "flex", windows=(None, 64))
    monkeypatch.setattr(FX, "host_block_tables", lambda *a, **k: pytest.fail("flex tables rebuilt in the step"))
    monkeypatch.setattr(FX, "flex_block_transpose", lambda: pytest.fail("flex tables rebuilt in the step"))
    with SyncCounter(device="cpu") as c, BuildLog() as log:
        assert pre.to("cpu") is pre
        masks = [FX.block_mask(pre, "cpu", w) for w in (None, 64)]
    assert c.total == 0
    assert log.cached["block_mask"] == 2 and not log.naive
    host = pre._host
    t = pre.tensors("cpu")
    assert t.cu_seqlens is host[("tensors",)][0] and t.seq_ids is host[("tensors",)][1]
    assert masks[1].kv_num_blocks.data_ptr() == host[("flex", 64)].data_ptr()   # a view of the prebuilt tables


def test_prebuilt_flex_tables_are_the_prebuilt_values():
    # a corrupted host table must show in the BlockMask: the backend uses the prebuilt tables as they are
    pre = prebuild_metadata(PackedMetadata.from_lengths([[200, 56]]), "flex")
    lazy = FX.block_mask(PackedMetadata.from_lengths([[200, 56]]), "cpu")
    pre._host[("flex", None)] = pre._host[("flex", None)].clone().fill_(0)
    with pytest.raises(AssertionError):
        assert_same_block_mask(FX.block_mask(pre, "cpu"), lazy)


# --- a model forward with prebuilt metadata == the lazy path ----------------------------------------------------
@pytest.mark.parametrize("backend", ["sdpa", "varlen", "eager", "flex"])
def test_model_with_collated_metadata_equals_the_lazy_path(backend, one_cpu_thread):
    model = make_model("tiny-qwen3")
    batch = make_batch()
    enable_packed_attention(model, backend)
    try:
        model.eval()
        grads = backend != "flex"                               # flex has no CPU backward
        outs = []
        for inputs in (packed_inputs(batch), packed_inputs(batch, prebuild=backend)):
            with torch.set_grad_enabled(grads):
                out = model(**inputs)
            if grads:
                model.zero_grad(set_to_none=True)
                out.loss.backward()
                outs.append((out.logits.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
            else:
                outs.append((out.logits, []))
        (lazy_logits, lazy_grads), (pre_logits, pre_grads) = outs
        assert torch.equal(pre_logits, lazy_logits)
        assert all(torch.equal(a, b) for a, b in zip(pre_grads, lazy_grads))
    finally:
        disable_packed_attention(model)


def test_collated_metadata_of_another_batch_is_refused():
    model = make_model("tiny-qwen3")
    a, b = make_batch(seed=1), make_batch(seed=2)
    assert a.shape == b.shape and a.seq_lengths != b.seq_lengths
    enable_packed_attention(model, "sdpa")
    try:
        with torch.no_grad():
            other = packed_inputs(b, prebuild="sdpa")["packed_metadata"]
            with pytest.raises(RuntimeError, match="does not describe this batch"):
                model(**{**a.model_inputs(), "packed_metadata": other})
    finally:
        disable_packed_attention(model)


# --- the collator in DataLoader workers -----------------------------------------------------------------------
def test_dataloader_workers_build_the_metadata(one_cpu_thread):
    from torch.utils.data import DataLoader

    data = examples()
    collate = PackedCollator(max_tokens=128, prebuild="flex", windows=(None, 8))
    loader = DataLoader(data, batch_size=6, num_workers=2, collate_fn=collate)
    got = list(loader)
    assert len(got) == 4
    for i, out in enumerate(got):
        meta = out["packed_metadata"]
        assert set(out) == {"input_ids", "labels", "position_ids", "packed_metadata"}
        assert {("tensors",), ("flex", None), ("flex", 8)} <= set(meta.prebuilt)   # built in the worker
        assert not meta._cache                                                      # nothing on a device yet
        want = PackedCollator(max_tokens=128)(data[6 * i:6 * i + 6])["packed_metadata"]
        assert meta.seq_lengths == want.seq_lengths
        assert_same_tensors(meta.tensors("cpu"), want.tensors("cpu"))
        assert torch.equal(meta.tensors("cpu").position_ids, out["position_ids"])
        for w in (None, 8):
            assert_same_block_mask(FX.block_mask(meta, "cpu", w), FX.block_mask(want, "cpu", w))


def test_collator_prebuild_option_and_errors():
    feats = examples(6)
    assert PackedCollator(max_tokens=128)(feats)["packed_metadata"].prebuilt == ()
    assert set(PackedCollator(max_tokens=128, prebuild=("sdpa", "varlen"))(feats)["packed_metadata"].prebuilt) == \
        {("tensors",)}                                          # they need only the shared tensors
    for bad in ("nope", True, ["sdpa", "nope"], []):
        with pytest.raises(ValueError, match="valid: sdpa, eager, varlen, flex"):
            PackedCollator(prebuild=bad)
    for bad in (0, -1, (None, 0), ("x",)):
        with pytest.raises(ValueError, match="windows"):
            PackedCollator(prebuild="flex", windows=bad)
    meta = PackedMetadata.from_lengths([[3, 5]])
    with pytest.raises(ValueError, match="CPU tensors"):
        meta.put_host(("x",), torch.zeros(2, device="meta"))


def test_accelerate_send_to_device_moves_the_metadata_and_keeps_it():
    # Trainer's accelerate-wrapped DataLoader calls send_to_device on each batch: it reaches PackedMetadata.to
    send_to_device = pytest.importorskip("accelerate.utils").send_to_device
    out = PackedCollator(max_tokens=128, prebuild="flex")(examples(6))
    meta = out["packed_metadata"]
    moved = send_to_device(out, torch.device("cpu"), non_blocking=True)
    assert moved["packed_metadata"] is meta
    assert ("tensors", torch.device("cpu")) in meta._cache
    assert meta.tensors("cpu").cu_seqlens is meta._host[("tensors",)][0]


def test_bench_scenario_collated_variant_and_its_switches(tmp_path, one_cpu_thread):
    from fastsft_lab.lab.scenarios import run_scenario

    common = dict(device="cpu", smoke=True, out_dir=str(tmp_path), steps=1, warmup=0, progress=False,
                  models="tiny-qwen3", backends="sdpa", tokens=256, stock=False)
    (res,) = run_scenario("packed", naive=False, **common)
    rows = {r["name"]: r for r in res["variants"]}
    assert list(rows) == ["sdpa cached", "sdpa cached (collated)", "sdpa oracle"]
    assert rows["sdpa cached (collated)"]["toggles"]["collated"] is True
    assert rows["sdpa cached (collated)"]["host_syncs_per_step"] == 0
    assert set(res["speedups"]) == {"cached_vs_oracle_step", "collated_vs_oracle_step"}
    (res,) = run_scenario("packed", collated=False, **common)
    assert [r["name"] for r in res["variants"]] == ["sdpa naive", "sdpa cached", "sdpa oracle"]
    assert "collated_vs_oracle_step" not in res["speedups"]


# --- CUDA: pinned by DataLoader(pin_memory=True), copied without a sync ---------------------------------------------
@pytest.mark.cuda
def test_cuda_dataloader_pins_the_metadata_and_the_step_copies_it_without_a_sync():
    from torch.utils.data import DataLoader

    collate = PackedCollator(max_tokens=512, prebuild="flex", windows=(None, 128))
    loader = DataLoader(examples(48), batch_size=12, num_workers=2, collate_fn=collate, pin_memory=True)
    seen = 0
    for out in loader:
        meta = out["packed_metadata"]
        assert out["input_ids"].is_pinned() and meta.is_pinned(), meta.prebuilt
        lazy = PackedMetadata.from_lengths(meta.seq_lengths)
        torch.cuda.synchronize()
        with SyncCounter(device="cuda", cross_check=True) as c:
            meta.to("cuda", non_blocking=True)
            tensors = meta.tensors("cuda")
            masks = [FX.block_mask(meta, "cuda", w) for w in (None, 128)]
        assert c.total == 0 and (c.cuda_reported or 0) == 0, c.cuda_messages
        assert tensors.cu_seqlens.device.type == "cuda" and masks[0].kv_indices.device.type == "cuda"
        assert_same_tensors(tensors, lazy.tensors("cuda"))
        for w, m in zip((None, 128), masks):
            assert_same_block_mask(m, FX.block_mask(lazy, "cuda", w))
        seen += 1
    assert seen == 4


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["sdpa", "varlen", "flex"])
def test_cuda_model_with_collated_metadata_equals_the_lazy_path(backend):
    from fastsft_lab.models import LoraSettings, build_model

    model = build_model("tiny-qwen3", device="cuda", dtype=torch.bfloat16, lora=LoraSettings(rank=4), seed=0)
    batch = make_batch().to("cuda")
    enable_packed_attention(model, backend)
    try:
        with torch.no_grad():
            lazy = model(**packed_inputs(batch)).logits
            inputs = packed_inputs(batch, prebuild=backend)
            inputs["packed_metadata"] = inputs["packed_metadata"].pin_memory().to("cuda")
            assert torch.equal(model(**inputs).logits, lazy)
    finally:
        disable_packed_attention(model)
