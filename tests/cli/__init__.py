"""Tests of :mod:`autotune.cli`."""
