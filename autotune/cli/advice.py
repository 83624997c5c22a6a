"""What the command line says when nothing fits (exit 3): the report's figures, then what to try, in flags.

The figures are the library's (:meth:`autotune.report.Report.shortfall`); the advice names the CLI's flags, so
it lives here. The API's :class:`~autotune.errors.NothingFits` says the figures alone.
"""

from __future__ import annotations

from autotune.report.shortfall import Shortfall
from autotune.units import format_bytes

__all__ = ["nothing_fits"]


def nothing_fits(short: Shortfall) -> str:
    """One line: why nothing fits, with figures, and the flags to try."""
    if short.probe_rejections:
        return (f"autotune: {short.why()}: try a larger --budget, a smaller --headroom, --probe-top to probe more "
                f"candidates, or --no-probe to take the short trials' answer")
    need = short.floor_need()
    tries = [text for lever, text in (
        ("all blocks", f"--segments all (batch 1 with every block recomputed needs about {format_bytes(need or 0)}, "
                       f"within the budget less its headroom)"),
        ("half", "--precisions with bf16 or fp16"),
        ("half state", "--precisions bf16-true (the weights, gradients and optimizer state in bf16: half the state, "
                       "updates below a weight's resolution lost) or an optimizer with less state (--optimizer "
                       "bitsandbytes.optim:AdamW8bit or torch.optim:Adafactor)"),
        ("checkpointing", "--segments auto"),
        ("batch 1", "smaller --batch-sizes"),
        ("offload", "--offload none,activations (what the plans keep for the backward pass held in host memory)"),
    ) if lever in short.untried]
    state = short.state_bytes
    if state and short.budget_bytes and short.sharded_ranks:  # a rank's share already: more ranks, or the host
        tries.append(f"sharding the training state ({format_bytes(state)} of weights, gradients and optimizer state) "
                     f"over more than {short.sharded_ranks} ranks" + (" (--world-size in a dry run)" if short.dry_run
                                                                       else "") + (
                         "" if short.hosted else ", or holding it in host memory with --offload none,state"))
    elif short.state_over_half:
        tries.append(f"sharding the training state ({format_bytes(state)} of weights, gradients and optimizer state, "
                     f"over half the budget) with --parallel fsdp under torchrun" + (
                         "" if short.hosted else ", or holding it in host memory there with --offload none,state"))
    tries.append("a larger --budget")
    return f"autotune: {short.why()}: try {', '.join(tries)}"
