"""`python -m liger_cli` is `liger` (and `accelerate launch -m liger_cli train R` runs each rank)."""

from liger_cli.cli import main

if __name__ == "__main__":
    main()
