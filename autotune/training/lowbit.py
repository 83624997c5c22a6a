"""bitsandbytes' 8-bit AdamW where bitsandbytes is not installed: its state from its layout, for a CUDA plan.

bitsandbytes trains on CUDA (its wheels for other platforms are recent), so a CUDA plan made on a laptop may name
``--optimizer bitsandbytes.optim:AdamW8bit`` where the package is absent. There, and only there (a dry run for
``--device cuda``), the plan trains with :class:`EightBitLayout`: an optimizer that makes, at its first step, the
tensors bitsandbytes' ``AdamW8bit`` makes (:mod:`autotune.training.state`'s layout constants, from
bitsandbytes/optim/optimizer.py's ``Optimizer2State.init_state``), and then changes nothing: bitsandbytes' CUDA kernel
updates the parameters and the state in place, holding nothing more. The report says the state was predicted from
the layout. Anywhere else a missing bitsandbytes is bad input (one line: ``pip install bitsandbytes``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from typing import Any

import torch

from autotune.plans.floor import EIGHT_BIT_BLOCK
from autotune.training.state import EIGHT_BIT_MIN_SIZE

__all__ = ["EightBitLayout", "EIGHT_BIT_NAMES", "stand_in", "StandIn"]

# The specs whose state EightBitLayout lays out: bitsandbytes' two-moment 8-bit optimizers (not the paged ones, whose
# state lives in CUDA's managed memory, outside the caching allocator a CUDA plan models)
EIGHT_BIT_NAMES = ("bitsandbytes.optim:AdamW8bit", "bitsandbytes.optim:Adam8bit", "bitsandbytes:optim.AdamW8bit",
                   "bitsandbytes:optim.Adam8bit")
_QMAP_ENTRIES = 256


class EightBitLayout(torch.optim.Optimizer):
    """The state bitsandbytes' ``AdamW8bit`` keeps, laid out as it lays it out, without its arithmetic (module
    docstring): two uint8 moments and a float32 absmax per block of 256 for a parameter of 4,096 entries or more, two
    float32 moments below that, the two 256-entry quantization maps once."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, min_8bit_size: int = EIGHT_BIT_MIN_SIZE, **_: Any) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "min_8bit_size": min_8bit_size})
        # made on the host now, as bitsandbytes makes them, and moved to the parameters' device at the first step
        self.name2qmap = {name: torch.zeros(_QMAP_ENTRIES, dtype=torch.float32) for name in ("dynamic", "udynamic")}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self._lay_out(p, group["min_8bit_size"])
        return closure() if closure is not None else None

    def _lay_out(self, p: torch.Tensor, min_8bit_size: int) -> None:
        state = self.state[p]
        if p.numel() < min_8bit_size:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
            return
        for name, qmap in self.name2qmap.items():
            self.name2qmap[name] = qmap.to(p.device)
        blocks = math.ceil(p.numel() / EIGHT_BIT_BLOCK)
        state.update(state1=torch.zeros_like(p, dtype=torch.uint8), qmap1=self.name2qmap["dynamic"],
                     state2=torch.zeros_like(p, dtype=torch.uint8), qmap2=self.name2qmap["udynamic"],
                     absmax1=torch.zeros(blocks, dtype=torch.float32, device=p.device),
                     absmax2=torch.zeros(blocks, dtype=torch.float32, device=p.device))


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # in sys.modules without a spec: None there means its import is blocked
        return sys.modules.get(package) is not None


@dataclasses.dataclass(frozen=True)
class StandIn:
    """The optimizer a search makes (``optimizer``: the spec as given, or a stand-in) and, for a stand-in, the notice
    that says so (``notice``; None: the spec as given)."""

    optimizer: Any
    notice: str | None = None


def stand_in(spec: Any, *, planned_cuda: bool) -> StandIn:
    """``--optimizer`` as given, or for a CUDA plan naming bitsandbytes' 8-bit AdamW where bitsandbytes is not
    installed, :class:`EightBitLayout` and the notice that says so."""
    if not planned_cuda or spec not in EIGHT_BIT_NAMES or _installed("bitsandbytes"):
        return StandIn(spec)
    return StandIn(EightBitLayout, f"--optimizer {spec}: bitsandbytes is not installed here, so its state is predicted "
                                   f"from its layout (8-bit moments, a float32 absmax per block of {EIGHT_BIT_BLOCK}, "
                                   f"32-bit moments for parameters under {EIGHT_BIT_MIN_SIZE:,} entries), not by "
                                   f"running it")
