"""Stage 7, the run: one process's training, set-up steps then one loop (`train.py`).

The backend objects (`backends/`) hold everything that differs between single process, DDP, FSDP
and DeepSpeed; the objective (`liger_cli.model.objectives`) says what a micro-batch's loss is; `evaluate.py`,
`checkpoint.py` (with `plain_state.py` and `fingerprint.py`), `output_dir.py` and `metrics.py` are
the loop's parts. The last stage: it may import every earlier one.
"""
