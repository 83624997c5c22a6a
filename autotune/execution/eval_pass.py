"""One evaluation pass metered (:func:`run_eval`, :class:`EvalWork` at any venue) or predicted under fake tensors
(:func:`predict_eval`): what stays resident while it runs (:class:`~autotune.training.evaluation.EvalKind`), then a
forward pass and the loss under ``torch.no_grad()`` on the evaluation data's worst batch of the size.

Its peak is the region's: the resident state's build and the pass (building holds no more than the state it leaves,
and the pass holds that state throughout). The result is a :class:`~autotune.records.Measurement` of the
configuration at the pass's batch size, a memory trial's fields only (``timed`` false).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch

from autotune.device import backend_for
from autotune.execution.predict import (_KEEPING, CANNOT_FAKE, Unpredictable, _AsTheKernelsDo, _op, _reason,
                                        fake_tensors)
from autotune.execution.work import Place, Work, outcome
from autotune.meters import Meter, TensorMeter
from autotune.records import PREDICTED, Config, Measurement, TrialSettings
from autotune.training.evaluation import EvalKind, Evaluation
from autotune.training.workload import Workload
from autotune.vocabulary import Status

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotune.execution.cuda_rules import CudaRules

__all__ = ["run_eval", "predict_eval", "EvalWork"]


def _evaluation(workload: Workload, config: Config, device: torch.device, settings: TrialSettings,
                cls: type = Evaluation, *, host_apart: bool | None = None) -> Evaluation:
    return cls(workload, config, device, lr=settings.lr, seed=settings.seed, guard=settings.guard,
               host_budget_bytes=settings.host_budget_bytes, host_apart=host_apart)


def _result(config: Config, status: Status, error: str | None, reading: Any, plan: dict, started: float) -> Measurement:
    return Measurement(
        config=config, status=status, error=error, plan=plan, timed=False, wall_s=time.monotonic() - started,
        peak_bytes=reading.peak_bytes if reading else None,
        peak_allocated_bytes=reading.peak_allocated_bytes if reading else None,
        peak_reserved_bytes=reading.peak_reserved_bytes if reading else None,
        peak_nvml_bytes=reading.peak_nvml_bytes if reading else None,
        oom_held_bytes=getattr(reading, "oom_held_bytes", None), oom_needed_bytes=getattr(reading, "oom_needed_bytes", None),
        memory_source=reading.source if reading else "")


def run_eval(workload: Workload, config: Config, kind: EvalKind, *, device: torch.device | str, meter: Meter,
             settings: TrialSettings = TrialSettings()) -> Measurement:
    """Meter one ``kind`` evaluation pass of ``config`` (its batch size, precision and plan) on a fresh model; status
    ``ok`` or ``oom`` (``failed``: the model's own error), as a memory trial's. Memory is released before returning."""
    device = torch.device(device)
    started = time.monotonic()
    run = _evaluation(workload, config, device, settings)
    status, error, handle = Status.OK, None, None
    workload.warm(settings.seed)  # the model built once per process, outside the meter
    try:
        with meter.measure() as handle:
            run.build_for(kind)
            run.evaluate(run.eval_batch(config.batch_size))
    except Exception as exc:  # noqa: BLE001 - as in a trial, the model's failures are outcomes
        failure = outcome(exc)
        status, error = failure.status, failure.error
    finally:
        plan = run.plan
        run.release()
        del run
        backend_for(device).release()
    return _result(config, status, error, handle.reading if handle is not None else None, plan, started)


class _PredictedEvaluation(Evaluation):
    """An evaluation under fake tensors: the data's real tensors met while its batch is made outlive it, as in a
    measured one (:mod:`autotune.execution.predict`)."""

    def eval_batch(self, batch_size: int) -> Any:
        _KEEPING.on = True
        try:
            return super().eval_batch(batch_size)
        finally:
            _KEEPING.on = False


def predict_eval(workload: Workload, config: Config, kind: EvalKind, *, device: torch.device | str = "cpu",
                 settings: TrialSettings = TrialSettings(), mode: "FakeTensorMode | None" = None,
                 cuda: "CudaRules | None" = None) -> Measurement:
    """Predict :func:`run_eval`'s peak under fake tensors (no budget: the whole peak), ``memory_source`` predicted;
    raises :class:`~autotune.execution.predict.Unpredictable` where the model cannot run under them. ``mode`` and
    ``cuda`` as for :func:`~autotune.execution.predict.predict_trial`."""
    device = torch.device(device) if cuda is None else cuda.here
    started = time.monotonic()
    run = _evaluation(workload.unwarmed(), config, device, settings, _PredictedEvaluation,
                      host_apart=cuda is not None)
    status, error, handle = Status.OK, None, None
    try:
        meter = TensorMeter(device, trace=cuda is not None)
        rules = cuda.applied() if cuda else contextlib.nullcontext()  # what they find is the dry run's already
        with mode or fake_tensors(), _AsTheKernelsDo(cuda is not None or device.type == "cuda"), rules, \
                meter.measure() as handle:
            run.build_for(kind)
            run.evaluate(run.eval_batch(config.batch_size))
    except CANNOT_FAKE as exc:
        raise Unpredictable(_op(exc), _reason(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the model's failures are outcomes
        failure = outcome(exc)
        status, error = failure.status, failure.error
    finally:
        plan = run.plan
        run.release()
        del run
    reading = None if handle is None else dataclasses.replace(handle.reading, source=PREDICTED)
    if cuda is not None and reading is not None:
        reading = cuda.read(reading, handle.trace or (), None).reading
    return _result(config, status, error, reading, plan, started)


@dataclasses.dataclass(frozen=True)
class EvalWork(Work):
    """An evaluation pass as a piece of work: ``config`` evaluated as ``kind`` under ``enforced_bytes``."""

    config: Config
    kind: EvalKind
    settings: TrialSettings
    enforced_bytes: int | None

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"autotune-eval-{self.kind}-{self.config.precision}-{self.config.plan}-b{self.config.batch_size}"

    @property
    def timeout_s(self) -> float | None:
        return self.settings.timeout_s

    def run(self, workload: Workload, place: Place) -> Measurement:
        return run_eval(workload, self.config, self.kind, device=place.device, meter=place.meter_for(self.enforced_bytes),
                        settings=self.settings)

    def failed(self, status: str, error: str, seconds: float) -> Measurement:
        return Measurement(config=self.config, status=status, wall_s=seconds, error=f"the evaluation's {error}",
                           timed=False)

    def decode(self, data: dict) -> Measurement:
        return Measurement.from_dict(data)
