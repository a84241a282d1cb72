"""`python -m adaflash` runs the command line (the same as the `adaflash` script)."""

from adaflash.cli import main

main()
