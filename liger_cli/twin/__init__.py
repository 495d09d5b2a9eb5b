"""Stage 4, the twin checks: the user's own architecture, shrunk to a tiny twin a CPU trains in a
fraction of a second (`shrink*.py`, `tiny.py`), on which liger proves what it changes computes what
the model computes (`kernel_check.py`: each kernel, loss and every gradient, patched vs not).

Whatever cannot be proven is left alone and said. May import `recipe`, `data` and `model`.
"""
