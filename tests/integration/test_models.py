"""Presets carry the published hyper-parameters; the builder makes real sizes without touching host memory."""

import json

import pytest
import torch

from fastsft_lab.models import PRESETS, LoraSettings, build_model, count_parameters, get_preset, make_config
from fastsft_lab.structure import base_model, decoder_layers

# Published config.json values (hub: Qwen/Qwen3-14B, Qwen/Qwen3-0.6B, openai/gpt-oss-20b, Qwen/Qwen3-30B-A3B).
PUBLISHED = {
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                      rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "gpt-oss-20b": dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, vocab_size=201088, num_local_experts=32,
                        num_experts_per_tok=4, sliding_window=128, rms_norm_eps=1e-5, attention_bias=True,
                        max_position_embeddings=131072),
    "qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          vocab_size=151936),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_presets_match_published_hyperparameters(name):
    cfg = make_config(name)
    for key, value in PUBLISHED[name].items():
        assert getattr(cfg, key) == value, f"{name}.{key}"


def test_gpt_oss_layout_and_rope():
    cfg = make_config("gpt-oss-20b")
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 12
    assert cfg.rope_parameters["rope_type"] == "yarn"
    assert cfg.rope_parameters["factor"] == 32.0
    assert cfg.rope_parameters["rope_theta"] == 150000.0
    assert make_config("qwen3-14b").rope_parameters["rope_theta"] == 1000000.0


@pytest.mark.parametrize("name,billions", [("qwen3-14b", 14.77), ("qwen3-0.6b", 0.596), ("gpt-oss-20b", 20.91),
                                           ("qwen3-30b-a3b", 30.53)])
def test_parameter_counts_on_meta_device(name, billions):
    # Built on the meta device: real architecture, no memory allocated anywhere.
    assert count_parameters(name) / 1e9 == pytest.approx(billions, abs=0.01)


def test_random_real_size_build_never_materializes_on_cpu():
    model = build_model("qwen3-14b", device="meta", num_layers=2)
    devices = {p.device.type for p in model.parameters()}
    assert devices == {"meta"}
    assert model.config.hidden_size == 5120 and model.config.num_hidden_layers == 2


def test_random_build_happens_on_target_device(monkeypatch):
    # The builder allocates under `with torch.device(target)`: check the device context reaches parameter creation.
    seen = []
    real_empty = torch.empty

    def spy(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        seen.append(t.device.type)
        return t

    monkeypatch.setattr(torch, "empty", spy)
    build_model("tiny-qwen3", device="meta")
    assert seen and set(seen) == {"meta"}


def test_num_layers_keeps_layer_pattern():
    cfg = make_config("tiny-gpt-oss", num_layers=3)
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="num_layers"):
        make_config("tiny-qwen3", num_layers=0)


def test_unknown_preset_and_bad_options_raise():
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("llama-7b")
    with pytest.raises(ValueError, match="weights"):
        build_model("tiny-qwen3", device="cpu", weights="zeros")
    with pytest.raises(ValueError, match="quant"):
        build_model("tiny-qwen3", device="cpu", quant="int3")


def test_qlora_tiny_trains_on_cpu():
    model = build_model("tiny-qwen3", device="cpu", quant="nf4", lora=LoraSettings(rank=4),
                        gradient_checkpointing=True)
    import bitsandbytes as bnb

    inner = base_model(model)
    q_proj = decoder_layers(model)[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, bnb.nn.Linear4bit)
    assert not isinstance(inner.lm_head, bnb.nn.Linear4bit)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.randint(4, 256, (1, 24))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad and "lora_A" in n]
    assert all(g is not None for g in grads)


def test_hub_path_loads_a_saved_tiny_checkpoint_with_nf4_and_lora(tmp_path):
    src = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, seed=3)
    src.save_pretrained(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["hidden_size"] == 64

    plain = build_model("tiny-qwen3", weights="hub", hub_path=str(tmp_path / "ckpt"), device="cpu",
                        dtype=torch.float32)
    ids = torch.randint(4, 256, (1, 16))
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, src(input_ids=ids).logits)

    qlora = build_model("tiny-qwen3", weights="hub", hub_path=str(tmp_path / "ckpt"), device="cpu",
                        quant="nf4", lora=LoraSettings(rank=4))
    out = qlora(input_ids=ids, labels=ids)
    out.loss.backward()
    assert qlora.fastsft_info.weights == "hub" and qlora.fastsft_info.quant == "nf4"
    # NF4 is lossy but close: same argmax for most positions on a random tiny model
    with torch.no_grad():
        ref = src(input_ids=ids).logits.float()
        got = qlora(input_ids=ids).logits.float()
    assert torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0) > 0.95


def test_hub_without_id_raises():
    with pytest.raises(ValueError, match="hub"):
        build_model("tiny-qwen3", weights="hub", device="cpu")


def test_every_preset_builds_on_meta():
    for name in PRESETS:
        model = build_model(name, device="meta", num_layers=1)
        assert model.config.num_hidden_layers == 1


def test_hub_nf4_on_a_cpu_is_refused_before_loading_anything():
    with pytest.raises(ValueError, match=r"qwen3-14b's weights in bfloat16 whole \(\d+ GiB\)"):
        build_model("qwen3-14b", weights="hub", quant="nf4", device="cpu", hub_path="/nonexistent")


def test_build_model_on_a_missing_cuda_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA device"):
        build_model("tiny-qwen3", device="cuda")
