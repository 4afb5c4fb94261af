# The pipeline on NVIDIA GPUs: `docker run --gpus all --ipc=host IMAGE` runs `dvc repro`.
# torch's wheels bring their own CUDA libraries; the base brings the CUDA user-space setup and the
# environment the NVIDIA container toolkit reads. BASE_IMAGE names the CUDA release and Ubuntu.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# Versions come with the base image's release; the Python packages below are pinned exactly.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv git ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    # DVC refuses a repository owned by another uid: a mounted checkout usually is.
    && git config --system --add safe.directory '*' \
    && python3 -m venv "$VIRTUAL_ENV" \
    && useradd --create-home --uid 1000 trainer

# Requirements before the source, so editing code does not reinstall torch.
# For builds behind a local package index or a TLS-intercepting proxy (scripts/image-check.sh):
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_CERT=""
COPY requirements.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt

WORKDIR /workspace
COPY --chown=1000:1000 . /workspace
# Editable: with the repository mounted over /workspace, the mounted code is what runs.
# The folder itself (made by WORKDIR as root) must be the user's too: stages create data/, models/...
RUN pip install --no-cache-dir --no-deps -e /workspace \
    && install -m 0755 docker/entrypoint.sh /usr/local/bin/entrypoint \
    && chown 1000:1000 /workspace

USER 1000:1000
ENTRYPOINT ["entrypoint"]
