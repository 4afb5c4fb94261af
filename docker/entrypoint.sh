#!/bin/sh
# No arguments: the whole pipeline (`dvc repro`). `gpu-check`: `make gpu-check`'s checks and table
# (docker run --gpus all --ipc=host -v /path/to/mnist:/mnist:ro -e MNIST_SOURCE=/mnist IMAGE gpu-check).
# Anything else runs as given, e.g.
#   docker run ... IMAGE mnist-pipeline train --mode ddp
set -e

# Under `--user $(id -u):$(id -g)` the uid may have no home: tools that cache there get /tmp.
if [ ! -w "${HOME:-/nonexistent}" ]; then
    export HOME=/tmp
fi

if [ "$#" -eq 0 ]; then
    # The baked-in copy has no .git (it is not in the build context): DVC then runs without an
    # SCM, as after `dvc init --no-scm`. A mounted checkout keeps its git history.
    if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        dvc config --local core.no_scm true
    fi
    set -- dvc repro
elif [ "$1" = gpu-check ]; then
    shift
    set -- python scripts/gpu_check.py "$@"
fi

# `docker stop` sends SIGTERM to PID 1, which the kernel does not deliver to a process that has no
# handler for it, so a run exec'd as PID 1 is SIGKILLed after the grace period with its MLflow runs
# left RUNNING. dumb-init, as PID 1, forwards the signal to the run's whole process group, as Ctrl-C
# (SIGINT): `dvc repro` dies at once on SIGTERM but on Ctrl-C waits for its stage, which ends its
# runs FAILED; PID 1 must outlive them, as leaving the PID namespace kills whatever is left in it.
if command -v dumb-init >/dev/null 2>&1; then
    exec dumb-init --rewrite 15:2 -- "$@"
fi
exec "$@"
