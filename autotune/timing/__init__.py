"""Step time, measured or predicted: each op's work counted, priced on a machine (a card's data sheet, or this CPU
calibrated).

``cards`` (the table of GPUs, ``cards.json``) and ``model`` (the price of a step's work) import no torch;
``counting`` (the dispatch mode that counts a step's ops) and ``calibration`` (this CPU measured, cached) do.
"""
