"""The model-family record (``fastsft_lab.families``): each record tells the truth about the live transformers modules
of its family, it is the single source of family knowledge in the library, and what it does not know is refused in
one line that names what it does know."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

from fastsft_lab.families import FAMILIES, Attention, experts_family, get_family, router_aux_loss, supported_families
from fastsft_lab.models import PRESETS, LoraSettings, ModelPreset, build_model, get_preset
from fastsft_lab.structure import decoder_layers, family_of
from fastsft_lab.moe import experts_modules, is_experts_module, set_moe_routing

from _source_helpers import code_lines

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

LIB = pathlib.Path(__file__).resolve().parents[2] / "fastsft_lab"
TINY = {p.family: p.name for p in PRESETS.values() if not p.real}   # the tiny preset of each family


def test_every_family_has_a_tiny_preset_and_every_preset_a_record():
    assert set(TINY) == set(FAMILIES)
    assert all(p.family in FAMILIES for p in PRESETS.values())
    assert supported_families() == "qwen3, gpt_oss, qwen3_moe, mixtral"
    for name, family in FAMILIES.items():
        assert family.name == name and get_family(name) is family
        assert get_preset(TINY[name]).family_record is family


# --- the record against the live modules -----------------------------------------------------------------------------
def _capture_attention():
    """An attention implementation that records each layer's ``sliding_window`` and whether it got sinks."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: list[tuple[int | None, bool]] = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        seen.append((kwargs.get("sliding_window"), kwargs.get("s_aux") is not None))
        kwargs.pop("s_aux", None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("fastsft_test_capture", capture)
    return "fastsft_test_capture", seen


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_record_matches_the_live_model(name):
    family = FAMILIES[name]
    impl, seen = _capture_attention()
    overrides = None
    if not get_preset(TINY[name]).config.get("sliding_window"):   # switch a window on, so that its source shows
        overrides = {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1}
    model = build_model(TINY[name], device="cpu", dtype=torch.float32, attn_implementation=impl,
                        config_overrides=overrides)
    config = model.config
    assert family_of(model) is family
    assert isinstance(config, family.config_type()) and config.model_type == family.name

    # attention: where the windows come from, sinks, no softcapping, the stock implementation
    with torch.no_grad():
        model(input_ids=torch.randint(4, 200, (1, 12)))
    assert [w for w, _ in seen] == family.layer_windows(config), "sliding windows per layer"
    assert (family.attention.windows != "none") == any(w is not None for w in family.layer_windows(config))
    assert {s for _, s in seen} == {family.attention.sinks}
    assert getattr(config, "attn_logit_softcapping", None) is None
    assert (family.attention.stock == "sdpa") == bool(type(model)._supports_sdpa)

    # experts: the class, its router, gate, weight layout; the routing weights' layout; the router loss
    assert hasattr(config, "router_aux_loss_coef") == family.router_aux_loss == router_aux_loss(config)
    mods = experts_modules(model)
    if family.experts is None:
        assert not mods and not family.is_moe
        return
    spec = family.experts
    assert len(mods) == len(decoder_layers(model)) and all(type(m).__name__ == spec.class_name for m in mods)
    block = decoder_layers(model)[0].mlp
    assert block.experts is mods[0] and callable(getattr(block, spec.router))
    m = mods[0]
    assert (m.is_transposed, m.has_bias) == (spec.transposed, spec.bias)
    if spec.gate == "gpt_oss_glu":
        assert not m.is_concatenated and hasattr(m, "alpha") and hasattr(m, "limit")
    else:
        assert m.is_concatenated and type(m)._apply_gate.__name__ == "_default_apply_gate"
    width = m.gate_up_proj.shape[2 if spec.transposed else 1] // 2
    assert m.gate_up_proj.shape[1:] == ((config.hidden_size, 2 * width) if spec.transposed
                                        else (2 * width, config.hidden_size))
    shapes = []
    hook = m.register_forward_pre_hook(lambda mod, args: shapes.append((args[1].shape, args[2].shape)))
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(4, 200, (1, 12)))
    finally:
        hook.remove()
    index, weights = shapes[0]
    assert index == (12, config.num_experts_per_tok)
    assert weights == (index if spec.routing_weights == "top_k" else (12, m.num_experts))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_records_lora_targets_adapt_the_model(name):
    model = build_model(TINY[name], device="cpu", dtype=torch.float32, lora=LoraSettings(rank=2))
    adapted = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(any(f"self_attn.{t}.lora_A" in n for n in adapted) for t in ("q_proj", "k_proj", "v_proj", "o_proj"))
    mlp = [n for n in adapted if ".mlp." in n]
    attention_only = set(FAMILIES[name].lora_targets) <= {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert bool(mlp) != attention_only, f"{name}: the record's LoRA targets adapt {mlp or 'no MLP weight'}"
    if FAMILIES[name].experts is not None and FAMILIES[name].experts.lora_parameters:
        experts = build_model(TINY[name], device="cpu", dtype=torch.float32,
                              lora=LoraSettings(rank=2, target_modules=["q_proj"], lora_experts=True))
        assert any("mlp.experts" in n and "lora" in n for n, p in experts.named_parameters() if p.requires_grad)


def test_lora_experts_is_offered_where_the_record_says():
    with pytest.raises(ValueError, match=r"lora_experts is implemented for the expert parameters of gpt_oss only"):
        build_model("tiny-mixtral", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=2, lora_experts=True))


# --- what the record does not know: one line naming what it knows ----------------------------------------------------
def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_an_unknown_model_type_is_refused_in_one_line_naming_the_families():
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64)
    llama = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError) as e:
        family_of(llama)
    assert _one_line(e) == ("unsupported model family 'llama' (LlamaForCausalLM): fastsft_lab's model-family record "
                            "knows qwen3, gpt_oss, qwen3_moe, mixtral")
    with pytest.raises(ValueError, match="unsupported model family 'llama'.*knows qwen3, gpt_oss, qwen3_moe, mixtral"):
        get_family("llama")
    with pytest.raises(ValueError, match="unsupported model family 'llama' \\(preset 'x'\\)"):
        ModelPreset(name="x", family="llama", config={})
    with pytest.raises(ValueError, match="no mixture-of-experts layers .*MixtralExperts \\(mixtral\\)") as e:
        set_moe_routing(llama, "grouped")
    _one_line(e)


def test_an_moe_family_without_a_record_is_not_routed():
    """OLMoE's experts go through the same transformers registry, but no record vouches for their layout: the switch
    refuses them (one line) instead of guessing from the module's attributes."""
    import transformers

    cfg = transformers.OlmoeConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64, num_experts=4, num_experts_per_tok=2)
    olmoe = transformers.AutoModelForCausalLM.from_config(cfg)
    assert not experts_modules(olmoe) and experts_family(olmoe.model.layers[0].mlp.experts) is None
    with pytest.raises(ValueError, match="no mixture-of-experts layers") as e:
        set_moe_routing(olmoe, "sync_free")
    assert "GptOssExperts (gpt_oss), Qwen3MoeExperts (qwen3_moe), MixtralExperts (mixtral)" in _one_line(e)


def test_a_record_is_frozen_and_a_family_without_one_is_taken_at_its_configs_word():
    import transformers

    assert not hasattr(Attention(windows="none", sinks=False, stock="sdpa"), "softcap")    # no family softcaps
    olmoe = transformers.OlmoeConfig()
    assert olmoe.model_type not in FAMILIES and router_aux_loss(olmoe) and not router_aux_loss(
        transformers.LlamaConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        FAMILIES["qwen3"].lora_targets = ()                                          # type: ignore[misc]


def test_experts_are_found_by_the_records_class_nf4_subclasses_included():
    from fastsft_lab.moe import quantize_experts_nf4

    model = build_model("tiny-mixtral", device="cpu", dtype=torch.float32)
    before = experts_modules(model)
    quantize_experts_nf4(model)
    assert experts_modules(model) == before and all(type(m).__name__ == "NF4MixtralExperts" for m in before)
    assert all(is_experts_module(m) and experts_family(m) is FAMILIES["mixtral"] for m in before)


# --- the single source ------------------------------------------------------------------------------------------------
_NAMES = "|".join(map(re.escape, FAMILIES))
_CLASSES = "|".join(re.escape(f.experts.class_name) for f in FAMILIES.values() if f.experts is not None)
# a comparison with a family's name, a family-name branch, an experts class named in code, or the attribute sniffing
# that found the experts and their gate before the record
FAMILY_BRANCH = re.compile(
    rf"\bfamily\s*(?:==|!=)|(?:==|!=)\s*[\"'](?:{_NAMES})[\"']|[\"'](?:{_NAMES})[\"']\s*(?:==|!=)"
    rf"|\bin\s*[(\[{{]\s*[\"'](?:{_NAMES})[\"']|[\"'](?:{_CLASSES})[\"']"
    r"|_default_apply_gate|[\"']is_concatenated[\"']|[\"']is_transposed[\"']\s+in\b"
    r"|hasattr\([^)]*[\"'](?:alpha|limit)[\"']")




def _checked_files():
    """The library (everything but the lab) and the lab's scenarios; the record itself aside."""
    for path in sorted(LIB.rglob("*.py")):
        rel = path.relative_to(LIB.parent).as_posix()
        if rel == "fastsft_lab/families.py":
            continue
        if rel.startswith("fastsft_lab/lab/") and not rel.startswith("fastsft_lab/lab/scenarios/"):
            continue
        yield rel, path


def test_the_record_is_the_single_source_of_family_knowledge():
    found = [f"{rel}:{i}: {code.strip()}" for rel, path in _checked_files() for i, code in code_lines(path)
             if FAMILY_BRANCH.search(code)]
    assert not found, "family branches or sniffing outside fastsft_lab/families.py (read the record):\n" + \
        "\n".join(found)


def test_the_single_source_check_would_catch_a_branch():
    for bad in ('if preset.family == "gpt_oss":', 'return "eager" if family == "gpt_oss" else "sdpa"',
                'if "qwen3_moe" != name:', 'if fam in ("qwen3", "gpt_oss"):', 'cls = "GptOssExperts"',
                'ok = hasattr(module, "alpha") and hasattr(module, "limit")',
                'return "is_transposed" in module.__dict__', 'getattr(module, "is_concatenated", True)'):
        assert FAMILY_BRANCH.search(bad), bad
    for fine in ('family_record = get_family(self.family)', 'name="qwen3-14b", family="qwen3"',
                 'if spec.gate == "gpt_oss_glu":'):
        assert not FAMILY_BRANCH.search(fine), fine
