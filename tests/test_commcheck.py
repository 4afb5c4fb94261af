"""`mnist-pipeline commcheck`: every primitive checked with closed-form values and timed."""

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import yaml

import torch

from pipeline.comm import PRIMITIVES, bandwidths, bus_factor, expected_from, message_bytes, sizes, total_of
from tests.conftest import make_project, project_env, run


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    # Small sweep: correctness does not need large messages, and CI has 2 cores. No time budget:
    # every size, however busy the machine (the budget has a test of its own).
    return make_project(tmp_path_factory.mktemp("comm") / "proj",
                        {"commcheck": {"max_bytes": 4096, "iters": 3, "warmup": 1, "budget_s": 0}})


def commcheck(project, nproc, check=True, budget_s=0, verbose=False, **env):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["nproc"] = nproc
    params["commcheck"]["budget_s"] = budget_s
    (project / f"params-{nproc}.yaml").write_text(yaml.safe_dump(params))
    return run(["mnist-pipeline", *(["-v"] if verbose else []), "commcheck", "--params", f"params-{nproc}.yaml"],
               project, check=check, **project_env(project, **env))


@dataclasses.dataclass(frozen=True)
class Passed:
    result: subprocess.CompletedProcess
    report: dict  # results/comm.json
    verdict: str  # checks/comm.json's text
    run_id: str  # its MLflow parent run


@pytest.fixture(scope="module")
def passed(project):
    """commcheck passing on nproc ranks, run once for each nproc asked for and read by every test
    that looks at a passing run: what it printed, its two files as it wrote them (later tests write
    theirs over them) and its MLflow run. Each commcheck is a launcher, a fork server and its ranks."""
    from mlflow import MlflowClient

    made = {}

    def on(nproc: int) -> Passed:
        if nproc not in made:
            result = commcheck(project, nproc)
            client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
            experiments = [e.experiment_id for e in client.search_experiments()]
            parent = client.search_runs(experiments, "attributes.run_name = 'commcheck'",
                                        order_by=["start_time DESC"])[0]
            made[nproc] = Passed(result, json.loads((project / "results/comm.json").read_text()),
                                 (project / "checks/comm.json").read_text(), parent.info.run_id)
        return made[nproc]

    return on


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_primitive_passes_and_is_recorded(passed, nproc):
    result, report = passed(nproc).result, passed(nproc).report
    assert f"all {len(PRIMITIVES)} primitives passed on {nproc} ranks (gloo)" in result.stdout
    # One line on the terminal, the timings in the file: the table is for -v.
    assert "bytes/rank" not in result.stdout and "results/comm.json (-v prints them)" in result.stdout
    assert "Warning" not in result.stderr, result.stderr  # no library's deprecation notice reaches the user
    assert report["passed"] and report["world_size"] == nproc and report["backend"] == "gloo"
    assert set(report["primitives"]) == set(PRIMITIVES)
    swept = {(row["primitive"], row["bytes"]) for row in report["sweep"]}
    for primitive in PRIMITIVES:
        expected_sizes = [0] if primitive == "barrier" else sizes(4, 4096, 4)
        assert {(primitive, size) for size in expected_sizes} <= swept
    for row in report["sweep"]:
        assert row["time_us"] > 0
        if row["bytes"]:
            assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bus_factor(row["primitive"], nproc))
    verdict = json.loads(passed(nproc).verdict)
    assert verdict == {"enabled": True, "passed": True, "world_size": nproc, "backend": "gloo", "device": "cpu",
                       "devices": [report["devices"][0]] * nproc, "primitives": list(PRIMITIVES)}
    assert report["devices"][0].startswith("cpu (")
    assert all(report["primitives"][p]["first_call_us"] > 0 for p in PRIMITIVES)


def test_a_time_budget_stops_every_rank_at_the_same_size_and_verbose_prints_the_timings(project):
    """A budget no size fits: each primitive is checked and timed at the smallest size only, and
    the ranks agree on that (had one gone on alone, the others would hang in their next collective).
    `mnist-pipeline -v` prints that, and the timings' table, on the terminal."""
    # -v here rather than in a commcheck of its own: each is a launcher, a fork server and 2 ranks.
    result = commcheck(project, 2, budget_s=1e-9, verbose=True)
    table = [line for line in result.stdout.splitlines() if line.split()[:1] and line.split()[0] in PRIMITIVES]
    assert "bytes/rank" in result.stdout and {line.split()[0] for line in table} == set(PRIMITIVES), result.stdout
    assert f"all {len(PRIMITIVES)} primitives passed on 2 ranks (gloo)" in result.stdout
    assert "the sweep stopped short of max_bytes (4096) to stay within commcheck.budget_s = 1e-09 s" \
        in result.stdout
    report = json.loads((project / "results/comm.json").read_text())
    # all_reduce alone grows on, to max_bytes here (below the model's gradients): the scaling model
    # reads the link from it.
    assert sorted((row["primitive"], row["bytes"]) for row in report["sweep"]) == sorted(
        [(primitive, 0 if primitive == "barrier" else 4) for primitive in PRIMITIVES if primitive != "all_reduce"]
        + [("all_reduce", size) for size in (4, 16, 64, 256, 1024, 4096)])
    assert {report["primitives"][p]["largest_bytes"] for p in PRIMITIVES if p not in ("barrier", "all_reduce")} == {4}
    assert report["primitives"]["all_reduce"]["largest_bytes"] == 4096


def test_one_rank_checks_the_collectives_and_says_point_to_point_needs_two(project):
    """One GPU on the host (nproc 0 = one per GPU), or one worker per node: no peer to send to."""
    result = commcheck(project, 1)
    assert "all 9 primitives passed on 1 ranks (gloo); send_recv, isend_irecv need a second rank" in result.stdout
    verdict = json.loads((project / "checks/comm.json").read_text())
    assert verdict["primitives"] == [p for p in PRIMITIVES if p not in ("send_recv", "isend_irecv")]


def test_a_corrupted_rank_is_caught_and_named(project):
    (project / "results/comm.json").unlink(missing_ok=True)
    result = commcheck(project, 4, check=False, MNIST_PIPELINE_CORRUPT="all_reduce:2")
    assert result.returncode == 1
    assert "commcheck: all_reduce failed on 4 of 4 ranks (gloo)" in result.stderr
    # Element 0 of rank r is r + 1, so it sums to 1 + 2 + 3 + 4 = 10; rank 2 sent one too many.
    assert "rank 0 expected 10 at element 0 of a 4-byte message, got 11" in result.stderr
    assert "broadcast failed" not in result.stderr  # the other primitives still pass
    assert not (project / "results/comm.json").exists()


def test_a_corrupted_point_to_point_link_names_the_receiver(project):
    result = commcheck(project, 2, check=False, MNIST_PIPELINE_CORRUPT="isend_irecv:0")
    assert result.returncode == 1
    assert "isend_irecv failed on 1 of 2 ranks (gloo): rank 1 expected 1 at element 0" in result.stderr


def test_disabled_records_that_it_was_skipped(project, tmp_path):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["commcheck"]["enabled"] = False
    (project / "off.yaml").write_text(yaml.safe_dump(params))
    result = run(["mnist-pipeline", "commcheck", "--params", "off.yaml"], project, **project_env(project))
    assert "skipped" in result.stdout
    assert json.loads((project / "checks/comm.json").read_text()) == {"enabled": False}


@pytest.mark.parametrize(
    "primitive, n, factor",
    [("all_reduce", 4, 1.5), ("all_reduce", 2, 1.0), ("all_gather", 4, 0.75), ("reduce_scatter", 8, 0.875),
     ("all_to_all", 4, 0.75), ("broadcast", 4, 1.0), ("reduce", 4, 1.0), ("send_recv", 2, 1.0)],
)
@pytest.mark.fast
def test_bus_bandwidth_factors(primitive, n, factor):
    assert bus_factor(primitive, n) == factor


def sums_in_every_order(contributions: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 sums in the orders real reductions use: in rank order and reversed, around a ring
    starting at each of a few ranks (NCCL's ring starts each chunk elsewhere), pairwise as a tree,
    and in random orders."""
    n = len(contributions)

    def in_order(order):
        acc = contributions[order[0]].clone()
        for q in order[1:]:
            acc += contributions[q]
        return acc

    def tree(parts):
        while len(parts) > 1:
            parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
        return parts[0]

    generator = torch.Generator().manual_seed(0)
    orders = [list(range(n)), list(reversed(range(n)))]
    orders += [[(start + k) % n for k in range(n)] for start in (1, n // 3, n - 1)]
    orders += [torch.randperm(n, generator=generator).tolist() for _ in range(3)]
    return [in_order(order) for order in orders] + [tree([c.clone() for c in contributions])]


@pytest.mark.parametrize("world_size, numel", [(32, 1 << 20), (64, 1 << 20), (1000, 1 << 13)])
@pytest.mark.fast
def test_closed_form_sums_are_exact_in_any_reduction_order(world_size, numel):
    # 1 << 20 float32 elements: commcheck's default largest message (4 MiB).
    contributions = [expected_from(q, numel, "cpu", world_size) for q in range(world_size)]
    expected = total_of(numel, "cpu", world_size)
    for got in sums_in_every_order(contributions):
        assert torch.equal(got.double(), expected)


@pytest.mark.fast
def test_the_order_check_catches_inexact_values():
    # What the check used before (arange + 1000 * (rank + 1)): at 32 ranks and 4 MiB its float32 sums
    # depend on the order, so the test above would fail on it.
    numel, n = 1 << 20, 32
    contributions = [torch.arange(numel, dtype=torch.float32) + 1000.0 * (q + 1) for q in range(n)]
    sums = sums_in_every_order(contributions)
    assert any(not torch.equal(sums[0], other) for other in sums[1:])


@pytest.mark.fast
def test_every_rank_sends_something_different():
    n = 64
    firsts = {tuple(expected_from(q, 8, "cpu", n).tolist()) for q in range(n)}
    assert len(firsts) == n


@pytest.mark.fast
def test_bandwidths_by_hand():
    # all_reduce of 1 MB on 4 ranks in 1 ms: algbw 1 GB/s, busbw 1 x 2 x 3/4 = 1.5 GB/s.
    assert bandwidths("all_reduce", 10**6, 1e-3, 4) == pytest.approx((1.0, 1.5))
    # all_gather of 1 MB per rank on 4 ranks in 2 ms: the 4 MB result in 2 ms is 2 GB/s; busbw x 3/4.
    assert message_bytes("all_gather", 10**6, 4) == 4 * 10**6
    assert bandwidths("all_gather", 10**6, 2e-3, 4) == pytest.approx((2.0, 1.5))
    assert bandwidths("broadcast", 5 * 10**5, 1e-3, 8) == pytest.approx((0.5, 0.5))
    assert sizes(4, 4096, 4) == [4, 16, 64, 256, 1024, 4096]


def test_a_broken_interconnect_stops_dvc_repro_before_training(tmp_path, mnist_dir):
    from tests.conftest import SMALL

    project = make_project(tmp_path / "proj", SMALL)
    result = run(["dvc", "repro"], project, check=False,
                 **project_env(project, MNIST_SOURCE=str(mnist_dir), MNIST_PIPELINE_CORRUPT="broadcast:0"))
    assert result.returncode != 0
    assert "broadcast failed on" in result.stderr
    assert "Running stage 'train@" not in result.stdout
    assert not (project / "models").exists()


def test_commcheck_run_has_a_child_per_rank_with_its_timings(project, passed):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    parent = client.get_run(passed(2).run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["backend"] == "gloo"
    busbw = client.get_metric_history(parent.info.run_id, "all_reduce_busbw_gbps")
    assert [m.step for m in busbw] == sizes(4, 4096, 4)  # the x axis is the message size in bytes
    children = client.search_runs(experiments, f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["commcheck/rank-0", "commcheck/rank-1"]
    for child in children:
        for primitive in PRIMITIVES:
            assert client.get_metric_history(child.info.run_id, f"{primitive}_time_us"), primitive


def test_nothing_to_check_without_ddp(project, passed):
    """With ddp not in train.modes no mode uses torch.distributed: no worker starts, and the last
    verdict stays (nothing retrains for it)."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["modes"] = ["single", "dp"]
    (project / "params-no-ddp.yaml").write_text(yaml.safe_dump(params))
    # A passing run's verdict and report put back: a test since may have left others there
    # (test_disabled's {"enabled": false}, the very verdict this command writes where there is none).
    verdict = passed(2).verdict
    (project / "checks/comm.json").write_text(verdict)
    (project / "results/comm.json").write_text(json.dumps(passed(2).report))
    result = run(["mnist-pipeline", "commcheck", "--params", "params-no-ddp.yaml"], project, **project_env(project))
    assert "nothing to check (neither ddp nor fsdp is in train.modes" in result.stdout and "launching" not in result.stdout
    assert (project / "checks/comm.json").read_text() == verdict
    assert json.loads((project / "results/comm.json").read_text()) == {
        "enabled": False, "skipped": "neither ddp nor fsdp is in train.modes"}


def test_a_batch_ddp_cannot_split_fails_before_any_training(project):
    """commcheck runs before the first training: a setting only ddp cannot use stops the pipeline
    there, not after single and dp have trained."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(batch_size=2, nproc=3)
    (project / "params-tiny-batch.yaml").write_text(yaml.safe_dump(params))
    result = run(["mnist-pipeline", "commcheck", "--params", "params-tiny-batch.yaml"], project, check=False,
                 **project_env(project))
    assert result.returncode == 1 and "launching" not in result.stdout
    assert "ddp (in train.modes): train.batch_size = 2 is smaller than the 3 DDP ranks" in result.stderr


FIRST_CALL_S = 1.0  # what NCCL's lazy connection setup costs a primitive's first call, here slept


def _sweep_with_costly_first_calls(r: int, world: int, out: str) -> None:
    """Each primitive's first call pays a setup, as NCCL's does on GPUs (lazy connections and
    kernels, the default since NCCL 2.22): slept here on every rank, on the call itself."""
    import dataclasses
    import time

    from pipeline import comm
    from pipeline.config import CommcheckConfig
    from pipeline.parallel import Rank

    make_case, seen = comm.make_case, set()

    def with_setup(primitive, *args):
        case = make_case(primitive, *args)
        if primitive in seen:
            return case
        seen.add(primitive)
        run, calls = case.run, []

        def first_pays():
            if not calls:
                time.sleep(FIRST_CALL_S)
            calls.append(1)
            run()

        return dataclasses.replace(case, run=first_pays)

    comm.make_case = with_setup
    # A share of 0.8 s a primitive: less than one first call, ample for every size without it (the
    # first size may take 0.4 s, a stall on a busy host included, and the sweep still goes on).
    config = CommcheckConfig(max_bytes=4096, iters=3, warmup=1, budget_s=0.8 * (len(comm.PRIMITIVES) - 1))
    result = comm.sweep(Rank(r, r, world, world), torch.device("cpu"), config)
    (Path(out) / f"sweep-{r}.json").write_text(json.dumps(result))


def test_a_costly_first_call_is_reported_apart_and_spends_no_budget(tmp_path):
    from tests.ddp_harness import run_ranks

    run_ranks(2, _sweep_with_costly_first_calls, str(tmp_path))
    for r in range(2):
        result = json.loads((tmp_path / f"sweep-{r}.json").read_text())
        assert set(result["first_calls"]) == set(PRIMITIVES)
        assert all(seconds >= FIRST_CALL_S for seconds in result["first_calls"].values()), result["first_calls"]
        largest = {}
        for timing in result["timings"]:
            largest[timing["primitive"]] = max(largest.get(timing["primitive"], 0), timing["bytes"])
        # The setup used up no primitive's share: each went on past its first size (with the setup
        # counted, none would have, its share being smaller than the setup).
        assert all(largest[p] > 4 for p in PRIMITIVES if p != "barrier"), largest
        assert all(t["seconds"] < FIRST_CALL_S for t in result["timings"])  # nor is it in any timing
