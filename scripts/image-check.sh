#!/usr/bin/env bash
# Proves the Dockerfile on a machine where no registry image can be pulled (no nvidia/cuda), and
# runs every `docker` command the README shows (less --gpus and --ipc, which need a GPU host):
#   1. makes a stand-in for nvidia/cuda:*-base-ubuntu24.04 (see STAND-IN below);
#   2. builds the image from it with buildah (chroot isolation, vfs storage: no daemon needed);
#   3. inside it: `mnist-pipeline --version`; `gpu-check` (every CUDA check skipped, and said so);
#      the entrypoint's default `dvc repro` on a small slice
#      of MNIST, self-contained (the repo baked in, no git) and with a checkout mounted over
#      /workspace as a non-root uid; one stage's command on that checkout; and training that logs
#      to an MLflow server on the host, as `--network host -e MLFLOW_TRACKING_URI=...` does.
# Everything lives under IMAGE_CHECK_DIR (default /var/tmp/mnist-image-check); the base is reused,
# and so is the image with IMAGE_CHECK_REUSE_IMAGE=1 (to iterate on the steps after the build).
# Needs root (buildah with vfs), a Debian mirror (this machine's apt one, or IMAGE_CHECK_DEBIAN_MIRROR),
# and MNIST_SOURCE (default: ../shared/data/mnist).
#
# STAND-IN: what it reproduces of the real base, and what it cannot.
#   Reproduced: a minimal distribution userland with no Python (the Dockerfile installs its own);
#   the user `ubuntu` and group `ubuntu` with uid and gid 1000 that ubuntu:24.04 (so every
#   nvidia/cuda:*-ubuntu24.04) ships, home /home/ubuntu; the environment the CUDA base layer sets:
#   NVARCH, NVIDIA_REQUIRE_CUDA (its cuda>= clause), CUDA_VERSION, NVIDIA_VISIBLE_DEVICES=all,
#   NVIDIA_DRIVER_CAPABILITIES=compute,utility, PATH with /usr/local/nvidia/bin:/usr/local/cuda/bin,
#   LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64.
#   Not reproduced: Ubuntu itself (Debian bookworm instead: Ubuntu's archive is not reachable here),
#   so apt installs Python 3.11 where Ubuntu 24.04 installs 3.12 (the last step installs the lock
#   under a 3.12 of this host instead: scripts/lock-under-python.sh); NVIDIA's apt repository and the
#   cuda-cudart and cuda-compat packages under /usr/local/cuda (no GPU here to use them); the
#   driver libraries the NVIDIA container toolkit mounts at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=${IMAGE_CHECK_DIR:-/var/tmp/mnist-image-check}
mnist=$(realpath "${MNIST_SOURCE:-$root/../shared/data/mnist}")
# The tag changes whenever the stand-in's definition does, so an older stand-in is never reused.
base=localhost/cuda-standin:13.0.1-base-ubuntu24.04-$(sed -n '/^make_base()/,/^}/p' "$0" | sha256sum | cut -c1-12)
image=localhost/mnist-pipeline:check
# The build uses this machine's pip setup: its extra indexes (a local wheel mirror, file://, is
# mounted read-only at the same path) and its CA bundle (for a TLS-intercepting proxy).
pip_index=${IMAGE_CHECK_PIP_INDEX-$(python3 -m pip config get global.extra-index-url 2>/dev/null || true)}
pip_cert=${IMAGE_CHECK_PIP_CERT-${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}}
mounts=()
for url in $pip_index; do
    case $url in file://*) dir=$(dirname "${url#file://}"); [ -d "$dir" ] && mounts+=(-v "$dir:$dir:ro") ;; esac
done
build_args=(--build-arg "PIP_EXTRA_INDEX_URL=$pip_index")
if [ -n "$pip_cert" ]; then
    mounts+=(-v "$(dirname "$pip_cert"):/etc/ssl/build-ca:ro")
    build_args+=(--build-arg "PIP_CERT=/etc/ssl/build-ca/$(basename "$pip_cert")")
fi

bah() { buildah --storage-driver vfs --root "$work/storage" --runroot "$work/run" "$@"; }
# `docker run` of the image. chroot isolation shares the host's network, as `docker run --network
# host` does, so the container is named as Docker names one there: the host's name, which the
# host's /etc/hosts (copied in) resolves. Left alone, buildah names it by its id with no /etc/hosts
# line, which Docker's default network does add (with the container's address): gloo would then
# warn "Unable to resolve hostname" on every DDP start, where Docker prints nothing.
host_name=$(hostname)
crun() { bah run --isolation chroot --hostname "$host_name" "$@"; }
no_gloo_fallback() {  # gloo found this container's address by its name, as it does under Docker
    if grep -q "Unable to resolve hostname" "$1"; then
        echo "image-check: gloo could not resolve the container's host name ($1)" >&2
        exit 1
    fi
}
step() { printf '\n== %s (%ds)\n' "$*" "$SECONDS"; }

# The Debian mirror this machine's apt uses (deb822 or one-line sources), unless
# IMAGE_CHECK_DEBIAN_MIRROR names another.
debian_mirror() {
    local mirror=${IMAGE_CHECK_DEBIAN_MIRROR:-}
    if [ -z "$mirror" ]; then
        mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    fi
    if [ -z "$mirror" ]; then
        mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    fi
    [ -n "$mirror" ] || { echo "no Debian mirror in /etc/apt: set IMAGE_CHECK_DEBIAN_MIRROR" >&2; exit 1; }
    echo "$mirror"
}

make_base() {
    rm -rf "$work/rootfs"
    debootstrap --variant=minbase bookworm "$work/rootfs" "$(debian_mirror)" >"$work/debootstrap.log"
    # ubuntu:24.04's own user: uid and gid 1000, the ids the Dockerfile's user needs.
    chroot "$work/rootfs" groupadd --gid 1000 ubuntu
    chroot "$work/rootfs" useradd --create-home --uid 1000 --gid 1000 --shell /bin/bash --comment Ubuntu ubuntu
    tar -C "$work/rootfs" -cf "$work/rootfs.tar" .
    ctr=$(bah from scratch)
    bah add "$ctr" "$work/rootfs.tar" /
    # The environment the base layer of nvidia/cuda:*-base-ubuntu24.04 sets, which the NVIDIA
    # container toolkit reads. NVIDIA_REQUIRE_CUDA keeps its `cuda>=` clause; the real one adds
    # per-brand driver clauses that only widen it, not checked here.
    bah config \
        --env NVARCH=x86_64 \
        --env "NVIDIA_REQUIRE_CUDA=cuda>=13.0" \
        --env CUDA_VERSION=13.0.1 \
        --env PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 \
        --env NVIDIA_VISIBLE_DEVICES=all \
        --env NVIDIA_DRIVER_CAPABILITIES=compute,utility \
        --label "maintainer=NVIDIA CORPORATION <cudatools@nvidia.com>" \
        --cmd /bin/bash "$ctr"
    bah commit --rm "$ctr" "$base"
    rm -rf "$work/rootfs" "$work/rootfs.tar"
}

for tool in buildah debootstrap; do
    command -v "$tool" >/dev/null || { apt-get update -qq && apt-get install -y -qq "$tool"; }
done
mkdir -p "$work"

if ! bah inspect --type image "$base" >/dev/null 2>&1; then
    step "stand-in base $base: debootstrap Debian bookworm, user ubuntu (1000:1000), the CUDA base's environment"
    make_base
fi
# The facts the Dockerfile depends on, checked on the stand-in as built.
probe=$(bah from "$base")
bah run --isolation chroot "$probe" -- sh -c \
    'test "$(id -u ubuntu):$(id -g ubuntu)" = 1000:1000 && ! command -v python3 && test "$NVIDIA_VISIBLE_DEVICES" = all'
bah rm "$probe" >/dev/null

if [ -n "${IMAGE_CHECK_REUSE_IMAGE:-}" ] && bah inspect --type image "$image" >/dev/null 2>&1; then
    step "reusing $image (IMAGE_CHECK_REUSE_IMAGE): only the run steps"
else
    step "docker build -t mnist-pipeline .   (buildah bud FROM $base)"
    bah bud --isolation chroot --layers=false --build-arg "BASE_IMAGE=$base" \
        --build-arg "SOURCE_COMMIT=$(git describe --always --dirty --abbrev=40)" "${build_args[@]}" "${mounts[@]}" \
        -t "$image" .
fi
bah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E "mnist-pipeline:check|cuda-standin" || true
bah inspect --type image --format '{{range .OCIv1.RootFS.DiffIDs}}{{.}} {{end}}' "$image" >/dev/null

ctr=$(bah from "$image")
trap 'bah rm "$ctr" >/dev/null 2>&1 || true' EXIT
step "the image: user trainer is 1000:1000, dumb-init for PID 1, mnist-pipeline --version"
crun --user 1000:1000 "$ctr" -- sh -c \
    'test "$(id -un 1000):$(id -gn 1000)" = trainer:trainer && command -v dumb-init && test -w /workspace'
crun --user 1000:1000 "$ctr" -- entrypoint mnist-pipeline --version

step "the image says what it was built from: /etc/mnist-pipeline/image.json"
crun "$ctr" -- cat /etc/mnist-pipeline/image.json | tee "$work/image.json"
"$root/.venv/bin/python" - "$work/image.json" "$base" "$root/requirements.lock" <<'PY'
import hashlib, json, sys
facts = json.load(open(sys.argv[1]))
assert facts["base"] == sys.argv[2], facts
assert facts["requirements_lock_sha256"] == hashlib.sha256(open(sys.argv[3], "rb").read()).hexdigest(), facts
assert facts["source_commit"] not in ("", "unknown"), facts
PY

small_params() {  # params.yaml for a small slice: seconds per stage on a CPU
    "$root/.venv/bin/python" - "$1" "$2" <<'PY'
import sys, yaml
params = yaml.safe_load(open(sys.argv[1]))
params["data"].update(train_limit=1100, val_size=100)
params["commcheck"].update(max_bytes=65536, iters=3)
params["train"].update(batch_size=100, nproc=2)
params["evaluate"].update(min_test_accuracy=0.5)
yaml.safe_dump(params, open(sys.argv[2], "w"), sort_keys=False)
PY
}

step "gpu-check: docker run --gpus all --ipc=host -v /path/to/mnist:/mnist:ro -e MNIST_SOURCE=/mnist mnist-pipeline gpu-check"
# No GPU here: it must start, run its CUDA tests (all skipped) and say what it skipped.
crun --user 1000:1000 -v "$mnist:/mnist:ro" -e MNIST_SOURCE=/mnist "$ctr" -- \
    entrypoint gpu-check | tee "$work/gpu-check.out"
grep -q "no CUDA device on this host; nothing proven" "$work/gpu-check.out"
grep -q "test_ddp_on_every_gpu_agrees_with_single .*skipped" "$work/gpu-check.out"

step "self-contained: docker run -v /path/to/mnist:/mnist:ro -e MNIST_SOURCE=/mnist mnist-pipeline"
small_params params.yaml "$work/small-params.yaml"
chmod 0644 "$work/small-params.yaml"
crun --user 1000:1000 -v "$work/small-params.yaml:/workspace/params.yaml:ro" \
    -v "$mnist:/mnist:ro" -e MNIST_SOURCE=/mnist "$ctr" -- entrypoint
crun --user 1000:1000 "$ctr" -- test -s /workspace/reports/comparison.md

step "mounted checkout: docker run --user 1000:1000 -v \"\$PWD\":/workspace -v /path/to/mnist:/mnist:ro -e MNIST_SOURCE=/mnist mnist-pipeline"
checkout="$work/checkout"
rm -rf "$checkout"
mkdir -p "$checkout"
# The working tree as git sees it: tracked files and new ones not ignored.
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$checkout"
small_params params.yaml "$checkout/params.yaml"
git -C "$checkout" init -q
git -C "$checkout" add -A
git -C "$checkout" -c user.name=check -c user.email=check@localhost commit -qm "image check"
chown -R 1000:1000 "$checkout"
mounted=(--user 1000:1000 -v "$checkout:/workspace")
crun "${mounted[@]}" -v "$mnist:/mnist:ro" -e MNIST_SOURCE=/mnist "$ctr" -- entrypoint 2>&1 | tee "$work/repro.out"
no_gloo_fallback "$work/repro.out"  # commcheck's and train@ddp's workers
for mode in single dp ddp; do
    test -s "$checkout/results/eval/$mode.json"
done
test "$(stat -c %u "$checkout/reports/comparison.md")" = 1000
head -8 "$checkout/reports/comparison.md"

step "one command: docker run --user 1000:1000 -v \"\$PWD\":/workspace mnist-pipeline mnist-pipeline train --mode ddp"
crun "${mounted[@]}" "$ctr" -- entrypoint mnist-pipeline train --mode ddp 2>&1 | tee "$work/ddp.out"
no_gloo_fallback "$work/ddp.out"
test "$(stat -c %u "$checkout/models/ddp/model.pt")" = 1000

step "train.compile in the image: docker run ... mnist-pipeline train --mode ddp --params compile.yaml"
"$root/.venv/bin/python" - "$checkout/params.yaml" "$checkout/compile.yaml" <<'PY'
import sys, yaml
params = yaml.safe_load(open(sys.argv[1]))
params["train"]["compile"] = True
yaml.safe_dump(params, open(sys.argv[2], "w"), sort_keys=False)
PY
chown 1000:1000 "$checkout/compile.yaml"
crun "${mounted[@]}" "$ctr" -- entrypoint mnist-pipeline train --mode ddp --params compile.yaml 2>&1 \
    | tee "$work/compile.out"
grep -Eq "ddp: torch.compile \(train.compile\): [1-9][0-9]* graph\(s\) compiled" "$work/compile.out"

step "MLflow on the host: docker run --network host -e MLFLOW_TRACKING_URI=http://127.0.0.1:PORT ... train --mode single"
port=$("$root/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
rm -rf "$work/mlflow" && mkdir -p "$work/mlflow"
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false "$root/.venv/bin/mlflow" server --host 127.0.0.1 --port "$port" --workers 1 \
    --backend-store-uri "sqlite:///$work/mlflow/mlflow.db" --artifacts-destination "$work/mlflow/artifacts" \
    >"$work/mlflow/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; bah rm "$ctr" >/dev/null 2>&1 || true' EXIT
for _ in $(seq 120); do curl -fs "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
# chroot isolation shares the host's network, as --network host does.
crun "${mounted[@]}" -e "MLFLOW_TRACKING_URI=http://127.0.0.1:$port" "$ctr" -- \
    entrypoint mnist-pipeline train --mode single
"$root/.venv/bin/python" - "$port" "$work/image.json" <<'PY'
import json, sys
from mlflow import MlflowClient
client = MlflowClient(f"http://127.0.0.1:{sys.argv[1]}")
runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "attributes.run_name = 'single'")
assert runs and runs[0].info.status == "FINISHED", runs
facts = json.load(open(sys.argv[2]))
tags = runs[0].data.tags
assert (tags["image_base"], tags["image_source_commit"]) == (facts["base"], facts["source_commit"]), tags
print(f"run {runs[0].info.run_id} FINISHED on the host's server, tagged with the image it ran in")
PY

step "the same weights in the image, in this host's venv and with the lock under Python 3.12: single on the small slice, all on this CPU"
host="$work/host-checkout"
rm -rf "$host" && mkdir -p "$host"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$host"
cp "$checkout/params.yaml" "$host/params.yaml"
(cd "$host" && MNIST_SOURCE="$mnist" "$root/.venv/bin/mnist-pipeline" prepare \
    && "$root/.venv/bin/mnist-pipeline" train --mode single)
# The real base's python3 is 3.12, the stand-in's 3.11: the lock under 3.12 too, on this host.
set +e
py312=$(MNIST_SOURCE="$mnist" bash scripts/lock-under-python.sh "$checkout" "$work" 3.12)
status=$?
set -e
case $status in
    0) ;;
    77) echo "image-check: the lock under Python 3.12 NOT checked: no Python 3.12 on this host" >&2; py312= ;;
    *) echo "image-check: the lock under Python 3.12 failed (scripts/lock-under-python.sh exit $status)" >&2; exit 1 ;;
esac
"$root/.venv/bin/python" - "$checkout" "$host" "$py312" <<'PY'
import platform, sys
from pathlib import Path
from pipeline import record
image, host = (Path(p) for p in sys.argv[1:3])
rows = [(name, record.files_digest(p / "data/prepared"), record.saved_weights_digest(p / "models/single/model.pt"))
        for name, p in (("image", image), (f"host venv, Python {platform.python_version()}", host))]
if sys.argv[3]:  # "VERSION DATA WEIGHTS" from scripts/lock-under-python.sh
    version, data, weights = sys.argv[3].split()
    rows.append((f"lock under Python {version}", data, weights))
print(f"{'trained in':<28}  {'prepared data (sha256)':<64}  weights of single (sha256)")
for name, data, weights in rows:
    print(f"{name:<28}  {data}  {weights}")
for name, data, weights in rows[1:]:
    assert data == rows[0][1], f"the prepared data differ ({name}): prepare is not the same in the image"
    assert weights == rows[0][2], f"the weights differ ({name}): the result changes on this CPU"
print("the same data and the same weights, bit for bit")
PY
step "image check passed"
