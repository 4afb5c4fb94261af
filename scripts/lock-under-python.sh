#!/usr/bin/env bash
# The image installs requirements.lock with its base's python3: 3.12 on nvidia/cuda's ubuntu24.04,
# where image-check's stand-in (Debian bookworm) can only give 3.11. This installs the lock, every
# hash checked, into a venv of a Python 3.12 on this host (pyenv's, or python3.12 on PATH), then
# prepares and trains single in a copy of CHECKOUT (its params.yaml as it is) with that venv, and
# prints the weights' sha256 for image-check to set beside the image's and the 3.11 venv's.
#
#   bash scripts/lock-under-python.sh CHECKOUT WORK [VERSION]    # VERSION default 3.12
#
# Exit 77 with one line when no such Python is on this host (any other failure: its own code).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
checkout=$1 work=$2 version=${3:-3.12}
python=$(ls -d /root/.pyenv/versions/"$version".*/bin/python"$version" 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$python" ]; then
    python=$(command -v "python$version" || true)
    case $python in */shims/*) python= ;; esac  # a pyenv shim may name no interpreter
fi
[ -n "$python" ] || { echo "lock-under-python: no Python $version on this host (pyenv install $version, or put python$version on PATH)" >&2; exit 77; }

venv="$work/venv-$version"
if [ ! -f "$venv/.locked" ] || ! cmp -s "$venv/.locked" "$root/requirements.lock"; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes \
        -r "$root/requirements.lock" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    cp "$root/requirements.lock" "$venv/.locked"
fi
copy="$work/checkout-$version"
rm -rf "$copy" && mkdir -p "$copy"
(cd "$checkout" && git -c safe.directory="$checkout" ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$copy")
cp "$checkout/params.yaml" "$copy/params.yaml"
# `python -m pipeline` from the copy: its own code, not an installed package's.
# The copy's folder first on sys.path (`python -m`), which PYTHONSAFEPATH would drop.
(cd "$copy" && unset PYTHONSAFEPATH && "$venv/bin/python" -I -c 'import sys; print(sys.version.split()[0])' >&2 \
    && "$venv/bin/python" -m pipeline prepare >&2 \
    && "$venv/bin/python" -m pipeline train --mode single >&2)
"$venv/bin/python" -c '
import hashlib, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from pipeline import record
assert record.__file__.startswith(sys.argv[1]), record.__file__
print(sys.version.split()[0], record.files_digest(Path(sys.argv[1]) / "data/prepared"),
      record.saved_weights_digest(Path(sys.argv[1]) / "models/single/model.pt"))' "$copy"
