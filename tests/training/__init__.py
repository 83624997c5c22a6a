"""Tests of :mod:`autotune.training`."""
