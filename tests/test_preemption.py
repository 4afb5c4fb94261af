"""A preemption notice (#56): with step checkpoints on, a SIGTERM or SIGUSR1 stops the training
after a step that every rank agrees on, checkpointed, and a resume ends with the uninterrupted
weights in the same MLflow runs. Real signals: to one rank alone (the ranks still agree), and to
the stage, whose torchrun agent passes it on to its workers as Kubernetes' and Slurm's reach them."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch
import torch.distributed as dist

from pipeline.checkpoint import CHECKPOINT_FILE, in_epoch_step, read_checkpoint
from pipeline.parallel import Rank
from pipeline.preemption import STOPPED_FILE_ENV, Notice, say_stopped
from tests.conftest import SMALL, load_weights, make_project, prepare, project_env, subprocess_env, train_cli
from tests.ddp_harness import run_ranks

SIGNALLED_AT = 5  # the step after which rank 2 alone is signalled


def lockstep(r: int, world: int, out) -> None:
    """Steps that keep the ranks in step (an all-reduce each, as DDP's), rank 2 signalled after step
    SIGNALLED_AT with SIGUSR1 (Slurm's --signal of choice): the step each rank stops after."""
    stopped_at, notice = None, Notice(Rank(r, r, world, world))
    with notice:
        for step in range(1, 20):
            dist.all_reduce(torch.ones(1))
            if r == 2 and step == SIGNALLED_AT:
                os.kill(os.getpid(), signal.SIGUSR1)  # noted, not acted on: the process goes on
            if notice.agreed():
                stopped_at = step
                break
    torch.save((stopped_at, notice.signum), out / f"rank-{r}.pt")


def test_ranks_agree_on_the_step_to_stop_after_when_one_alone_is_signalled(tmp_path):
    run_ranks(3, lockstep, tmp_path)
    stops = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(3)]
    # One step late, the same step everywhere; only rank 2 saw the signal itself.
    assert [step for step, _ in stops] == [SIGNALLED_AT + 1] * 3
    assert [seen for _, seen in stops] == [0, 0, signal.SIGUSR1]


def test_a_preempted_training_stops_checkpointed_and_resumes_in_its_runs(tmp_path, mnist_dir):
    """SIGTERM to `train --mode ddp` (Kubernetes' notice to a pod's first process; torchrun's agent
    passes it to the workers, and waits 30 s for them): checkpointed at the next step, exit 143, and
    `--resume` ends with an uninterrupted training's weights in the same MLflow runs. The periodic
    checkpoint (every 1000 steps) never comes: the notice's checkpoint is the only one mid-epoch. The
    preempted and resumed training reads its samples through DataLoaders (train.loader, #53), whose
    workers the notice must not stop, and writes its checkpoints in parts, in a thread
    (train.checkpoint_format: sharded-async), whose write the stop waits for; the reference holds
    its samples in memory and writes whole checkpoints."""
    # Here, not at the top: run_ranks' spawned ranks import this module, and need no MLflow.
    from mlflow import MlflowClient

    project = make_project(tmp_path / "proj", {**SMALL, "train": {**SMALL["train"], "epochs": 4,
                                                                  "checkpoint_every_steps": 1000}})
    prepare(project, mnist_dir)
    train_cli(project, "ddp")
    reference = load_weights(project, "ddp")
    ids_file = project / "models" / "ddp" / "mlflow_run.json"
    first_runs = json.loads(ids_file.read_text())

    loaded = tmp_path / "loaded.yaml"
    loaded.write_text((project / "params.yaml").read_text().replace("loader: memory", "loader: dataloader")
                      .replace("checkpoint_format: whole", "checkpoint_format: sharded-async"))
    with subprocess.Popen(["mnist-pipeline", "train", "--mode", "ddp", "--params", str(loaded)], cwd=project,
                          stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=subprocess_env(**project_env(project))) as proc:
        seen = []
        for line in proc.stderr:  # the end of epoch 1 of 4: the workers are mid-training
            seen.append(line)
            if "ddp epoch 1/4" in line:
                break
        proc.send_signal(signal.SIGTERM)  # to the stage's pid alone, as `kill` (and the kubelet) does
        stderr = "".join(seen) + proc.stderr.read()
        proc.wait(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    assert "ddp: SIGTERM, so training stopped after step" in stderr, stderr[-3000:]
    assert "read from data/prepared by DataLoaders" in stderr
    state = read_checkpoint(project / "models" / "ddp" / CHECKPOINT_FILE)
    assert state["epoch"] >= 1 and 0 < in_epoch_step(state) <= 10, (state["epoch"], in_epoch_step(state))
    assert state["model"] is None and (project / "models/ddp/checkpoint-shards" / state["shards"] / ".metadata").is_file()
    runs = json.loads(ids_file.read_text())
    assert runs != first_runs  # a training of its own, not the reference's

    resumed = train_cli(project, "ddp", "--resume", "--params", str(loaded))
    assert "ddp epoch 1/4" not in resumed.stderr
    assert torch.equal(torch.cat([w.flatten() for w in reference.values()]),
                       torch.cat([w.flatten() for w in load_weights(project, "ddp").values()]))
    assert json.loads(ids_file.read_text()) == runs  # the same runs, continued
    assert not (project / "models/ddp/checkpoint-shards").exists()  # the last checkpoint is whole
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    assert client.get_run(runs["parent"]).info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(runs["parent"], "train_loss")} == {1, 2, 3, 4}


@pytest.mark.fast
def test_a_notice_is_noted_not_obeyed_and_the_handlers_come_back(tmp_path, monkeypatch):
    """One process (no group to agree with): the signal is the notice at once; outside the block
    the handlers are the ones before it. Rank 0's word to the batch script goes to its file."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    with Notice(Rank()) as notice:
        assert notice.agreed() == 0
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process outside the block
        os.kill(os.getpid(), signal.SIGTERM)  # the first notice counts
        assert notice.agreed() == signal.SIGUSR1
    assert {sig: signal.getsignal(sig) for sig in before} == before
    said = tmp_path / "stopped"
    say_stopped("ddp: SIGTERM, so training stopped after step 3")  # no file asked for: nothing written
    monkeypatch.setenv(STOPPED_FILE_ENV, str(said))
    say_stopped("ddp: SIGTERM, so training stopped after step 3")
    assert said.read_text() == "ddp: SIGTERM, so training stopped after step 3\n"
