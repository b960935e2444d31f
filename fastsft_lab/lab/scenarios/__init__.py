"""The benchmark scenarios, one file each (``python -m fastsft_lab bench --only NAME``)."""

from ..scenario import Scenario
from .attribution import AttributionScenario
from .breakdown import BreakdownScenario
from .budget import BudgetScenario
from .combined import CombinedScenario
from .distributed import DistributedScenario
from .moe import MoeScenario
from .offload import OffloadScenario
from .offload_link import OffloadLinkScenario
from .packed import PackedScenario

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (PackedScenario(), OffloadScenario(), MoeScenario(),
                                                       CombinedScenario())}
SCENARIOS[BreakdownScenario.name] = BreakdownScenario()      # after combined, whose models and variant it reuses
SCENARIOS[OffloadLinkScenario.name] = OffloadLinkScenario()  # after offload, whose variants it reuses
SCENARIOS[DistributedScenario.name] = DistributedScenario()
SCENARIOS[BudgetScenario.name] = BudgetScenario()
SCENARIOS[AttributionScenario.name] = AttributionScenario()

__all__ = ["SCENARIOS", "PackedScenario", "OffloadScenario", "MoeScenario", "CombinedScenario", "DistributedScenario",
           "BudgetScenario", "AttributionScenario"]


def run_scenario(name: str, *, device, smoke: bool, out_dir: str, steps: int | None = None,
                 warmup: int | None = None, progress: bool = True, **overrides) -> list[dict]:
    """Resolve ``name``'s options (its defaults for ``device`` and ``smoke``, then ``overrides``) and run it."""
    import torch

    try:
        scenario = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
    device = torch.device(device)
    opts = scenario.options(device, smoke, overrides, steps=steps, warmup=warmup)
    return scenario(opts, device=device, out_dir=out_dir, progress=progress)


__all__.append("run_scenario")
