# The pipeline on NVIDIA GPUs: `docker run --gpus all --ipc=host IMAGE` runs `dvc repro`.
# The -base flavour of the CUDA image: the CUDA compat libraries and the environment the NVIDIA
# container toolkit reads, and no CUDA libraries. torch's wheels bring their own (cuBLAS, cuDNN,
# NCCL, ... as nvidia-* packages), so -runtime would only add second copies of them.
# Pinned by digest beside its tag: a tag can be moved to other contents, a digest cannot. To move
# on, pick the new tag and pin what it points at now: `docker buildx imagetools inspect
# nvidia/cuda:TAG` prints the digest (the multi-platform index's, which docker resolves per platform).
ARG BASE_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04@sha256:f8ef28f579ea42a44b415d2c5d46f788e6a9b395c6c83f2929416e1fc192c143
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# Versions come with the base image's release; the Python packages below are locked with hashes.
# Ubuntu 23.04 and newer ship a user `ubuntu` with uid and gid 1000, the ids a host user usually
# has: whoever holds them makes way for `trainer`, so files written into a mounted checkout are the
# host user's.
# g++ and Python's headers: train.compile's kernels (TorchInductor's C++ ones on the CPU, Triton's
# launcher on GPUs) are built where they run.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ git ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    # DVC refuses a repository owned by another uid: a mounted checkout usually is. Only the
    # workspace is trusted so: '*' would let any repository on a mounted volume run its hooks.
    && git config --system --add safe.directory /workspace \
    && python3 -m venv "$VIRTUAL_ENV" \
    && if user=$(id -nu 1000 2>/dev/null); then userdel --remove "$user"; fi \
    && if group=$(getent group 1000); then groupdel "${group%%:*}"; fi \
    && groupadd --gid 1000 trainer \
    && useradd --create-home --uid 1000 --gid 1000 trainer

# The lock before the source, so editing code does not reinstall torch.
# For builds behind a local package index or a TLS-intercepting proxy (scripts/image-check.sh):
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_CERT=""
COPY requirements.lock /tmp/requirements.lock
RUN pip install --no-cache-dir --require-hashes -r /tmp/requirements.lock

WORKDIR /workspace
COPY --chown=1000:1000 . /workspace
# What the image was built from, written into it for every run in it to record (pipeline/record.py):
# `docker build --build-arg SOURCE_COMMIT=$(git describe --always --dirty --abbrev=40) .` Declared
# here, last: a RUN after an ARG sees it, so a new commit rebuilds only this layer, not torch's.
ARG BASE_IMAGE
ARG SOURCE_COMMIT=unknown
# Editable: with the repository mounted over /workspace, the mounted code is what runs.
# The folder itself (made by WORKDIR as root) must be the user's too: stages create data/, models/...
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e /workspace \
    && install -m 0755 docker/entrypoint.sh /usr/local/bin/entrypoint \
    && chown 1000:1000 /workspace \
    && mkdir -p /etc/mnist-pipeline \
    && lock=$(sha256sum /tmp/requirements.lock) \
    && printf '{"base": "%s", "source_commit": "%s", "requirements_lock_sha256": "%s"}\n' \
        "$BASE_IMAGE" "$SOURCE_COMMIT" "${lock%% *}" > /etc/mnist-pipeline/image.json

USER 1000:1000
# The entrypoint runs dumb-init as PID 1, so `docker stop` ends a run cleanly (docker/entrypoint.sh).
ENTRYPOINT ["entrypoint"]
