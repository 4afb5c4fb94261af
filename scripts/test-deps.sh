#!/usr/bin/env bash
# What the tests start for real, from Debian's packages: Slurm with munge, PostgreSQL and the
# namespace tools (iproute2, util-linux) for the multinode tests, and headless Chromium for the
# MLflow UI test. Installed once, as root; without root the multinode tests skip and say why.
set -euo pipefail

if [[ $(id -u) != 0 ]]; then
  echo "test-deps: not root, so nothing installed; the multinode tests will be skipped" >&2
  exit 0
fi
missing=()
command -v slurmctld >/dev/null || missing+=(slurm-wlm)
command -v munged >/dev/null || missing+=(munge)
command -v ip >/dev/null || missing+=(iproute2)
command -v nsenter >/dev/null || missing+=(util-linux)
command -v chromium >/dev/null || missing+=(chromium fonts-dejavu-core)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null || missing+=(postgresql)
if (( ${#missing[@]} )); then
  echo "test-deps: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
