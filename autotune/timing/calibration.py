"""The machine at hand, measured once and cached: what its ops achieve, as a :class:`~autotune.timing.model.Machine`.

On the CPU (the only device calibrated so far): matrix multiplications per dtype and size, an element-wise op's
bandwidth per size (the roofline's two rates); then, over the training steps of a small suite of torch.nn models
(none of the bundled ones, which check it), each op's measured time over its roofline time (its efficiency: a
softmax, a depthwise convolution), and per phase a scale of the ops' own time and the host's overhead per op, fitted
by least squares (a recomputed op's overhead from the suite's checkpointed models). Each figure is the fastest of
repeated runs, at the threads torch uses now. The result is cached as JSON (a plain record: numbers and names),
keyed by the processor, the thread count and torch's version, under ``$AUTOTUNE_CACHE_DIR`` or
``~/.cache/autotune``; a second dry run reads it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import statistics
import time
from typing import Any, Callable

import torch
import torch.utils.checkpoint

from torch.utils._python_dispatch import TorchDispatchMode

from autotune.timing.counting import OpWork, StepWork, WorkCounter, op_work
from autotune.timing.model import Machine, Rates, roofline_s, step_time

__all__ = ["this_cpu", "calibrate_cpu", "cache_path", "OpTimes"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_GEMM_SIZES = (32, 128, 384, 1024)
_SUITE_BATCHES = (2, 16)
_SUITE_REPEATS = 10
_DROPOUT = 0.1  # GPT-2's and BERT's attention and residual dropout
_MIN_OP_S = 20e-6  # an op priced below this by the roofline is mostly dispatch: its efficiency is not measured
_ELEMENTS = (1 << 12, 1 << 16, 1 << 20, 1 << 24)
_VERSION = 10  # of the calibration's method: a cache of another is measured again


def _seconds(fn: Callable[[], Any], *, budget_s: float = 0.1, run_s: float = 1e-3, runs: int = 5) -> float:
    """The seconds of one call of ``fn``: the fastest of many short runs (at least ``runs``, until ``budget_s`` is
    spent). The fastest, not the median, and short runs: other processes on the machine only ever slow a run down,
    and a short run is more often left alone by them."""
    fn()
    began = time.perf_counter()
    fn()
    calls = max(1, int(run_s / max(time.perf_counter() - began, 1e-7)))
    best, spent, done = float("inf"), 0.0, 0
    while done < runs or (spent < budget_s and done < 500):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        took = time.perf_counter() - began
        best, spent, done = min(best, took / calls), spent + took, done + 1
    return best


def _work(fn: Callable[[], Any]) -> tuple[int, int, int]:
    """FLOPs, bytes and ops of one call of ``fn``."""
    with WorkCounter() as counter:
        fn()
    ops = counter.work().ops
    return (sum(o.flops * o.count for o in ops), sum(o.bytes * o.count for o in ops), sum(o.count for o in ops))


def _rate(fn: Callable[[], Any], dispatch_s: float, flops: bool) -> tuple[float, float] | None:
    """(work per op, work per second) of ``fn``'s one op: its FLOPs or its bytes, the dispatch taken off; None where
    the op's own time is less than its dispatch's (what is left is noise: a 32x32 fp32 matmul here, whose rate came
    out as its FLOPs over the nanosecond floor, 65 TFLOP/s, and priced every small matmul as free). Sizes below the
    smallest kept one take its rate."""
    f, b, n = _work(fn)
    work = f if flops else b
    own = _seconds(fn) - n * dispatch_s
    if own < n * dispatch_s:
        return None
    return float(work / n), float(work / own)


def _curve(points: list[tuple[float, float] | None]) -> Rates:
    """The rates measured, by ascending work, those lost in the dispatch left out."""
    return Rates(tuple(sorted(p for p in points if p is not None)))


def _compute_rates(dispatch_s: float) -> dict[str, dict[str, Rates]]:
    matmul: dict[str, Rates] = {}
    for name, dtype in _DTYPES.items():
        gemms = []
        for n in _GEMM_SIZES:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            gemms.append(_rate(lambda: torch.mm(a, b), dispatch_s, flops=True))
        matmul[name] = _curve(gemms)
    return {"matmul": matmul}


def _memory_rates(dispatch_s: float) -> dict[str, Rates]:
    memory = {}
    for name, dtype in _DTYPES.items():
        points = []
        for n in _ELEMENTS:  # into a tensor already there: a step's allocator hands back memory it has used before
            a, b, c = torch.randn(n).to(dtype), torch.randn(n).to(dtype), torch.empty(n, dtype=dtype)
            points.append(_rate(lambda: torch.add(a, b, out=c), dispatch_s, flops=False))
        memory[name] = _curve(points)
    return memory


class OpTimes(TorchDispatchMode):
    """Each op's own seconds (the CPU runs an op to its end before it returns) beside its ``price`` on ``machine``
    (its roofline, by default), summed by op and dtype (``rows``: "op/dtype" -> [measured, priced, ops]); ops priced
    under ``least_s`` are left out (the calibration's: their dispatch is the overhead's). The calibration measures
    each op's efficiency with it; ``benchmarks/time_per_op.py`` holds a real step's ops against the model's prices."""

    def __init__(self, machine: Machine, *, price: Callable[[Machine, OpWork], float] = roofline_s,
                 least_s: float = 0.0) -> None:
        super().__init__()
        self.machine, self.price, self.least_s = machine, price, least_s
        self.rows: dict[str, list[float]] = {}
        self.kinds: dict[str, str] = {}  # op -> its class

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        began = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - began
        op = op_work(func, args, kwargs, out)
        priced = self.price(self.machine, op)
        if priced >= self.least_s:
            row = self.rows.setdefault(f"{op.name}/{op.dtype}", [0.0, 0.0, 0])
            row[0] += seconds
            row[1] += priced
            row[2] += 1
            self.kinds[op.name] = op.kind
        return out


def _attention_block(sdpa: bool, dropout: float = 0.0) -> torch.nn.Module:
    """A transformer block of torch.nn's parts, its attention written out or fused, and a vocabulary head; with
    ``dropout``, dropped out as a model trains (GPT-2's and BERT's attention and residual dropout): random numbers
    drawn per element (``bernoulli_``), which cost far more than the bytes they write, and a fused attention that
    drops out runs PyTorch's math path (``_safe_softmax``)."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.norm1, self.norm2 = torch.nn.Embedding(256, 128), torch.nn.LayerNorm(128), torch.nn.LayerNorm(128)
            self.qkv, self.proj, self.head = torch.nn.Linear(128, 384), torch.nn.Linear(128, 128), torch.nn.Linear(128, 256)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.embed(idx)
            b, t, c = x.shape
            q, k, v = (z.view(b, t, 4, 32).transpose(1, 2) for z in self.qkv(self.norm1(x)).split(c, dim=2))
            drop = lambda z: torch.nn.functional.dropout(z, dropout, self.training) if dropout else z  # noqa: E731
            if sdpa:
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                     dropout_p=dropout if self.training else 0.0)
            else:
                scores = (q @ k.transpose(-2, -1)) / 32 ** 0.5
                mask = torch.ones(t, t, dtype=torch.bool).tril()
                y = drop(scores.masked_fill(~mask, float("-inf")).softmax(-1)) @ v
            x = x + drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
            x = x + drop(self.mlp(self.norm2(x)))
            return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1).float(), idx.flatten())

    return Block()


def _conv_block() -> torch.nn.Module:
    """Dense and depthwise convolutions with batch norms, pooled into a classifier."""
    c = 32
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, c, 3, padding=1), torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
        torch.nn.Conv2d(c, c, 3, padding=1, groups=c), torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
        torch.nn.Conv2d(c, 2 * c, 3, padding=1, stride=2), torch.nn.BatchNorm2d(2 * c), torch.nn.ReLU(),
        torch.nn.Conv2d(2 * c, 2 * c, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(2 * c, 10))


def _suite() -> list[tuple[torch.nn.Module, Callable[[int], Any]]]:
    """The calibration's models (none of autotune's bundled ones: those are what it is checked on) and their
    batches: a transformer block written out and dropped out, one with fused attention, one fused and dropped out, a
    convolutional classifier, and the first and the last recomputed in the backward pass (torch.utils.checkpoint: the
    recompute's own overhead)."""
    torch.manual_seed(0)
    tokens = lambda b: torch.randint(0, 256, (b, 128))  # noqa: E731
    images = lambda b: (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,)))  # noqa: E731
    return [(_attention_block(False, _DROPOUT), tokens), (_attention_block(True), tokens),
            (_attention_block(True, _DROPOUT), tokens), (_Classifier(_conv_block()), images),
            (_Recomputed(_attention_block(False, _DROPOUT)), tokens), (_Recomputed(_Classifier(_conv_block())), images)]


class _Recomputed(torch.nn.Module):
    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, batch: Any) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.body, batch, use_reentrant=False)


class _Classifier(torch.nn.Module):
    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.body(batch[0]), batch[1])


def _phases(model: torch.nn.Module, batch: Any, dtype: str) -> dict[str, Callable[[], Any]]:
    optimizer = torch.optim.AdamW(model.parameters())
    loss: list[torch.Tensor] = []

    def forward() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss.append(model(batch))

    return {"forward": forward, "backward": lambda: loss.pop().backward(),
            "optimizer": lambda: (optimizer.step(), optimizer.zero_grad())}


def _run_suite(machine: Machine) -> tuple[list[tuple[dict[str, float], StepWork]], dict[str, float]]:
    """The suite's steps: for each model, dtype and batch size, its seconds per phase (the fastest of a few steps)
    and its work counted; and each op's measured time over its roofline's (the fastest of three steps each)."""
    steps: list[tuple[dict[str, float], StepWork]] = []
    ratios: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for model, batches in _suite():
        for dtype in _DTYPES:
            for size in _SUITE_BATCHES:
                phases = _phases(model, batches(size), dtype)
                for _ in range(2):  # the optimizer's state made, the kernels warm
                    for fn in phases.values():
                        fn()
                runs = []
                for _ in range(5):
                    runs.append(OpTimes(machine, least_s=_MIN_OP_S))
                    with runs[-1]:
                        for fn in phases.values():
                            fn()
                kinds.update(runs[0].kinds)
                for key in runs[0].rows:
                    m, r, _ = min((run.rows.get(key, (float("inf"), 0.0, 0)) for run in runs), key=lambda x: x[0])
                    row = ratios.setdefault(key, [0.0, 0.0])
                    row[0], row[1] = row[0] + m, row[1] + r
                best = _fastest(phases)
                with WorkCounter() as counter:
                    for fn in phases.values():
                        fn()
                steps.append((best, counter.work()))
    return steps, _factors({k: m / r for k, (m, r) in ratios.items()}, kinds)


def _factors(ratios: dict[str, float], kinds: dict[str, str]) -> dict[str, float]:
    """Each op's measured time over its roofline's; an op class's (for ops the suite did not run) the median of its
    ops' (not their sum: one slow kernel, a broadcast ``masked_fill``, would price every unknown op as slow)."""
    out = dict(ratios)
    for kind in set(kinds.values()):
        for dtype in _DTYPES:
            members = [v for k, v in ratios.items() if k == f"{k.split('/')[0]}/{dtype}" and kinds[k.split("/")[0]] == kind]
            if members:
                out[f"{kind}/{dtype}"] = statistics.median(members)
    return out


def _fastest(phases: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Each phase's fastest seconds over ``_SUITE_REPEATS`` steps (its phases run in order)."""
    best = {p: float("inf") for p in phases}
    for _ in range(_SUITE_REPEATS):
        for phase, fn in phases.items():
            began = time.perf_counter()
            fn()
            best[phase] = min(best[phase], time.perf_counter() - began)
    return best


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """``(scale, per_op_s)`` fitting seconds = scale x ops' own time + per_op_s x ops over ``points`` of (seconds,
    own time, ops), neither below zero: least squares of the relative error (each point weighted by 1 / seconds²),
    the error a prediction is judged by. Unweighted, the largest steps decided the fit alone, and two calibrations of
    one machine gave per-op overheads 4x apart (a backward op's 3.8 and 16.1 us)."""
    w = [1.0 / (t * t) if t > 0 else 0.0 for t, _, _ in points]
    sxx = sum(wi * d * d for wi, (_, d, _) in zip(w, points))
    sxy = sum(wi * d * n for wi, (_, d, n) in zip(w, points))
    syy = sum(wi * n * n for wi, (_, _, n) in zip(w, points))
    sx = sum(wi * t * d for wi, (t, d, _) in zip(w, points))
    sy = sum(wi * t * n for wi, (t, _, n) in zip(w, points))
    det = sxx * syy - sxy * sxy
    if det > 0:
        scale, per_op = (sx * syy - sy * sxy) / det, (sy * sxx - sx * sxy) / det
        if scale >= 0 and per_op >= 0:
            return scale, per_op
    fits = [(sx / sxx if sxx else 0.0, 0.0), (0.0, sy / syy if syy else 0.0)]  # one of them zero: the better
    return min(fits, key=lambda f: sum(wi * (t - f[0] * d - f[1] * n) ** 2 for wi, (t, d, n) in zip(w, points)))


def _host(machine: Machine, steps: list[tuple[dict[str, float], StepWork]]) -> tuple[dict[str, float], dict[str, float]]:
    """Per phase, the scale of the ops' own time and the host's seconds per op, fitted over the suite's steps."""
    points: dict[str, list[tuple[float, float, float]]] = {}
    for measured, work in steps:
        own, ops = step_time(work, machine).phases_s, work.totals()
        if "recompute" in ops:
            continue  # its backward pass holds the recompute too: fitted apart (_recompute_per_op)
        for phase, seconds in measured.items():
            points.setdefault(phase, []).append((seconds, own.get(phase, 0.0), float(ops[phase]["ops"])))
    fitted = {phase: _fit(rows) for phase, rows in points.items()}
    fitted["recompute"] = (fitted["forward"][0], _recompute_per_op(machine, steps, fitted["backward"]))
    return {p: f[1] for p, f in fitted.items()}, {p: f[0] for p, f in fitted.items()}


def _recompute_per_op(machine: Machine, steps: list[tuple[dict[str, float], StepWork]],
                      backward: tuple[float, float]) -> float:
    """The host's seconds per recomputed op: what a backward pass that recomputes takes beyond its own ops' fitted
    time and the recomputed ops' own time (checkpointing's hooks: a saved tensor unpacked, a frame restored), per
    recomputed op; the median over the suite's recomputing steps."""
    scale, per_op = backward
    extra = []
    for measured, work in steps:
        ops, own = work.totals(), step_time(work, machine).phases_s
        if "recompute" in ops:
            beyond = measured["backward"] - scale * own["backward"] - per_op * ops["backward"]["ops"] - own["recompute"]
            extra.append(max(beyond, 0.0) / ops["recompute"]["ops"])
    return statistics.median(extra) if extra else per_op


def calibrate_cpu() -> Machine:
    """Measure this CPU now (seconds: about ten on two cores)."""
    one, other = torch.ones(1), torch.ones(1)
    dispatch_s = _seconds(lambda: torch.add(one, other))
    compute, memory = _compute_rates(dispatch_s), _memory_rates(dispatch_s)
    bare = Machine(name="cpu", compute=compute, memory=memory, overhead_s={}, overlapped=False)
    steps, factors = _run_suite(bare)
    factored = dataclasses.replace(bare, factors=factors, factor_from_s=_MIN_OP_S)
    overhead, scale = _host(factored, steps)
    return Machine(name="cpu", compute=compute, memory=memory, overhead_s=overhead, overlapped=False, factors=factors,
                   factor_from_s=_MIN_OP_S, scale=scale,
                   source=f"calibrated on this machine ({_processor()}, {torch.get_num_threads()} threads, torch "
                          f"{torch.__version__}) at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cache_path() -> pathlib.Path:
    """Where this CPU's calibration is cached (one file per processor, thread count and torch version)."""
    root = os.environ.get("AUTOTUNE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "autotune")
    key = f"{_VERSION}|{_processor()}|{torch.get_num_threads()}|{torch.__version__}"
    return pathlib.Path(root) / f"cpu-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _to_json(machine: Machine) -> dict[str, Any]:
    return {"version": _VERSION, "name": machine.name, "source": machine.source, "overhead_s": machine.overhead_s,
            "factors": machine.factors, "factor_from_s": machine.factor_from_s, "scale": machine.scale,
            "compute": {k: {d: r.to_list() for d, r in t.items()} for k, t in machine.compute.items()},
            "memory": {d: r.to_list() for d, r in machine.memory.items()}}


def _from_json(data: dict[str, Any]) -> Machine:
    rates = lambda points: Rates(tuple((float(w), float(r)) for w, r in points))  # noqa: E731
    return Machine(name=str(data["name"]), overlapped=False, source=str(data["source"]),
                   compute={k: {d: rates(p) for d, p in t.items()} for k, t in data["compute"].items()},
                   memory={d: rates(p) for d, p in data["memory"].items()},
                   overhead_s={str(p): float(s) for p, s in data["overhead_s"].items()},
                   factors={str(k): float(v) for k, v in data["factors"].items()},
                   factor_from_s=float(data["factor_from_s"]),
                   scale={str(p): float(v) for p, v in data["scale"].items()})


def this_cpu(*, refresh: bool = False) -> Machine:
    """This CPU's machine: read from its cache, else calibrated now and cached (``refresh``: calibrated anyway)."""
    path = cache_path()
    if not refresh and path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("version") == _VERSION:
                return _from_json(data)
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache is measured again
    machine = calibrate_cpu()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(_to_json(machine), indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache costs the next run a calibration, nothing more
    return machine
