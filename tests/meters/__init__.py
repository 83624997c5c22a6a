"""Tests of :mod:`autotune.meters`."""
