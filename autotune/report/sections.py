"""The report's ``search`` section as a record: :class:`SearchSection`, its fields declared here and nowhere else.

The analysis (:func:`autotune.tuner.analyse`) makes it from the search's result; the stages after it each set the
field that is theirs (:meth:`SearchSection.but`: a dry run's ``dry_run``, ``time_model`` and ``cuda``, stage 5b's
``exact_limit``, 5c's ``static_compile``, the evaluation limits' ``eval_limits``, an interruption's ``partial``), so
a field misspelt is an error where it is written, not a key nobody reads. It reads as the JSON object it was
(``report.search["storage"]``, ``.get``, ``**``): scripts that read the section as a mapping keep working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["SearchSection"]

# Set by a stage after the analysis, where it ran: absent from the JSON where it did not (None)
_STAGES = ("dry_run", "time_model", "cuda", "exact_limit", "static_compile", "eval_limits")


@dataclasses.dataclass(frozen=True, eq=True)
class SearchSection(Mapping):
    """How the trials were had: the strategy, the space, the counts and seconds, the settings the trials ran under.

    ``None`` where a report does not say (a dry run has no store; an older report's schema had no such field).
    """

    strategy: str = ""  # the search strategy's name ("grid", "auto", ...; "dry-run" for a dry run)
    n_trials_limit: int | None = None  # --n-trials
    n_trials: int | None = None  # configurations in the report (measured, or predicted in a dry run)
    n_run: int | None = None  # of them, run by this process
    n_reused: int | None = None  # of them, found in the store (an earlier run's, a peer's)
    wall_s: float | None = None
    study: str | None = None  # the Optuna study's name
    storage: str | None = None  # the store's URL (None: a dry run stores nothing)
    space: dict[str, Any] = dataclasses.field(default_factory=dict)  # the search space, as SearchSpace.to_dict
    warmup_steps: int | None = None
    measure_steps: int | None = None
    settle_steps: int | None = None
    predictions: dict[str, Any] | None = None  # what auto's seeding predicted under fake tensors, where it did
    batch_multiple: int | None = None  # the step of the limits made exact (predicted, confirmed)
    trial_timeout_s: float | None = None
    memory_meter: str | None = None  # how peaks were measured (or predicted)
    isolation: str | None = None  # where each trial ran (--isolation)
    partial: bool = False  # interrupted: the trials so far
    figures: dict[str, int] | None = None  # configurations by what their trials measured: memory+time, memory, none
    timed_after_memory_trial: int | None = None  # configurations timed after a memory trial of their own
    setup_s: float | None = None  # the trials' seconds before their first step (worker start, imports, model build)
    steps_s: float | None = None  # and in their steps
    host_budget_bytes: int | None = None  # --offload: what offloading plans could hold in host memory
    host_budget_source: str | None = None  # how that was set (None: no offloading plan was searched)
    # set by the stages after the analysis (None: the stage did not run)
    dry_run: bool | None = None  # --dry-run: the trials are predictions
    time_model: dict[str, Any] | None = None  # a dry run's time model: the machine or card, and its checked error
    cuda: dict[str, Any] | None = None  # a dry run for CUDA: the caching allocator's rules and their findings
    exact_limit: dict[str, Any] | None = None  # stage 5b: the recommended variant's limit, confirmed or bisected
    static_compile: dict[str, Any] | None = None  # stage 5c: the compiled recommendation timed static and dynamic
    eval_limits: dict[str, Any] | None = None  # how the evaluation limits were found
    # the venue's own figures (a worker venue's counts: workers_started, ...), and an older report's keys that this
    # version does not name, as they were
    more: dict[str, Any] = dataclasses.field(default_factory=dict)

    def but(self, **fields: Any) -> "SearchSection":
        """This section with ``fields`` set (a stage's own)."""
        return dataclasses.replace(self, **fields)

    def to_dict(self) -> dict[str, Any]:
        """The section as the report's JSON holds it: a stage's field only where the stage ran, the host budget only
        where offloading plans were searched, the venue's figures beside the rest."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "more"}
        for name in _STAGES:
            if data[name] is None:
                del data[name]
        if self.host_budget_source is None:
            del data["host_budget_bytes"], data["host_budget_source"]
        return {**data, **self.more}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SearchSection":
        """A section read back from a report's JSON (any schema version: what it lacks stays None)."""
        if isinstance(data, SearchSection):
            return data
        names = {f.name for f in dataclasses.fields(cls)} - {"more"}
        return cls(**{k: v for k, v in data.items() if k in names},
                   more={k: v for k, v in data.items() if k not in names})

    # read as the JSON object it was
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())
