"""The dry run (``--dry-run``, ``tune(..., dry_run=True)``): the whole space predicted, each variant's limit exact.

    Options -> resolve -> Target
            -> preflight, under fake tensors -> ModelFacts   the model never holds memory: a 7B model costs no 28 GB
            -> plan_study -> Study                           the plans are not checked (a check compares real numbers)
            -> predict -> SearchResult                       each variant's sizes up to its first failure, then its
                                                             exact limit between them, by its line (the search's)
            -> analyse -> Report                             the same report, its peaks labelled predicted

Every trial is :mod:`autotune.execution.predict`'s: the trial's own code under PyTorch's fake tensors, counted by
the tensor meter with the budget's rules. Nothing is written to the trial store (a prediction is not a
measurement a later search may reuse), and the report's default name ends in ``-dry-run``. Each step's work is
counted too and priced by a time model (:mod:`autotune.timing`): on the CPU, this machine calibrated; with
``--device cuda --card NAME``, the card's data sheet. So a dry run has a predicted Pareto front and a
recommendation, both estimates (``time_source`` predicted); without a time model (``--device cuda`` without
``--card``) it recommends nothing. It exits 0 where some configuration is predicted to fit the budget less its
headroom, and 3 where none is.

With ``--device cuda`` each trial is predicted with CUDA's rules (:mod:`autotune.execution.cuda_rules`): on fake
CUDA tensors where this machine has a GPU, else on the CPU's with CUDA's autocast lists; reserved bytes from a model
of the caching allocator, which the budget holds; NVML's figure with an assumed CUDA context. The notices say what
was assumed, and the report's ``search.cuda`` records it.

With ``--parallel ddp|fsdp --world-size N`` (no torchrun) each trial is one rank's part of an N-rank job: this
process joins PyTorch's fake process group as rank 0 for the predictions (:mod:`autotune.execution.one_rank`), the
trial trains under the job's wrapper, and the report's ``distributed`` says it is a prediction of one rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from autotune._log import logger
from autotune.device import available_ram_bytes, follows_cuda
from autotune.errors import ForwardFailed, UsageError
from autotune.execution.cuda_rules import CudaRules
from autotune.execution.predict import CANNOT_FAKE, Predictor, cannot_fake, cannot_measure_here
from autotune.records import Config, Measurement
from autotune.search.loop import SearchResult
from autotune.search.predicted import exact_limit
from autotune.timing.cards import card
from autotune.timing.model import card_machine, checked_error
from autotune.vocabulary import Status

if TYPE_CHECKING:
    from autotune.preparation import ModelFacts, Study, Target

__all__ = ["predict", "DryRun", "preflight_under", "Preflighted", "with_dry_run", "DRY_RUN_NOTICE"]

DRY_RUN = "dry-run"  # the strategy a dry run's report names
DRY_RUN_NOTICE = ("a dry run: every peak is predicted (memory_source predicted: the trial's code under fake tensors, "
                  "counted by the tensor meter), not measured; it has no step times (a CUDA dry run prices them for "
                  "the card named by --card NAME), so it recommends nothing: run without --dry-run to measure which "
                  "configuration is fastest")


@dataclasses.dataclass(frozen=True)
class DryRun:
    """What a dry run's predictions give: the search's ``result``, what the report's ``search`` section says of a dry
    run (its meter, the limits' step, the time model and CUDA's rules where they priced it), the job whose rank was
    predicted (``distributed``, with ``--world-size``), and the ``notices`` that come first in the report."""

    result: SearchResult
    memory_meter: str
    batch_multiple: int
    time_model: dict[str, Any] | None
    cuda: dict[str, Any] | None
    distributed: dict[str, Any] | None
    notices: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Preflighted:
    """The preflight's facts, and what to say of how they were had (``notices``: where real tensors stood in)."""

    facts: "ModelFacts"
    notices: tuple[str, ...] = ()


def predict(target: "Target", facts: "ModelFacts", study: "Study", events: Any, mode: Any = None) -> DryRun:
    """Predict every configuration of the space, then each variant's exact limit in multiples of ``--batch-multiple``
    (up to the space's top; :func:`~autotune.search.predicted.exact_limit`): the search's result, what the report's
    ``search`` adds for a dry run, and its notices (:class:`DryRun`). ``mode``: the fake tensors the workload's models
    are built in (:func:`~autotune.execution.fake_build.fake_buildable`)."""
    multiple = target.searching.batch_multiple
    searching = target.searching
    cuda = (CudaRules.for_this_machine(target.device, capability=searching.cuda_capability,
                                       context_bytes=searching.cuda_context_bytes)
            if follows_cuda(target.device) else None)
    machine = _time_model(target, cuda is not None)
    with _ranks(target.searching, target.here) as ranks:
        predictor = Predictor(study.workload, device=target.device, budget_bytes=target.budget.enforced,
                              settings=target.trial_settings, model_name=facts.model_class,
                              state_bytes=facts.fixed_bytes, real_limit_bytes=available_ram_bytes(), mode=mode,
                              ranks=ranks, cuda=cuda, time_model=machine)
        result = _predicted(predictor, target, study, events, multiple, facts.fixed_bytes)
    meter = ("tensor (measured on the CPU: the model cannot run under fake tensors)" if predictor.why is not None else
             "tensor, under fake tensors (predicted)" if cuda is None else
             "CUDA's caching allocator modelled over the tensor meter's allocation trace, under fake tensors (predicted)")
    notices = (_notice(machine), *_rank_notice(ranks), *(cuda.notices(predictor.cuda_findings) if cuda else ()),
               *predictor.notices)
    return DryRun(result, memory_meter=meter, batch_multiple=multiple,
                  time_model=None if machine is None else {**machine.describe(), "checked": checked_error(machine.name)},
                  cuda=None if cuda is None else cuda.describe(predictor.cuda_findings),
                  distributed=None if ranks is None else ranks.describe(target.precisions), notices=notices)


def _time_model(target: "Target", for_cuda: bool) -> Any:
    """The machine a dry run prices step times on: the card planned for (``--card``), this CPU (calibrated once,
    cached), or none (CUDA without a card: the GPU here is not calibrated)."""
    name = target.searching.card
    if name is not None:
        return card_machine(card(name))
    if for_cuda:
        return None
    from autotune.timing.calibration import this_cpu  # measures this CPU once (seconds), then reads its cache

    return this_cpu()


def _notice(machine: Any) -> str:
    """What a dry run's figures are: its peaks predicted, and its step times predicted by ``machine`` (or none)."""
    if machine is None:
        return DRY_RUN_NOTICE
    checked = checked_error(machine.name)
    error = (f"median error {checked['median_abs_error']:.0%} against measured steps ({checked['source']})"
             if checked else f"not checked against a step measured on {machine.name}")
    return (f"a dry run: every peak is predicted (memory_source predicted: the trial's code under fake tensors, counted "
            f"by the tensor meter), not measured, and so is every step time (time_source predicted: each op's FLOPs "
            f"and bytes priced on {machine.name}, {machine.source.split(':')[0]}; {error}): the front and the "
            f"recommendation are estimates")


def preflight_under(mode: Any, target: "Target", preflight: Any) -> Preflighted:
    """The preflight (one forward pass) under the dry run's fake tensors; where they cannot run the model's forward
    (a value decides a shape, or a fake kernel is stricter than the CPU's: transformers' grouped matmul of a mixture
    of experts takes bf16 only under fake tensors), on real tensors on the CPU, as its predictions will be measured
    then (:class:`~autotune.execution.predict.Predictor`), with a notice; where it fails there too, the model's
    failure, in one line; and where that is not for this machine (one rank of a job on a fake process group, a plan
    for CUDA, a model whose weights' training state would take more than half of the memory here), one line."""
    failed: ForwardFailed | None = None  # the forward raised: the model's failure, or a fake kernel's
    try:
        with mode:
            return Preflighted(preflight(target))
    except CANNOT_FAKE as exc:
        why = cannot_fake(exc)
    except ForwardFailed as exc:  # real tensors tell the model's failure from a fake kernel's
        why, failed = exc.cause, exc
    workload = target.workload
    real = getattr(workload.model_factory, "real", None)  # a build that read values: fake copies of a real one
    with mode:  # the state the preflight did not get to size: weights, and gradients and two moments of those that
        model = workload.build_model(seed=0)  # train, about
        state = sum((4 if p.requires_grad else 1) * p.numel() * p.element_size() for p in model.parameters())
    name = type(model).__name__  # as the Predictor's notices name it
    searching = target.searching
    ranks = (searching.parallel, searching.world_size) if searching.world_size else None  # one rank, on a fake group
    cannot = cannot_measure_here(name, why, target.device, state, available_ram_bytes(), ranks)
    if cannot is not None:  # where real tensors cannot tell, both answers
        raise UsageError(cannot if failed is None else f"{failed}; if they are right, {cannot}")
    if real is not None:
        workload = dataclasses.replace(workload, model_factory=real)
    notice = f"{name}'s forward cannot run under fake tensors ({why}): the dry run's preflight ran on real tensors"
    logger.warning(notice)
    return Preflighted(preflight(dataclasses.replace(target, workload=workload)), (notice,))


def _ranks(searching: Any, device: Any) -> Any:
    """With ``--world-size``: this process as rank 0 of the job on the fake process group; else nothing."""
    if searching.world_size is None:
        return contextlib.nullcontext()
    from autotune.execution.one_rank import one_rank

    return one_rank(searching.parallel, searching.world_size, device)


def _rank_notice(ranks: Any) -> tuple[str, ...]:
    if ranks is None:
        return ()
    job = ranks.job
    return (f"one rank of a --parallel {job.wrapper} job of {job.world_size} ranks predicted in this process, on "
            f"PyTorch's fake process group (no job ran): its peaks are one rank's, its batch sizes per rank; what a "
            f"backend allocates inside a collective is not counted, here or on a real rank",)


def _predicted(predictor: Predictor, target: "Target", study: "Study", events: Any, multiple: int,
               fixed_bytes: int | None) -> SearchResult:
    """Every configuration of the space predicted, then each variant's exact limit between the space's sizes; the
    search's result. ``fixed_bytes`` (the training state) anchors a variant's line drawn through one size."""
    trials: dict[Config, Measurement] = {}

    def run(config: Config) -> Measurement:
        if config not in trials:
            events.trial_started(config)
            trials[config] = predictor(config)
            events.trial_done(trials[config], False)
        return trials[config]

    space, started = study.space, time.monotonic()
    events.call("search_started", space_size=len(space), planned=None, strategy=DRY_RUN,
                budget_bytes=target.budget.bytes)
    try:
        for variant in space.variants():
            for b in sorted(space.batch_sizes):  # memory grows with the batch: above a failure, nothing fits
                if run(variant.at(b)).status != Status.OK:
                    break
            # between the space's sizes, by the variant's line (the search's secant); the space's top where it fits
            exact_limit(variant, trials, run, target.budget.bytes, multiple, max(space.batch_sizes),
                        fixed_bytes, None, above_top=1)
    finally:
        events.call("search_done")
    order = {variant: i for i, variant in enumerate(space.variants())}  # the space's order, the exact limit's sizes within
    ordered = sorted(trials.values(), key=lambda m: (order[m.config.variant], m.batch_size))
    return SearchResult(tuple(ordered), n_run=len(trials), n_reused=0, wall_s=time.monotonic() - started,
                        study_name=study.name, storage=None)


def with_dry_run(report: Any, dry_run: DryRun) -> Any:
    """The report of a dry run: its search says so, with the ``dry_run``'s notices first; with ``--world-size``, its
    ``distributed`` says which job's rank was predicted."""
    search = report.search.but(strategy=DRY_RUN, dry_run=True, storage=None, batch_multiple=dry_run.batch_multiple,
                               memory_meter=dry_run.memory_meter, time_model=dry_run.time_model, cuda=dry_run.cuda)
    return dataclasses.replace(report, search=search, notices=dry_run.notices + report.notices,
                               distributed=dry_run.distributed or report.distributed)
