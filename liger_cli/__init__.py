"""liger: a command-line fine-tuning launcher for large language models."""

__version__ = "0.1.0"
