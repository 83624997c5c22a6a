"""Tests of :mod:`autotune.export`."""
