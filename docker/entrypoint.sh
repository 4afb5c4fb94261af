#!/bin/sh
# No arguments: the whole pipeline (`dvc repro`). Anything else runs as given, e.g.
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
fi
exec "$@"
