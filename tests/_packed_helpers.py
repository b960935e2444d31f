"""Shared by the packed-attention tests (tests/*/test_packed_*.py): the tiny LoRA models and packed batches they run, their LoRA
gradients, the attention computed one sequence at a time (the definition every packed kernel must match), and
tiny models of families that are not presets."""

from __future__ import annotations

import math
import warnings

import torch

from fastsft_lab.data import pack_examples, synthetic_corpus
from fastsft_lab.models import LoraSettings, build_model

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")

PRESETS = ["tiny-qwen3", "tiny-gpt-oss", "tiny-mixtral"]   # dense; windows + sinks + MoE; MoE (the family record's)


def make_batch(seed: int = 1, rows: int = 2, row_tokens: int = 128):
    # short sequences (some longer than GPT-OSS-tiny's window of 8), two rows, padding tails
    ex = synthetic_corpus(12, vocab_size=256, mix="short", max_len=60, seed=seed)
    return pack_examples(ex, row_tokens, rows_per_batch=rows)[0]


def make_model(preset: str, gradient_checkpointing: bool = False):
    model = build_model(preset, device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4),
                        gradient_checkpointing=gradient_checkpointing, seed=0)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero, which would make every lora_A gradient zero
            torch.nn.init.normal_(p, std=0.05)
    return model


def lora_grads(model, runs: list[dict]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for kwargs in runs:
        # num_items_in_batch=1: summed token losses, so the packed sum equals the sum over sequences
        model(**kwargs, num_items_in_batch=1).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_close_scaled(got: torch.Tensor, want: torch.Tensor, tol: float, what: str = "") -> None:
    """max |got - want| <= tol * max |want|: float32 sums over hundreds of tokens, in another order."""
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= tol * scale + 1e-12, f"{what}: max error {err:.3e} vs scale {scale:.3e}"


def per_sequence_reference(q, k, v, seq_lengths, scale, window, sinks):
    """Attention computed one segment at a time (float64), the definition the packed kernels must match."""
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    out = torch.zeros(b, t, h, d, dtype=torch.float64)
    for r, row in enumerate(seq_lengths):
        start = 0
        for n in row:
            qs = q[r, :, start:start + n].double()
            ks = k[r, :, start:start + n].double().repeat_interleave(groups, 0)
            vs = v[r, :, start:start + n].double().repeat_interleave(groups, 0)
            s = qs @ ks.transpose(-1, -2) * scale
            i = torch.arange(n)
            keep = i[None, :] <= i[:, None]
            if window is not None:
                keep = keep & (i[:, None] - i[None, :] < window)
            s = s.masked_fill(~keep, -math.inf)
            if sinks is not None:
                s = torch.cat([s, sinks.double().view(h, 1, 1).expand(h, n, 1)], dim=-1)
            p = torch.softmax(s, dim=-1)[..., :n]
            out[r, start:start + n] = (p @ vs).transpose(0, 1)
            start += n
    return out


def random_qkv(rows, t, h=4, hkv=2, d=8, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).requires_grad_(grad)  # noqa: E731
    return make(rows, h, t, d), make(rows, hkv, t, d), make(rows, hkv, t, d), make(h)


def _family(name: str, **extra):
    """A tiny model of a family that is not a preset, built with plain transformers (random weights, float32)."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
           "mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
           "gemma3": transformers.Gemma3TextConfig, "olmo2": transformers.Olmo2Config,
           "gemma2": transformers.Gemma2Config}[name]
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=256, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if name in ("mistral", "qwen2", "mixtral", "gemma3", "gemma2"):
        kw["sliding_window"] = 8                     # small, so that the test sequences cross it
    if name in ("qwen2",):
        kw["use_sliding_window"] = True
    if name in ("gemma3", "gemma2", "qwen3_moe"):
        kw["head_dim"] = 16
    if name in ("mixtral", "qwen3_moe"):
        kw.update(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    kw.update(extra)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.float32, attn_implementation="eager")
    model.config.use_cache = False
    return model.eval()
