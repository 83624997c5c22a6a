"""Tests of :mod:`autotune.plans`."""
