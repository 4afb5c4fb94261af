#!/usr/bin/env bash
# Proves the Dockerfile on a machine where no registry image can be pulled (no nvidia/cuda):
#   1. makes a stand-in base: a debootstrap'd Debian with the environment the CUDA base sets;
#   2. builds the image from it with buildah (chroot isolation, vfs storage: no daemon needed);
#   3. runs inside it `mnist-pipeline --version` and the entrypoint's default `dvc repro` on a small
#      slice of MNIST, both self-contained (the repo baked in, no git) and with a copy of the repo
#      mounted over /workspace as a non-root uid, as `docker run --user $(id -u):$(id -g) -v "$PWD":/workspace`.
# Everything lives under IMAGE_CHECK_DIR (default /var/tmp/mnist-image-check); the base is reused.
# Needs root (buildah with vfs), Debian's package mirror, and MNIST_SOURCE (default: ../shared/data/mnist).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=${IMAGE_CHECK_DIR:-/var/tmp/mnist-image-check}
mnist=$(realpath "${MNIST_SOURCE:-$root/../shared/data/mnist}")
base=localhost/cuda-standin:bookworm
image=localhost/mnist-pipeline:check
# The build uses this machine's pip setup: its extra indexes (a local wheel mirror, file://, is
# mounted read-only at the same path) and its CA bundle (for a TLS-intercepting proxy).
pip_index=${IMAGE_CHECK_PIP_INDEX-$(python3 -m pip config get global.extra-index-url 2>/dev/null || true)}
pip_cert=${IMAGE_CHECK_PIP_CERT-${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}}
mounts=()
for url in $pip_index; do
    case $url in file://*) dir=$(dirname "${url#file://}"); mounts+=(-v "$dir:$dir:ro") ;; esac
done
build_args=(--build-arg "PIP_EXTRA_INDEX_URL=$pip_index")
if [ -n "$pip_cert" ]; then
    mounts+=(-v "$(dirname "$pip_cert"):/etc/ssl/build-ca:ro")
    build_args+=(--build-arg "PIP_CERT=/etc/ssl/build-ca/$(basename "$pip_cert")")
fi

bah() { buildah --storage-driver vfs --root "$work/storage" --runroot "$work/run" "$@"; }
step() { printf '\n== %s (%ds)\n' "$*" "$SECONDS"; }

for tool in buildah debootstrap; do
    command -v "$tool" >/dev/null || { apt-get update -qq && apt-get install -y -qq "$tool"; }
done
mkdir -p "$work"

if ! bah inspect --type image "$base" >/dev/null 2>&1; then
    step "stand-in base: debootstrap Debian bookworm"
    rm -rf "$work/rootfs"
    debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log"
    tar -C "$work/rootfs" -cf "$work/rootfs.tar" .
    ctr=$(bah from scratch)
    bah add "$ctr" "$work/rootfs.tar" /
    # What nvidia/cuda's runtime image sets for the NVIDIA container toolkit.
    bah config --env NVIDIA_VISIBLE_DEVICES=all --env NVIDIA_DRIVER_CAPABILITIES=compute,utility \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
    bah commit --rm "$ctr" "$base"
    rm -rf "$work/rootfs" "$work/rootfs.tar"
fi

step "build $image FROM $base"
bah bud --isolation chroot --layers=false --build-arg "BASE_IMAGE=$base" "${build_args[@]}" "${mounts[@]}" \
    -t "$image" .

step "self-contained: mnist-pipeline --version"
ctr=$(bah from "$image")
trap 'bah rm "$ctr" >/dev/null 2>&1 || true' EXIT
bah run --isolation chroot --user 1000:1000 "$ctr" -- entrypoint mnist-pipeline --version

small_params() {  # params.yaml for a small slice: seconds per stage on a CPU
    "$root/.venv/bin/python" - "$1" "$2" <<'EOF'
import sys, yaml
params = yaml.safe_load(open(sys.argv[1]))
params["data"].update(train_limit=1100, val_size=100)
params["commcheck"].update(max_bytes=65536, iters=3)
params["train"].update(batch_size=100, nproc=2)
yaml.safe_dump(params, open(sys.argv[2], "w"), sort_keys=False)
EOF
}

step "self-contained, non-root uid 1000: entrypoint default (dvc repro without git) on a small slice"
small_params params.yaml "$work/small-params.yaml"
chmod 0644 "$work/small-params.yaml"
bah run --isolation chroot --user 1000:1000 -v "$work/small-params.yaml:/workspace/params.yaml:ro" \
    -v "$mnist:/mnist:ro" -e MNIST_SOURCE=/mnist "$ctr" -- entrypoint
bah run --isolation chroot --user 1000:1000 "$ctr" -- test -s /workspace/reports/comparison.md

step "mounted checkout, non-root uid 1000: entrypoint default (dvc repro) on a small slice"
checkout="$work/checkout"
rm -rf "$checkout"
mkdir -p "$checkout"
git ls-files -z | xargs -0 cp --parents -t "$checkout"
small_params params.yaml "$checkout/params.yaml"
git -C "$checkout" init -q
git -C "$checkout" add -A
git -C "$checkout" -c user.name=check -c user.email=check@localhost commit -qm "image check"
chown -R 1000:1000 "$checkout"
bah run --isolation chroot --user 1000:1000 -v "$checkout:/workspace" -v "$mnist:/mnist:ro" \
    -e MNIST_SOURCE=/mnist "$ctr" -- entrypoint

step "outputs on the host, owned by uid 1000"
for mode in single dp ddp; do
    test -s "$checkout/metrics/eval/$mode.json"
done
test "$(stat -c %u "$checkout/reports/comparison.md")" = 1000
cat "$checkout/reports/comparison.md" | head -8
step "image check passed"
