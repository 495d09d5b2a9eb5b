"""Stage 4, the twin checks: the user's own architecture, shrunk to a tiny twin a CPU trains in a
fraction of a second (`shrink*.py`, `tiny.py`; a vision-language twin's batch carries an image:
`vision_batch.py`), on which liger proves what it changes computes what the model computes
(`kernel_check.py`: each kernel, loss and every gradient, patched vs not), and that packing and
accumulation do not change the math (`pipeline_check.py`: packed rows vs each example alone;
micro-batch 4 x accumulation 1 vs 1 x 4).

Whatever cannot be proven is left alone and said. May import `recipe`, `data` and `model`.
"""
