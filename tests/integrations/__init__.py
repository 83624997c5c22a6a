"""Tests of :mod:`autotune.integrations`."""
