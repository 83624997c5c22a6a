"""The command line's presentation: its parsers, the progress lines and bar, and the table a run prints.

* :mod:`~autotune.cli.parser`: the flags, built from :class:`autotune.options.Options`.
* :mod:`~autotune.cli.progress`: progress on stderr while a search runs.
* :mod:`~autotune.report.table`: the text table of a report (``Report.table()``).

``python -m autotune`` itself is :mod:`autotune.__main__`. May import the options, records,
units and the analysis; imports no torch.
"""
