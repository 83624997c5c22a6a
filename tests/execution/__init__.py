"""Tests of :mod:`autotune.execution`."""
