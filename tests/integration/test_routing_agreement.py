"""Why an MoE step's `vs ref` is large in bf16 (fastsft_lab.lab.routing): routing decisions counted per layer, the
reference's routing forced, on tiny GPT-OSS on the CPU."""

from __future__ import annotations

import pytest
import torch

from fastsft_lab import moe
from fastsft_lab.data import benchmark_batches
from fastsft_lab.lab import routing
from fastsft_lab.lab.harness import Variant, with_autocast
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _mode(name: str) -> Variant:
    return Variant(name, enable=lambda m: moe.set_moe_routing(m, name), disable=lambda m: moe.set_moe_routing(m, None))


@pytest.fixture(scope="module")
def tiny():
    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, seed=0, gradient_checkpointing=True,
                        lora=LoraSettings(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    for n, p in model.named_parameters():          # PEFT starts lora_B at zero: a real gradient path
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    batch = benchmark_batches(tokens_per_step=512, row_tokens=256, steps=1, vocab_size=256, mix="short")[0]
    return model.train(), batch


def test_in_float32_sync_free_equals_the_default_and_nothing_flips(tiny):
    model, batch = tiny
    a = routing.routing_agreement(model, batch, _mode("off"), _mode("sync_free"))
    assert a["flipped_tokens"] == [0, 0, 0, 0] and a["tokens"] == 512 and a["top_k"] == 2
    # the same sums in another order: float32 rounding of reductions over at most hidden = 64 terms (2 n u)
    bound = 2 * 64 * torch.finfo(torch.float32).eps
    assert a["free"]["rel"] < bound, a["free"]
    # nothing flipped: forcing the reference's routing changes nothing at all
    assert a["forced"] == a["free"]


def test_a_planted_flip_is_counted_and_forcing_the_reference_routing_undoes_it(tiny):
    model, batch = tiny
    router = decoder_layers(model)[1].mlp.router

    def plant(module, args, out):   # token 0 of layer 1 takes its (k+1)-th expert instead of its k-th
        logits, _, index = out
        k = index.shape[1]
        index = index.clone()
        index[0, -1] = logits[0].topk(k + 1).indices[-1]
        return logits, routing.routing_weights_at(module, logits, index), index

    handle = []
    planted = Variant("planted", enable=lambda m: handle.append(router.register_forward_hook(plant)),
                      disable=lambda m: handle.pop().remove())
    a = routing.routing_agreement(model, batch, Variant("reference"), planted)
    assert a["flipped_tokens"][0] == 0 and a["flipped_tokens"][1] >= 1, a["flipped_tokens"]
    assert not a["free"]["bitwise"]
    assert a["forced"]["bitwise"], a["forced"]          # the same routing, the same kernels: the reference exactly


def test_in_bf16_the_flips_are_counted_and_forcing_routes_every_token_as_the_reference(tiny):
    model, batch = tiny
    ref, other = with_autocast([_mode("off"), _mode("sync_free")], "bf16")
    a = routing.routing_agreement(model, batch, ref, other)
    assert a["logits_dtype"] == "bfloat16" and len(a["flipped_tokens"]) == 4
    # the count, again from the two runs' recorded routings
    routes = []
    for v in (ref, other):
        v.enable(model)
        with routing.record_routing(model) as seen, v.context(model):
            model(**batch.model_inputs()).loss.backward()
        v.disable(model)
        model.zero_grad(set_to_none=True)
        routes.append(dict(seen))
    assert a["flipped_tokens"] == [routing.flipped_tokens(routes[0][i]["index"], routes[1][i]["index"]) for i in range(4)]
    # with the reference's routing forced, the other kernel routes every token as the reference did
    other.enable(model)
    forced = {i: r["index"] for i, r in routes[0].items()}
    with routing.force_routing(model, forced), routing.record_routing(model) as seen, other.context(model):
        model(**batch.model_inputs()).loss.backward()
    other.disable(model)
    model.zero_grad(set_to_none=True)
    assert all(routing.flipped_tokens(seen[i]["index"], forced[i]) == 0 for i in range(4))


@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-qwen3-moe"])
def test_forced_weights_are_the_routers_own_at_its_own_choice(preset):
    model = build_model(preset, device="cpu", dtype=torch.float32, seed=0)
    router = routing.routers(model)[0]
    hidden = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits, weights, index = router(hidden)
    assert torch.equal(routing.routing_weights_at(router, logits.reshape(-1, logits.shape[-1]), index), weights)


def test_flipped_tokens_ignores_the_order_of_the_slots():
    a = torch.tensor([[0, 1], [2, 3], [4, 5]])
    assert routing.flipped_tokens(a, torch.tensor([[1, 0], [2, 3], [4, 6]])) == 1


def test_a_dense_model_has_no_routing_to_compare():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        routing.routers(model)
