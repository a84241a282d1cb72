"""`python -m adaflash.cli` (what the stack and the serving bench spawn): the same as `adaflash`."""

from adaflash.cli import main

main()
