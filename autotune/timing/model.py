"""A step's time from its work (:class:`~autotune.timing.counting.StepWork`) on a machine: a roofline per op.

Each op takes the longer of its compute time (its FLOPs at the machine's achieved rate for its class, dtype and
size) and its memory time (its bytes at the achieved bandwidth for its size), plus the host's overhead for
dispatching it (Python, the dispatcher, autograd's engine: per op, per phase). On the CPU the host does the work
too, so the two add; on a GPU the host runs ahead of the device, so the step takes the longer of the two. An
offloading plan's copies cross the host link (on a GPU overlapped with compute, on the CPU a memory copy), and
collectives cross the GPUs' link (overlapped with compute, as DDP's bucketed all-reduce and FSDP's prefetch are).

Achieved rates are curves (:class:`Rates`): points of (work per op, work per second) measured on this machine
(:mod:`autotune.timing.calibration`), or, for a card planned for, its data sheet's peaks at the efficiencies stated
in :data:`GPU_EFFICIENCY` (assumed, not measured). No torch.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import pathlib
from typing import TYPE_CHECKING, Any

from autotune.records import PREDICTED
from autotune.vocabulary import Status

if TYPE_CHECKING:
    from autotune.records import Measurement
    from autotune.timing.cards import Card
    from autotune.timing.counting import StepWork

__all__ = ["Rates", "Machine", "StepTime", "step_time", "roofline_s", "op_seconds", "card_machine", "GPU_EFFICIENCY", "with_predicted_time", "checked_error"]

# A card's achieved share of its data sheet's peaks on large ops, and the fixed time of one kernel, in seconds: a
# kernel of w work takes w / (share x peak) + latency. Assumed from public measurements (large bf16 GEMMs reach about
# 70-80% of the dense peak on A100 and H100, element-wise kernels 80-90% of the bandwidth; a launch costs a few
# microseconds); the host's eager dispatch, about 10 us an op, runs ahead of the device.
GPU_EFFICIENCY = {"matmul": 0.7, "conv": 0.6, "conv_backward": 0.5, "attention": 0.5, "memory": 0.8,
                  "latency_s": 4e-6, "host_op_s": 10e-6}


@dataclasses.dataclass(frozen=True)
class Rates:
    """An achieved throughput as a curve: ``points`` of (work per op, work per second), by ascending work; between
    points interpolated in log-log, beyond them the nearest point's rate."""

    points: tuple[tuple[float, float], ...]

    def at(self, work: float) -> float:
        """Work per second for an op of ``work`` (FLOPs or bytes)."""
        sizes = [p[0] for p in self.points]
        i = bisect.bisect_left(sizes, work)
        if i == 0:
            return self.points[0][1]
        if i == len(sizes):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        share = (math.log(work) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(y0) + share * (math.log(y1) - math.log(y0)))

    def to_list(self) -> list[list[float]]:
        return [list(p) for p in self.points]


@dataclasses.dataclass(frozen=True)
class Machine:
    """What a step's ops achieve on one machine: rates per op class and dtype, the host's overhead per op and
    phase, and its links (bytes per second; None where it has none)."""

    name: str  # "cpu" (this machine, calibrated) or a card's name
    compute: dict[str, dict[str, Rates]]  # op class (matmul, conv, conv_backward) -> dtype -> FLOP/s by FLOPs
    memory: dict[str, Rates]  # dtype -> bytes/s by bytes per op
    overhead_s: dict[str, float]  # phase -> the host's seconds per op
    overlapped: bool  # the host dispatches ahead of the device (a GPU): the step is the longer, not the sum
    host_link_bytes_per_s: float | None = None
    link_bytes_per_s: float | None = None  # between GPUs, one direction
    # "op/dtype" or "kind/dtype" -> measured time over the roofline's: an op's own efficiency (softmax, a depthwise
    # convolution), where calibration measured it; 1 elsewhere
    factors: dict[str, float] = dataclasses.field(default_factory=dict)
    scale: dict[str, float] = dataclasses.field(default_factory=dict)  # phase -> its ops' time, fitted (1 if absent)
    factor_from_s: float = 0.0  # ops the roofline prices below this keep their roofline time (their dispatch is the overhead's)
    source: str = ""  # how its figures were had: calibrated here (when), or a card's data sheet

    def compute_rate(self, kind: str, dtype: str, flops: float) -> float:
        table = self.compute.get(kind) or self.compute["matmul"]
        rates = table.get(dtype) or table.get("fp32") or next(iter(table.values()))
        return rates.at(flops)

    def memory_rate(self, dtype: str, nbytes: float) -> float:
        return (self.memory.get(dtype) or self.memory["fp32"]).at(nbytes)

    def factor(self, op: Any) -> float:
        """``op``'s measured time over its roofline time (1 where not calibrated)."""
        factors = self.factors
        return factors.get(f"{op.name}/{op.dtype}") or factors.get(f"{op.kind}/{op.dtype}") or 1.0

    def describe(self) -> dict[str, Any]:
        """The machine as a report records it: what made each figure."""
        return {"name": self.name, "source": self.source, "overlapped": self.overlapped,
                "overhead_s": dict(self.overhead_s), "factors": dict(self.factors),
                "compute": {k: {d: r.to_list() for d, r in t.items()} for k, t in self.compute.items()},
                "memory": {d: r.to_list() for d, r in self.memory.items()}}


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds, in all and per phase (``offload`` and ``collectives``: the part not hidden)."""

    step_s: float
    phases_s: dict[str, float]
    device_s: float  # the ops' own time
    host_s: float  # the host's dispatch

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "device_s": self.device_s, "host_s": self.host_s,
                "phases_s": {k: round(v, 9) for k, v in self.phases_s.items()}}


def roofline_s(machine: Machine, op: Any) -> float:
    """One ``op``'s seconds by the roofline alone: the longer of its compute and its memory time."""
    if op.kind in ("view", "collective"):
        return 0.0
    memory_s = op.bytes / machine.memory_rate(op.dtype, op.bytes) if op.bytes else 0.0
    compute_s = op.flops / machine.compute_rate(op.kind, op.dtype, op.flops / op.matrices) if op.flops else 0.0
    return max(compute_s, memory_s)


def op_seconds(machine: Machine, op: Any) -> float:
    """One ``op``'s price: its roofline, times its measured efficiency where the calibration measured one (and the
    roofline is above the dispatch's share)."""
    seconds = roofline_s(machine, op)
    return seconds * machine.factor(op) if seconds >= machine.factor_from_s else seconds


def _collective_s(machine: Machine, work: "StepWork", world_size: int) -> float:
    """Ring algorithms' bytes over the link: an all-reduce moves 2 (n - 1) / n of its bytes each way, a gather or a
    scatter (n - 1) / n of the whole."""
    link = machine.link_bytes_per_s
    if world_size <= 1 or not link:
        return 0.0
    share = (world_size - 1) / world_size
    return sum(op.count * op.bytes * share * (2 if "reduce" in op.name and "scatter" not in op.name else 1) / link
               for op in work.ops if op.kind == "collective")


def step_time(work: "StepWork", machine: Machine, *, world_size: int = 1) -> StepTime:
    """The predicted seconds of the step whose work is ``work``, on ``machine``, one rank of ``world_size``."""
    phases: dict[str, float] = {}
    device_s = host_s = 0.0
    for op in work.ops:
        seconds = op_seconds(machine, op) * op.count * machine.scale.get(op.phase, 1.0)
        host = machine.overhead_s.get(op.phase, machine.overhead_s.get("forward", 0.0)) * op.count
        device_s += seconds
        host_s += host
        phases[op.phase] = phases.get(op.phase, 0.0) + (seconds if machine.overlapped else seconds + host)
    compute_s = max(device_s, host_s) if machine.overlapped else device_s + host_s
    offload_s = 0.0
    if work.offload_bytes:  # each byte out and back
        if machine.host_link_bytes_per_s and machine.overlapped:
            offload_s = max(0.0, 2 * work.offload_bytes / machine.host_link_bytes_per_s - compute_s)
        else:
            offload_s = 2 * work.offload_bytes / machine.memory_rate("fp32", work.offload_bytes)
    collectives_s = _collective_s(machine, work, world_size)
    if machine.overlapped:
        collectives_s = max(0.0, collectives_s - compute_s)
    phases.update(offload=offload_s, collectives=collectives_s)
    return StepTime(compute_s + offload_s + collectives_s, phases, device_s, host_s)


def _card_rates(peak: float, share: float, latency_s: float) -> Rates:
    """A card's curve: an op of w work takes w / (share x peak) + latency."""
    return Rates(tuple((w, w / (w / (share * peak) + latency_s)) for w in (10.0 ** e for e in range(3, 15))))


def card_machine(card: "Card") -> Machine:
    """The machine a card's data sheet describes, at :data:`GPU_EFFICIENCY` (assumed: no card was measured here).
    fp32 matmuls run at the FP32 rate (PyTorch leaves TF32 off for matmuls), convolutions at TF32's (cuDNN's
    default)."""
    e, peaks = GPU_EFFICIENCY, card.peak_flops
    fp32 = peaks["fp32"] or 0.0
    halves = {d: peaks[d] or fp32 for d in ("bf16", "fp16")}
    compute = {}
    for kind in ("matmul", "conv", "conv_backward", "attention"):
        first = fp32 if kind == "matmul" else (peaks["tf32"] or fp32)
        compute[kind] = {d: _card_rates(p, e[kind], e["latency_s"]) for d, p in (("fp32", first), *halves.items())}
    memory = _card_rates(card.memory_bytes_per_s, e["memory"], e["latency_s"])
    return Machine(name=card.name, compute=compute, memory={"fp32": memory}, overlapped=True,
                   overhead_s={p: e["host_op_s"] for p in ("forward", "backward", "recompute", "optimizer")},
                   host_link_bytes_per_s=card.host_link_bytes_per_s,
                   link_bytes_per_s=card.nvlink_bytes_per_s / 2 if card.nvlink_bytes_per_s else card.host_link_bytes_per_s,
                   source=f"{card.title}: {card.source}; efficiencies assumed: {GPU_EFFICIENCY}")


def with_predicted_time(m: "Measurement", work: "StepWork", machine: Machine, *, world_size: int = 1) -> "Measurement":
    """``m`` (a prediction that ran to the end) with its step's time predicted from ``work`` on ``machine``: its
    ``step_s`` and ``samples_per_s`` (every rank's samples), ``time_source`` predicted, ``time_model`` the machine."""
    if m.status is not Status.OK:
        return m
    seconds = step_time(work, machine, world_size=world_size).step_s
    return dataclasses.replace(m, step_s=seconds, samples_per_s=m.batch_size * world_size / seconds,
                               time_source=PREDICTED, time_model=machine.name)


CHECKED_FILE = pathlib.Path(__file__).with_name("checked.json")


def checked_error(machine: str) -> dict[str, Any] | None:
    """What a benchmark measured of ``machine``'s predictions (``checked.json``, written from a committed results
    file): the median absolute error of the predicted step time and where it comes from; None where unchecked."""
    if not CHECKED_FILE.exists():
        return None
    return json.loads(CHECKED_FILE.read_text()).get(machine)
