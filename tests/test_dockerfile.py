"""The Dockerfile: linted by hadolint, and shaped the way the README promises."""

import re
import subprocess

from tests.conftest import ROOT, VENV_BIN

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    # Comment lines go first: Docker drops them, even inside an instruction continued over lines.
    code = "\n".join(line for line in DOCKERFILE.splitlines() if not line.lstrip().startswith("#"))
    joined = re.sub(r"\\\n", " ", code)
    return [(line.split()[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def test_hadolint_passes():
    result = subprocess.run([str(VENV_BIN / "hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pinned_cuda_base_that_can_be_overridden():
    steps = instructions()
    # -base: torch's wheels bring their own CUDA libraries, so -runtime's would be second copies.
    # The tag says what it is, the digest pins what it is: a tag can be moved to other contents.
    assert steps[0][0] == "ARG" and re.fullmatch(
        r"BASE_IMAGE=nvidia/cuda:\d+\.\d+\.\d+-base-ubuntu\d+\.\d+@sha256:[0-9a-f]{64}", steps[0][1])
    assert ("FROM", "${BASE_IMAGE}") in steps


def test_the_image_holds_what_it_was_built_from_without_rebuilding_torch_for_a_commit():
    steps = instructions()
    facts = next(i for i, (op, arg) in enumerate(steps) if op == "RUN" and "/etc/mnist-pipeline/image.json" in arg)
    for name in ("BASE_IMAGE", "SOURCE_COMMIT"):
        declared = [i for i, (op, arg) in enumerate(steps) if op == "ARG" and arg.split("=")[0] == name and i > 1]
        assert declared, name  # after FROM: an ARG before FROM is not seen by the build's steps
        torch = next(i for i, (op, arg) in enumerate(steps) if "-r /tmp/requirements.lock" in arg)
        assert torch < declared[-1] < facts  # a new commit rebuilds the last layer only
    for field in ("base", "source_commit", "requirements_lock_sha256"):
        assert field in steps[facts][1]


def test_requirements_install_before_the_source_is_copied():
    steps = [f"{op} {arg}" for op, arg in instructions()]
    install = next(i for i, s in enumerate(steps)
                   if "pip install --no-cache-dir --require-hashes -r /tmp/requirements.lock" in s)
    copy_source = next(i for i, s in enumerate(steps) if s.startswith("COPY") and " . /workspace" in s)
    assert install < copy_source


def test_non_root_workspace_and_entrypoint():
    steps = instructions()
    assert ("WORKDIR", "/workspace") in steps
    users = [arg for op, arg in steps if op == "USER"]
    assert users and not users[-1].startswith(("0", "root"))
    assert steps[-1] == ("ENTRYPOINT", '["entrypoint"]')
    assert "rm -rf /var/lib/apt/lists/*" in DOCKERFILE


def test_git_trusts_only_the_workspace():
    # A mounted checkout belongs to the host user, so git must be told to trust it; '*' would
    # trust every repository the container can see (a volume's hooks and config included).
    run = " ".join(arg for op, arg in instructions() if op == "RUN")
    trusted = re.findall(r"safe\.directory\s+(\S+)", run)
    assert trusted == ["/workspace"], trusted


def test_dockerignore_keeps_generated_things_out():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "data", "models", "mlflow.db*", "mlartifacts", ".dvc/cache"} <= ignored


def test_entrypoint_passes_commands_through(tmp_path):
    result = subprocess.run(["sh", str(ROOT / "docker/entrypoint.sh"), "sh", "-c", "echo ran; echo $HOME"],
                            capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    assert result.returncode == 0 and result.stdout.split() == ["ran", "/tmp"]


def test_uid_1000_is_freed_before_the_user_is_made():
    # ubuntu:24.04 already has `ubuntu` with uid/gid 1000: a plain useradd --uid 1000 exits 4.
    # `make image-check` proves it on a stand-in that has that user; this keeps the order visible.
    run = next(arg for op, arg in instructions() if op == "RUN" and "useradd" in arg)
    assert run.index("userdel") < run.index("groupdel") < run.index("groupadd --gid 1000") < run.index("useradd")


def test_entrypoint_runs_under_dumb_init_and_keeps_the_exit_code():
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": "/tmp"}
    script = 'echo "$(cat /proc/$PPID/comm)"; exit 3'  # the parent of the command is dumb-init
    result = subprocess.run(["sh", str(ROOT / "docker/entrypoint.sh"), "sh", "-c", script],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 3 and result.stdout.split() == ["dumb-init"], result.stderr
