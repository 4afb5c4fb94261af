"""Every way DVC runs the pipeline logs to the project's one MLflow store: `dvc exp run` in the
queue and with --temp run each stage in a temporary copy that DVC deletes afterwards. Each run
carries the DVC experiment's name and baseline commit, so `dvc exp show` and MLflow meet."""

import sys
import time

from mlflow import MlflowClient

from tests.conftest import ROOT, SMALL, code_at, commit, make_project, project_env, run

ONLY_SINGLE = {**SMALL, "train": {**SMALL["train"], "modes": ["single"]}}


def test_queued_and_temp_experiments_land_in_the_projects_store(tmp_path, mnist_dir):
    project = make_project(tmp_path / "proj", ONLY_SINGLE)
    env = project_env(project, MNIST_SOURCE=str(mnist_dir))
    run(["dvc", "repro"], project, **env)
    commit(project, "baseline")
    # Each unlike the default (0.02), and each trains the small slice past the quality gate (at
    # 0.03 it does not, and evaluate fails the experiment, as it should).
    experiments = {"lr-high": "0.015", "lr-low": "0.005"}
    # Each experiment is queued from code of its own (a commit that changes the code), and the
    # workspace's code, edited after both, would fail any stage that ran it: each
    # runs the code it was queued with, two at a time, and records that code.
    queued_from = {}
    try:
        for name, lr in experiments.items():
            with (project / "pipeline" / "loop.py").open("a") as handle:  # unlike the installed checkout's too
                handle.write(f"# the code {name} is queued with\n")
            commit(project, f"the code for {name}")
            queued_from[name] = run(["git", "rev-parse", "HEAD"], project).stdout.strip()
            run(["dvc", "exp", "run", "--queue", "-n", name, "-S", f"train.lr={lr}"], project, **env)
        edited = project / "stages" / "compare.py"
        committed = edited.read_text()
        edited.write_text('raise SystemExit("the workspace\'s code ran, not the experiment\'s")\n' + committed)
        run(["dvc", "queue", "start", "-j", "2"], project, **env)
        # Each look at the queue is a DVC process, a second or two of the CPU the two experiments
        # are using: until both experiments' refs are in the repository (DVC collects each one's
        # when it ends), a cheap look at git's refs each second, and at the queue every 15 s (which
        # ends the wait on a failure, that leaves no ref); then at the queue until it says done.
        deadline, asked = time.monotonic() + 600, None
        while True:
            refs = run(["git", "for-each-ref", "--format=%(refname:lstrip=-1)", "refs/exps"], project).stdout.split()
            if set(experiments) <= set(refs) or asked is None or time.monotonic() - asked >= 15:
                asked = time.monotonic()
                status = run(["dvc", "queue", "status"], project, **env).stdout
                if "Queued" not in status and "Running" not in status:
                    break
            assert time.monotonic() < deadline, status
            time.sleep(1)
        assert status.count("Success") == 2, status
    finally:
        run(["dvc", "queue", "stop", "--kill"], project, check=False, **env)
    edited.write_text(committed)
    head = run(["git", "rev-parse", "HEAD"], project).stdout.strip()
    run(["dvc", "exp", "run", "--temp", "-n", "temp-run", "-S", "train.lr=0.01", "-S", "train.weight_decay=0.0002"],
        project, **env)
    experiments["temp-run"] = "0.01"

    # `make show`: a row per experiment with what it swept, train.weight_decay included (no fixed column).
    shown = run([sys.executable, str(ROOT / "scripts/show_experiments.py"), "-A"], project, **env).stdout.splitlines()
    header = shown[0].split()
    assert "weight_decay" in header, shown
    cells = {line.split()[0]: line.split() for line in shown[1:] if line.split()}
    for name, lr in experiments.items():
        assert cells[name][header.index("lr")] == lr, shown
        assert cells[name][header.index("weight_decay")] == ("0.0002" if name == "temp-run" else "0.0"), shown

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    ids = [e.experiment_id for e in client.search_experiments()]
    for name, lr in experiments.items():
        runs = client.search_runs(ids, f"tags.dvc_experiment = '{name}'")
        # Named after the experiment: the runs page sorts and searches a sweep's runs by it.
        parents = [r for r in runs if r.info.run_name == f"{name}/single"]
        assert len(parents) == 1, (name, [r.info.run_name for r in runs])
        parent = parents[0]
        assert parent.info.status == "FINISHED" and parent.data.params["train.lr"] == lr
        assert parent.data.tags["dvc_baseline_rev"] == queued_from.get(name, head)
        assert "test_accuracy" in parent.data.metrics  # evaluate, in the same temporary copy, found it
        if name in queued_from:
            assert parent.data.tags["git_commit"] == queued_from[name]
            assert parent.data.tags["code_sha256"] == code_at(project, queued_from[name]), name
        assert {r.info.run_name for r in runs} >= {f"{name}/single", f"{name}/single/rank-0", f"{name}/compare"}
        found = client.search_runs(ids, f"attributes.run_name LIKE '{name}/%'")
        assert {r.info.run_id for r in found} == {r.info.run_id for r in runs}
    assert not list((project / ".dvc").rglob("mlflow.db"))  # nothing went to a temporary copy's store
