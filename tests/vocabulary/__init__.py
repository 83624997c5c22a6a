"""Tests of :mod:`autotune.vocabulary`."""
