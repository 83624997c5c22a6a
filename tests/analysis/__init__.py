"""Tests of :mod:`autotune.analysis`."""
