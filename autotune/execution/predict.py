"""Memory known before it is measured: a trial's own code run under PyTorch's fake tensors (``--dry-run``).

A prediction runs the trial of :mod:`autotune.execution.trial`: the model's build, its batch (the data's worst
batch of the size, or ``example_batch``), the checkpoint plan's recompute and offload hooks, forward and backward
under autocast and the GradScaler, the user's optimizer with its state primed. It runs under ``FakeTensorMode``,
where every tensor has its shape, dtype, device and a storage of its own, and none has memory or arithmetic. The
tensor meter counts those storages with the budget's rules, as it counts real ones: a prediction and a
measurement share the code that counts and differ only in the tensors they count (PyTorch's MemTracker does the
same for one configuration). So a model of any size is planned on a machine that could not hold it: a 1.1B Llama
shape's configuration in about 2 s on two CPU cores (``results/dry_run-cpu.md``); a small model's prediction costs
about what its real memory trial does (the dispatch of fake tensors is Python's, op by op).

What no fake tensor says is time; what the step does is known, though: with a time model (:mod:`autotune.timing`),
the prediction counts each op's FLOPs and bytes as it runs (:class:`~autotune.timing.counting.WorkCounter`) and
prices them on the machine planned for: its ``step_s`` and ``samples_per_s`` are predicted (``time_source``
predicted, ``time_model`` the machine).

Some models cannot run under fake tensors: values decide their shapes (a mixture of experts' routing,
``nonzero``). Their trials run for real on the CPU instead, metered and not timed (:class:`Predictor`), and the dry
run says so; where they cannot run for real here, one line names the op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode,
                                           UnsupportedOperatorException)
from torch.utils._python_dispatch import TorchDispatchMode

from autotune._log import logger
from autotune.device import measurable_here
from autotune.errors import UsageError
from autotune.execution.known_values import KnowingFakeTensorMode
from autotune.execution.trial import TrialRecord, TrialRun, run_trial
from autotune.execution.work import outcome
from autotune.meters import TensorMeter
from autotune.plans.offload import offloader_of
from autotune.records import PREDICTED, Config, Measurement, TrialSettings
from autotune.timing.counting import OpWork, StepWork, WorkCounter, dtype_name
from autotune.timing.model import with_predicted_time
from autotune.execution.fake_build import FakeCopies
from autotune.training.workload import Workload
from autotune.units import format_bytes
from autotune.vocabulary import Parallel, Status

if TYPE_CHECKING:
    from autotune.execution.cuda_rules import CudaFindings, CudaRules
    from autotune.execution.one_rank import OneRank
    from autotune.timing.model import Machine
    from autotune.training.wrapping import Wrapping

__all__ = ["fake_tensors", "predict_trial", "Unpredictable", "Predictor", "CANNOT_FAKE",
           "cannot_fake", "cannot_measure_here", "quiet_fake_kernels"]

# What fake tensors raise where a value decides what comes next: a shape (nonzero, unique, boolean masks), a
# Python number (.item(), a branch on a tensor), or an op without a fake kernel
CANNOT_FAKE = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


def cannot_fake(exc: Exception) -> str:
    """``op: why`` for what fake tensors raised where a value decides what comes next."""
    return f"{_op(exc)}: {_reason(exc)}"


def cannot_measure_here(model_name: str, why: str, device: torch.device, state_bytes: int,
                        available_bytes: int | None, ranks: tuple[str, int] | None = None) -> str | None:
    """Why a model fake tensors cannot run (``why``) cannot be measured for real on this machine's CPU instead, in one
    line: one rank of a distributed job (``ranks``: its wrapper and world size; the fake process group's collectives
    move nothing), a dry run for another device (CUDA's rules are not the CPU's), or a training state of
    ``state_bytes`` over half of ``available_bytes``; None where it can."""
    if ranks is not None:
        wrapper, world_size = ranks
        return (f"{model_name} cannot run under fake tensors ({why}), and one rank of a --parallel {wrapper} job "
                f"cannot be measured for real in this process instead (the fake process group's collectives move "
                f"nothing): run the job under torchrun --nproc-per-node {world_size} without --dry-run")
    if not measurable_here(device):
        return (f"{model_name} cannot run under fake tensors ({why}), and a dry run for {device} cannot measure it "
                f"on the CPU instead: run it without --dry-run")
    if available_bytes is not None and 2 * state_bytes > available_bytes:
        return (f"{model_name} cannot run under fake tensors ({why}), and its training state "
                f"({format_bytes(state_bytes)}) is too large to measure on this machine's CPU instead "
                f"({format_bytes(available_bytes)} available): run the search on its device")
    return None


class _FakeKernelFailures(logging.Filter):
    """Drops torch's log of a fake kernel that raised: its message and a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta for")


@contextlib.contextmanager
def quiet_fake_kernels() -> Iterator[None]:
    """Inside the block, torch does not log a fake kernel's failure (an error line and a traceback, on stderr): a dry
    run and a search's predictions handle what fake tensors cannot run, and say so in one line. Nor does it warn that
    a fake tensor's data pointer was read: ``Tensor.__deepcopy__`` reads it, to clone a subclass (a model that deep-copies
    its layers as it is built, under fake tensors)."""
    log, quiet = logging.getLogger("torch._subclasses.fake_tensor"), _FakeKernelFailures()
    log.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield
    finally:
        log.removeFilter(quiet)


_KEEPING = threading.local()  # on while a prediction makes its batch: the fake copies of real inputs are kept

# The normalisations whose mean and inverse standard deviation the real kernels may save in float32, and where their
# parameters (weight, bias, and BatchNorm's running statistics) are among their arguments
_FLOAT_STATS = {torch.ops.aten.native_batch_norm.default: slice(1, 5),
                torch.ops.aten._native_batch_norm_legit.default: slice(1, 5),
                torch.ops.aten._native_batch_norm_legit_no_training.default: slice(1, 5),
                torch.ops.aten.native_layer_norm.default: slice(2, 4)}


class Unpredictable(Exception):
    """The trial cannot run under fake tensors; ``op`` is the op that needs real values."""

    def __init__(self, op: str, reason: str) -> None:
        super().__init__(f"{op}: {reason}")
        self.op = op


def fake_tensors() -> FakeTensorMode:
    """The fake tensors a prediction runs under. Real tensors met inside (a dataset's items, a model's constants) are
    taken as fake ones of the same shape, each kept as long as its real tensor (:func:`_keeping_real_inputs`); a
    fake tensor deep-copied keeps its mode (:func:`_copied_as_itself`)."""
    return _copied_as_itself(_keeping_real_inputs(KnowingFakeTensorMode(allow_non_fake_inputs=True)))


def _copied_as_itself(mode: FakeTensorMode) -> FakeTensorMode:
    """``mode``, which ``copy.deepcopy`` returns as it is. Returns ``mode``.

    A model that deep-copies its layers as it is built (``nn.TransformerEncoder`` and ``nn.Transformer`` clone their
    layer ``num_layers`` times; so do many users' ``clones()``) deep-copies fake tensors in a dry run, and
    ``Tensor.__deepcopy__`` deep-copies a subclass's ``__dict__``: each fake parameter's mode, with the weak
    references to storages its converter keeps. Both copies free those references: the process died of a
    segmentation fault later in the run (an ``nn.Transformer`` model, every time). Every fake tensor's mode is one."""
    mode.__deepcopy__ = lambda memo: mode  # copy.deepcopy looks it up on the instance
    return mode


def _keeping_real_inputs(mode: FakeTensorMode) -> FakeTensorMode:
    """``mode``, whose fake copy of a real tensor met inside (a dataset's tensor, a model's constant) lives as long as
    the real tensor does: as it would in the trial that the prediction stands for. Returns ``mode``.

    The tensor meter counts a storage from the op that makes a tensor of it until the storage is freed; a view of a
    real tensor made before the trial (an item of a dataset that keeps every sequence in one tensor) counts the whole
    storage, for the rest of the trial, since the dataset keeps it. Fake tensors keep the fake copy only while a
    fake tensor refers to it (a weak memo), so a prediction counted the copy only while the item lived: with
    ``token_dataset``, TinyGPT's predictions were 2.5 MiB (its 2048 sequences) below every measured peak, enough to
    refute the predictions of every plan whose peak at the checking size is under 252 MiB, and to bracket those plans
    by memory trials. Kept here, every prediction equals its measurement to the byte
    (``tests/search/test_predicted_search.py``). A fake copy that holds its real tensor (a constant) is left to the memo.

    Only the batch's inputs are kept so (:meth:`_Predicted.memory_batch`): the real tensors a trial makes itself
    outside the meter (a ``PLAN+state`` model built on the host) are counted while the trial uses their copies, as a
    measured trial counts them."""
    from torch.utils.weak import WeakIdKeyDictionary

    converter = mode.fake_tensor_converter
    copy = converter.from_real_tensor
    kept = WeakIdKeyDictionary()  # real tensor -> its fake copy, dropped when the real tensor is

    def from_real_tensor(fake_mode, t, *args, **kwargs):
        fake = copy(fake_mode, t, *args, **kwargs)
        if fake.constant is None and getattr(_KEEPING, "on", False):
            kept[t] = fake
        return fake

    converter.from_real_tensor = from_real_tensor
    return mode


class _AsTheKernelsDo(TorchDispatchMode):
    """Where a fake kernel's outputs differ from the real kernel's, the real kernel's (found by comparing the tensor
    meter's counts on real and fake tensors over the bundled models and the zoo).

    ``native_batch_norm`` and ``native_layer_norm`` on half-precision input save their mean and inverse standard
    deviation in float32 on CUDA always, and on the CPU where a parameter is float32 (BatchNorm under autocast, a
    LayerNorm outside it); on the CPU with half parameters (bf16-fsdp's, FSDP2 gathering them in bf16) in the input's
    dtype, as the fake kernels always make them.
    """

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda  # the prediction is for CUDA's kernels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        params = _FLOAT_STATS.get(func)
        if params is not None and args[0].dtype in (torch.float16, torch.bfloat16) and (self.cuda or any(
                isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in args[params])):
            out = (out[0], *(torch.empty_like(t, dtype=torch.float32) for t in out[1:3]), *out[3:])
        return out


class _StepsAlways:
    """A GradScaler that steps the optimizer whatever its inf check found: a fake tensor has no value to read, and the
    step taken on finite gradients is the one that holds the optimizer's state (a skipped step holds less).

    Everything else (scaling the loss, unscaling, the update of the scale) is the scaler's own, on fake tensors.
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self._scaler = scaler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scaler, name)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        from torch.amp.grad_scaler import OptState  # the scaler's own record of what it did to this optimizer

        if self._scaler._per_optimizer_states[id(optimizer)]["stage"] is not OptState.UNSCALED:
            self._scaler.unscale_(optimizer)  # the inf check's tensors, as the scaler's own step makes them
        optimizer.step()

    def get_scale(self) -> float:
        return float(self._scaler._init_scale)  # its fake scale has no value; a step that always steps keeps it


class _Predicted(TrialRun):
    """A trial under fake tensors: built and stepped as a memory trial is, its scaler stepping always."""

    def build(self) -> None:
        super().build()
        if self.run.scaler is not None:
            self.run.scaler = _StepsAlways(self.run.scaler)

    def memory_batch(self) -> Any:
        _KEEPING.on = True  # the data's real tensors met now outlive the trial, as in a measured one
        try:
            return super().memory_batch()
        finally:
            _KEEPING.on = False


def predict_trial(workload: Workload, config: Config, *, device: torch.device | str = "cpu",
                  budget_bytes: int | None = None, settings: TrialSettings = TrialSettings(),
                  mode: FakeTensorMode | None = None, parallel: "Wrapping | None" = None,
                  cuda: "CudaRules | None" = None, time_model: "Machine | None" = None,
                  findings: "CudaFindings | None" = None) -> Measurement:
    """Predict the peak memory of a memory trial of ``config`` (:func:`autotune.execution.trial.run_trial` with
    ``timed=False``) under ``budget_bytes``, without running it: status ``ok`` or ``oom`` (or ``failed``, the model's
    own error), ``memory_source`` :data:`PREDICTED`, no step time.

    Raises :class:`Unpredictable` where the model cannot run under fake tensors, and bad input as a trial does.
    ``mode``: the fake tensors to run under (those of a model :func:`~autotune.execution.fake_build.fake_buildable` made), else new ones.
    ``parallel``: one rank's part of a distributed trial, on a fake process group (:mod:`autotune.execution.one_rank`).
    ``cuda``: predict for CUDA (:mod:`autotune.execution.cuda_rules`): run where its rules say (``device`` is then
    ignored), and read the allocator's reserved bytes from the allocation trace; the budget holds those; what the
    rules find is told to ``findings`` (a :class:`~autotune.execution.cuda_rules.CudaFindings`, else forgotten).
    ``time_model``: also predict the step's time on this machine (:func:`autotune.timing.model.step_time`).
    """
    device = torch.device(device) if cuda is None else cuda.here
    started = time.monotonic()
    run = _Predicted(workload.unwarmed(), config, device, settings, parallel, host_apart=cuda is not None)
    status, error, handle, work = Status.OK, None, None, None
    counter = WorkCounter() if time_model is not None else contextlib.nullcontext()
    try:
        meter = TensorMeter(device, budget_bytes=budget_bytes, trace=cuda is not None)
        rules = cuda.applied(findings) if cuda else contextlib.nullcontext()
        with mode or fake_tensors(), _AsTheKernelsDo(cuda is not None or device.type == "cuda"), rules, \
                meter.measure() as handle:
            run.build()
            with counter:
                run.step(run.batch, micro_steps=run.micro_steps)  # the state primed: one step holds all
            if run.unprimed is not None:
                run.make_state()
            if time_model is not None:
                work = _work(counter, run, parallel)
    except CANNOT_FAKE as exc:
        raise Unpredictable(_op(exc), _reason(exc)) from None
    except Exception as exc:  # noqa: BLE001 - as in a trial, the model's failures are outcomes
        failure = outcome(exc)
        status, error = failure.status, failure.error
    finally:
        record = TrialRecord(plan=run.plan, steps_s=round(time.monotonic() - started, 4),
                             host_peak_bytes=run.host_peak_bytes)
        run.release()
        del run
    reading = None if handle is None else dataclasses.replace(handle.reading, source=PREDICTED)
    if cuda is not None and reading is not None:
        read = cuda.read(reading, handle.trace or (), budget_bytes)
        reading, allocator_error = read.reading, read.allocator_error
        if allocator_error is not None and status == Status.OK:
            status, error = Status.OOM, allocator_error
    predicted = record.measurement(config, status, error, reading, started, timed=False)
    if work is None:
        return predicted
    return with_predicted_time(predicted, work, time_model, world_size=parallel.job.world_size if parallel else 1)


def _work(counter: WorkCounter, run: TrialRun, parallel: "Wrapping | None") -> StepWork:
    """The step's counted work, with the bytes an offloading plan copied to the host, and under DDP its gradients'
    all-reduce (on the fake process group DDP's buckets are reduced by a hook that moves nothing)."""
    offloader = offloader_of(run.module)
    work = counter.work(offloader.moved_bytes if offloader is not None else 0)
    if run.micro_steps > 1:  # the metered step accumulated; a timed step is one micro-step and the optimizer's step
        work = dataclasses.replace(work, offload_bytes=work.offload_bytes // run.micro_steps, ops=tuple(
            op if op.phase == "optimizer" else dataclasses.replace(op, count=max(1, op.count // run.micro_steps))
            for op in work.ops))
    if parallel is not None and parallel.job.wrapper == Parallel.DDP:
        trained = [p for p in run.model.parameters() if p.requires_grad]
        grads = sum(p.numel() * p.element_size() for p in trained)
        dtype = dtype_name(trained[0].dtype) if trained else dtype_name(torch.float32)
        work = dataclasses.replace(work, ops=(*work.ops, OpWork("backward", "collective", dtype, 0, grads, 1,
                                                                "allreduce_")))
    return work


def _op(exc: Exception) -> str:
    """The op that fake tensors could not run (what they raised, where it names none)."""
    return str(getattr(exc, "func", type(exc).__name__))


def _reason(exc: Exception) -> str:
    if isinstance(exc, DynamicOutputShapeException):
        return "its output's shape depends on the values of its input"
    if isinstance(exc, DataDependentOutputException):
        return "the model reads a tensor's value (.item(), a branch on a tensor)"
    return "it has no fake-tensor implementation"


class Predictor:
    """The dry run's trials: each configuration predicted under fake tensors, or, once the model is found to need real
    values, measured for real on the CPU, metered and not timed, as a memory trial (``notices`` says so, once).

    A model needs real values where fake tensors raise :class:`Unpredictable`, or where a prediction fails and the
    same trial run for real does not (a fake kernel stricter than the CPU's, a library hook that moves storages).
    Measuring for real costs the model's memory: where its training state is more than half of what this machine
    has available (``real_limit_bytes``), the dry run stops with one line that names the op instead, and a
    prediction that failed is kept as failed, unconfirmed (a search's plan check drops a plan that fails), and said.

    ``ranks`` (``--world-size``): each trial is rank 0's part of a distributed trial on a fake process group; a model
    that needs real values is then not measured instead (its collectives would move nothing).
    """

    def __init__(self, workload: Workload, *, device: torch.device, budget_bytes: int | None, settings: TrialSettings,
                 model_name: str, state_bytes: int, real_limit_bytes: int | None,
                 mode: FakeTensorMode | None = None, ranks: "OneRank | None" = None,
                 cuda: "CudaRules | None" = None, time_model: "Machine | None" = None) -> None:
        self.time_model = time_model  # what prices each prediction's step time (None: no time)
        self.workload, self.device, self.budget_bytes, self.settings = workload, device, budget_bytes, settings
        self.cuda = cuda  # --device cuda: CUDA's rules
        self.cuda_findings = cuda and type(cuda).findings_class()  # what they found over every prediction
        self.mode = mode  # the fake tensors of the workload's models (fake_buildable), if it has its own
        self.ranks = ranks
        self.model_name, self.state_bytes, self.real_limit_bytes = model_name, state_bytes, real_limit_bytes
        self.why: str | None = None  # why the model cannot be predicted, once found
        self.notices: list[str] = []

    def __call__(self, config: Config) -> Measurement:
        if self.why is not None:
            return self._measured(config)
        try:
            predicted = predict_trial(self.workload, config, device=self.device, budget_bytes=self.budget_bytes,
                                      settings=self.settings, mode=self.mode,
                                      parallel=self.ranks.wrapping() if self.ranks is not None else None,
                                      cuda=self.cuda, time_model=self.time_model, findings=self.cuda_findings)
        except Unpredictable as exc:
            self._cannot_predict(str(exc))
            return self._measured(config)
        if predicted.status != Status.FAILED:
            return predicted
        if self._cannot_measure(predicted.error) is not None:  # unconfirmed: the failure stands, as a search's would
            self._say(f"{config.plan}'s prediction failed ({predicted.error}) and could not be checked by a real trial "
                      f"here: a failing plan is dropped by the search's plan check")
            return predicted
        measured = self._measured(config)
        if measured.status == Status.FAILED:
            return measured  # the model's own failure, fake or real
        self._cannot_predict(predicted.error)
        return measured

    def _cannot_predict(self, why: str) -> None:
        cannot = self._cannot_measure(why)
        if cannot is not None:
            raise UsageError(cannot)
        self.why = why
        self._say(f"{self.model_name} cannot run under fake tensors ({why}): its dry run measured each configuration "
                  f"for real on the CPU instead (memory_source tensor: metered, not timed, as a memory trial)")

    def _cannot_measure(self, why: str) -> str | None:
        """Why this model cannot be measured for real here instead (one line), or None where it can."""
        ranks = None if self.ranks is None else (self.ranks.job.wrapper, self.ranks.job.world_size)
        return cannot_measure_here(self.model_name, why, self.device, self.state_bytes, self.real_limit_bytes, ranks)

    def _say(self, notice: str) -> None:
        if notice not in self.notices:
            self.notices.append(notice)
            logger.warning(notice)

    def _measured(self, config: Config) -> Measurement:
        workload = self.workload
        if isinstance(workload.model_factory, FakeCopies):  # measured for real: real builds, not fake copies
            workload = dataclasses.replace(workload, model_factory=workload.model_factory.real)
        meter = TensorMeter(self.device, budget_bytes=self.budget_bytes)
        return run_trial(workload, config, device=self.device, meter=meter, settings=self.settings, timed=False)
