"""Progress on stderr: a bar on a terminal, plain lines in a log, nothing when quiet; the tuner's events."""

import io

import autotune
from autotune.cli.progress import Progress

TINY = {"n_layer": 2, "block_size": 16, "n_embd": 16, "n_head": 2, "vocab_size": 32}


class _Terminal(io.StringIO):
    def isatty(self):
        return True


class _Recorder:
    def __init__(self):
        self.events = []

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.events.append((name, args, kwargs))


def _tune(tmp_path, progress, strategy="grid"):
    return autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, device="cpu", budget="600KiB",
                         precisions="fp32", segments="0,2", batch_sizes="1,2,4", measure_steps=1, probe=False,
                         strategy=strategy, storage=f"sqlite:///{tmp_path}/p.db", study=strategy, progress=progress)


def test_the_tuner_reports_each_event_in_order(tmp_path):
    rec = _Recorder()
    report = _tune(tmp_path, rec)
    names = [name for name, _, _ in rec.events]
    assert names[0] == "search_started" and rec.events[0][2]["planned"] == 6 and rec.events[0][2]["space_size"] == 6
    assert names.count("trial_started") == names.count("trial_done") == len(report.trials) == 6
    for i, name in enumerate(names):
        if name == "trial_done":  # each measurement follows the start of the same configuration
            assert names[i - 1] == "trial_started" and rec.events[i - 1][1][0] == rec.events[i][1][0].config
    assert names[-1] == "search_done"


def test_a_strategy_that_does_not_know_its_trial_count_reports_none_planned(tmp_path):
    rec = _Recorder()
    _tune(tmp_path, rec, strategy="auto")
    assert rec.events[0][2]["planned"] is None


def test_a_log_gets_plain_lines_and_a_terminal_gets_a_bar_with_the_best_so_far(tmp_path):
    log, terminal, quiet = io.StringIO(), _Terminal(), _Terminal()
    for stream, options, study in ((log, {}, "a"), (terminal, {}, "b"), (quiet, {"quiet": True}, "c")):
        progress = Progress(stream=stream, **options)
        autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, device="cpu", budget="600KiB", precisions="fp32",
                      segments="0", batch_sizes="1,2", measure_steps=1, probe=False, strategy="grid",
                      storage=f"sqlite:///{tmp_path}/{study}.db", study=study, progress=progress)
    lines = log.getvalue().splitlines()
    assert [line.split(":")[1].strip() for line in lines] == ["[1] fp32 segments=0 batch=1", "[2] fp32 segments=0 batch=2"]
    assert "\r" not in log.getvalue()
    shown = terminal.getvalue()
    assert "grid search: 2/2 trials" in shown and "best fp32 segments=0 batch=" in shown and "samples/s" in shown
    assert "running fp32 segments=0 batch=2" in shown
    assert "autotune: [2] fp32 segments=0 batch=2: ok" in shown  # finished trials are printed above the bar
    assert quiet.getvalue() == ""
