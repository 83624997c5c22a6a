"""Tests of :mod:`autotune.search`."""
