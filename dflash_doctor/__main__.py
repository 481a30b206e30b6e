"""``python -m dflash_doctor``: the CLI, for launchers that start a module (torchrun -m dflash_doctor sweep ...)."""

from dflash_doctor.cli import main

main()
