"""Stage 1, the recipe: a YAML file validated into typed objects (`schema.py`) by `load.py`.

`describe.py` reads the schema as data (every key, default and description) for `liger init`
(`starter.py`) and the generated recipe reference.

Everything after it reads the `Recipe`; nothing on disk changes until the whole recipe is valid.
May import nothing of liger_cli but `errors`.
"""

from liger_cli.recipe.load import load_recipe
from liger_cli.recipe.schema import KernelsSection, LoggingSection, Recipe, TrainingSection

__all__ = ["KernelsSection", "LoggingSection", "Recipe", "TrainingSection", "load_recipe"]
