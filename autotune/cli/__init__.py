"""The command line's presentation: progress lines and the bar while a search runs.

``python -m autotune`` itself is :mod:`autotune.__main__`. May import anything below the tuner;
nothing in the package imports it.
"""
