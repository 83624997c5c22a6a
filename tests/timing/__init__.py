"""Tests of :mod:`autotune.timing`."""
