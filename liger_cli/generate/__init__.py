"""Stage 4, generation: one engine that samples from a model (`engine.py`), and what it takes to talk
to a trained model the way it was trained: its output loaded as the run loaded it (`load.py`) and
prompts rendered as the run's data format rendered them, with the stops the template ends a turn
with (`prompts.py`). `liger generate`, `liger chat` (`liger_cli/serve/`), the run's evaluation
samples and online RL all call the same engine.

May import `recipe`, `data` and `model`.
"""
