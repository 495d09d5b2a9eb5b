"""Stage 2, the data: from the recipe's `data` section to the examples the run trains on.

`files.py` reads and checks rows, `encode.py` and `chat.py` turn them into token ids and labels
(`images.py` and `image_rows.py` for chat rows with images, through the model's processor),
`build.py` truncates, drops and packs (the one path `liger train` and `liger data` share),
`batches.py` says which examples each rank takes at each step, `report.py` is `liger data`, and
`tokenizer.py` loads the tokenizer. May import `recipe` (and `errors`), nothing later in the flow.
"""

from liger_cli.data.build import WARNINGS, Split, build_datasets, collate, prepare_data

__all__ = ["WARNINGS", "Split", "build_datasets", "collate", "prepare_data"]
