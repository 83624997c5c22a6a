"""The package logger and notices said once per process."""

import logging
import uuid

from autotune._log import logger, notice_once


def _fresh(text):  # notices are remembered for the whole process: each test says its own
    return f"{text} ({uuid.uuid4().hex})"


def _said(caplog, message):
    return [r for r in caplog.records if r.name == "autotune" and r.getMessage() == message]


def test_the_package_logger_is_autotune():
    assert logger.name == "autotune" and logger is logging.getLogger("autotune")


def test_a_notice_is_logged_once_at_warning_level(caplog):
    caplog.set_level(logging.WARNING, logger="autotune")
    message = _fresh("NVML figures are off")
    notice_once(message)
    notice_once(message)
    notice_once(message)
    records = _said(caplog, message)
    assert len(records) == 1 and records[0].levelno == logging.WARNING


def test_different_notices_are_each_logged(caplog):
    caplog.set_level(logging.WARNING, logger="autotune")
    first, second = _fresh("first"), _fresh("second")
    for message in (first, second, first, second):
        notice_once(message)
    assert len(_said(caplog, first)) == 1 and len(_said(caplog, second)) == 1
    assert [r.getMessage() for r in caplog.records if r.getMessage() in (first, second)] == [first, second]


def test_a_notice_stays_said_across_tests_and_log_captures(caplog):
    message = _fresh("said before")
    caplog.set_level(logging.WARNING, logger="autotune")
    notice_once(message)
    caplog.clear()
    notice_once(message)
    assert _said(caplog, message) == []


def test_a_notice_with_percent_signs_is_logged_as_written(caplog):
    # The message is logged as it is, not as a format string with arguments missing.
    caplog.set_level(logging.WARNING, logger="autotune")
    message = _fresh("90% of the budget, %s and %d stay literal")
    notice_once(message)
    assert len(_said(caplog, message)) == 1


def test_a_librarys_record_on_stderr_keeps_its_loggers_name():
    """The command's stderr says autotune's lines as ``autotune: ...`` and another library's with its logger's name
    (bitsandbytes warns at import), so that a library's warning is not read as autotune's."""
    import subprocess
    import sys

    code = ("import logging; from autotune._log import log_to_stderr, logger; log_to_stderr(); "
            "logger.warning('ours'); logging.getLogger('autotune.x').warning('ours too'); "
            "logging.getLogger('somelib.ops').warning('theirs')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stderr.splitlines() == ["autotune: ours", "autotune: ours too", "autotune: [somelib.ops] theirs"]
