"""Tests of :mod:`autotune.report`."""
