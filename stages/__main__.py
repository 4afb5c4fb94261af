"""`python -m stages`: the CLI, for launchers that start a module (torchrun -m, the DDP workers)."""

from stages.entry import main

main()
