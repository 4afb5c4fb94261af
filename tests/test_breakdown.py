"""The step breakdown (pipeline.breakdown) and the scaling model (pipeline.scaling): the arithmetic on
made-up stamps, then the instruments in real DDP ranks over gloo."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pipeline import scaling
from pipeline.breakdown import step_breakdown, union_length
from tests.ddp_harness import learnable_data, rank_dir, run_ranks, train_config


@pytest.mark.fast
def test_communication_during_the_backward_is_overlapped_and_the_rest_exposed():
    # data 1, forward 2, backward 6 (from 3 to 9), optimizer 1. Bucket A is handed over at 5 and
    # done at 7 (inside the backward's compute, which ends when the last bucket, B, is handed over
    # at 8); B runs 8 to 9.5: the step waited for it.
    row = step_breakdown([1.0, 2.0, 6.0, 1.0], [(5.0, 7.0), (8.0, 9.5)])
    assert row["comm"] == pytest.approx(3.5)
    assert row["comm_overlapped"] == pytest.approx(2.0)
    assert row["comm_exposed"] == pytest.approx(1.5)
    assert row["backward_compute"] == pytest.approx(4.5)
    parts = ("data", "forward", "backward_compute", "comm_exposed", "optimizer")
    assert sum(row[p] for p in parts) == pytest.approx(row["step"]) == pytest.approx(10.0)
    # One bucket, handed over when the last gradient is ready: nothing can overlap it.
    alone = step_breakdown([1.0, 2.0, 6.0, 1.0], [(8.0, 9.0)])
    assert alone["comm_overlapped"] == 0 and alone["comm_exposed"] == pytest.approx(1.0)
    assert union_length([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)


@pytest.mark.fast
def test_collectives_that_hold_the_training_thread_are_exposed_in_their_phase():
    # fsdp on the CPU: data 1, forward 3 (1 to 4) with an all-gather 1.5 to 2.0, backward 5 (4 to 9)
    # with an all-gather 4.0 to 4.5 and a reduce-scatter 8.0 to 9.0, optimizer 1. The training
    # thread made each call and waited it out: nothing ran beside it.
    row = step_breakdown([1.0, 3.0, 5.0, 1.0], [(1.5, 2.0), (4.0, 4.5), (8.0, 9.0)], blocking=True)
    assert row["comm"] == row["comm_exposed"] == pytest.approx(2.0) and row["comm_overlapped"] == 0
    assert row["forward_compute"] == pytest.approx(2.5) and row["backward_compute"] == pytest.approx(3.5)
    parts = ("data", "forward_compute", "backward_compute", "comm_exposed", "optimizer")
    assert sum(row[p] for p in parts) == pytest.approx(row["step"]) == pytest.approx(10.0)
    assert row["compute"] == pytest.approx(8.0)
    # DDP's all-reduce runs beside the backward: the forward is all compute.
    assert step_breakdown([1.0, 3.0, 5.0, 1.0], [(8.0, 9.0)])["forward_compute"] == 3.0


@pytest.mark.fast
def test_the_ring_all_reduce_follows_thakur_rabenseifner_gropp():
    link = scaling.Link("x", latency_s=1e-5, per_byte_s=2e-9, source="")
    # 2(p-1)·α + (p-1)/p·n·(2β+γ) at p = 4, n = 1 MB
    assert link.allreduce_s(1e6, 4) == pytest.approx(6e-5 + 0.75 * 1e6 * 2e-9)
    assert link.allreduce_s(1e6, 1) == 0
    # A named link's bus bandwidth is nccl-tests' busbw: algbw × 2(p-1)/p.
    nvlink = scaling.named_link("nvlink", busbw_gbps=100, latency_us=0)
    seconds = nvlink.allreduce_s(1e9, 8)
    assert (1e9 / seconds) * 2 * 7 / 8 == pytest.approx(100e9)


@pytest.mark.fast
def test_commcheck_sweep_gives_back_the_link_it_was_made_with():
    truth = scaling.Link("truth", latency_s=50e-6, per_byte_s=4e-9, source="")
    sweep = [{"primitive": "all_reduce", "bytes": n, "time_us": truth.allreduce_s(n, 2) * 1e6}
             for n in (4, 64, 1024, 16384, 262144, 1048576)]
    link = scaling.measured_link({"world_size": 2, "backend": "gloo", "sweep": sweep})
    assert link.latency_s == pytest.approx(truth.latency_s, rel=0.01)
    assert link.per_byte_s == pytest.approx(truth.per_byte_s, rel=0.01)
    # A sweep that stopped while latency ruled says nothing about bandwidth.
    assert scaling.measured_link({"world_size": 2, "sweep": sweep[:4]}) is None
    # One that starts above 16 KiB (commcheck.min_bytes) takes its latency from its smallest message.
    assert scaling.measured_link({"world_size": 2, "sweep": sweep[4:]}).per_byte_s == pytest.approx(truth.per_byte_s)


@pytest.mark.fast
def test_a_bucket_ready_early_hides_its_all_reduce_behind_the_backward():
    link = scaling.Link("x", latency_s=0.0, per_byte_s=1e-3, source="")  # 2 ranks: 0.5 ms per byte
    early = [{"bytes": 2, "ready_fraction": 0.2}, {"bytes": 2, "ready_fraction": 1.0}]
    comm, exposed = scaling.ddp_exposed_s(early, backward_compute_s=0.01, link=link, ranks=2)
    assert comm == pytest.approx(0.002) and exposed == pytest.approx(0.001)  # the first bucket is hidden
    comm, exposed = scaling.ddp_exposed_s(early, backward_compute_s=0.0001, link=link, ranks=2)
    # A backward too short to hide anything: both run after 20 us, back to back, 0.1 ms of it hidden.
    assert exposed == pytest.approx(0.00002 + 0.002 - 0.0001)


@pytest.mark.fast
def test_dataparallel_s_gather_wait_for_the_other_replicas_shrinks_with_their_batch():
    """Stamps on GPU 0's stream: a gather longer than the scatter waited for slower replicas on
    the other GPUs, compute that halves at twice the GPUs; the scatter-sized rest stays."""
    def breakdown(gather: float) -> dict:
        rank = {"median_s": {"data": 0.0, "backward": 0.0, "optimizer": 0.0, "step": 1.0},
                "dp_median_s": {"scatter": 0.1, "replicate": 0.0, "replicas": 0.4, "gather": gather}}
        return {"mode": "dp", "dp_devices": 2, "batch_size": 128, "ranks": [rank]}

    # Gather as long as scatter: nothing waited; the replicas halve (0.4 -> 0.2).
    assert scaling.project_dp(breakdown(0.1), 4)["step_s"] == pytest.approx(0.1 + 0.2 + 0.1)
    # 0.3 of gather was GPU 1's replica finishing after GPU 0's: it halves with them.
    assert scaling.project_dp(breakdown(0.4), 4)["step_s"] == pytest.approx(0.1 + (0.4 + 0.3) / 2 + 0.1)


@pytest.mark.fast
def test_fsdp_s_prediction_replaces_its_measured_collectives_with_the_ring_s_halves():
    """3 ranks, 6 all-gathers of 2 MB and 3 reduce-scatters of 1 MB in all a step, measured at 5 ms,
    all exposed, of a 12 ms step: the prediction is the step's 7 ms of compute plus the model's
    collectives: an all-gather half the ring, (p-1)·α a call and (p-1)/p·c/2 a byte; a reduce-scatter
    all of it, as gloo all-reduces for it, 2(p-1)·α and (p-1)/p·c."""
    link = scaling.Link("x", latency_s=1e-4, per_byte_s=2e-9, source="")
    collectives = {"all_gather": {"calls": 6, "bytes": 2_000_000, "median_s": 0.004},
                   "reduce_scatter": {"calls": 3, "bytes": 1_000_000, "median_s": 0.001}}
    ranks = [{"median_s": {"step": 0.012, "comm": 0.005, "comm_exposed": 0.005, "compute": 0.007},
              "collectives": collectives, "step_s": [0.012] * 3, "windows": 1}]
    model = 6 * 2 * 1e-4 + 2 / 3 * 2_000_000 * 2e-9 / 2 + 3 * 4 * 1e-4 + 2 / 3 * 1_000_000 * 2e-9
    assert scaling.fsdp_comm_s(collectives, link, 3) == pytest.approx(model)
    predicted = scaling.predict({"mode": "fsdp", "world_size": 3, "ranks": ranks}, link)
    assert predicted["predicted_step_s"] == pytest.approx(0.007 + model)
    assert predicted["predicted_comm_s"] == predicted["predicted_exposed_s"] == pytest.approx(model)
    # Without a link, or on a GPU (its collectives unmeasured), no prediction.
    assert scaling.predict({"mode": "fsdp", "world_size": 3, "ranks": ranks}, None) is None
    unmeasured = [{**ranks[0], "collectives": None, "comm_unmeasured": "fsdp on a GPU"}]
    assert scaling.predict({"mode": "fsdp", "world_size": 3, "ranks": unmeasured}, link) is None


@pytest.mark.fast
def test_with_the_comm_timer_apart_the_model_replaces_the_all_reduce_the_steps_waited_for():
    """The measured steps ran without the hook; its own window gave the all-reduce they waited for
    (3 ms exposed). The prediction is those steps with that wait replaced by the model's."""
    link = scaling.Link("x", latency_s=0.0, per_byte_s=1e-9, source="")
    buckets = [{"index": 0, "bytes": 1_000_000, "ready_fraction": 1.0}]
    ranks = [{"median_s": {"step": 0.017, "compute": 0.014, "comm_exposed": 0.003, "backward_compute": 0.005},
              "buckets": buckets, "step_s": [0.018, 0.017, 0.019], "windows": 1} for _ in range(2)]
    predicted = scaling.predict({"mode": "ddp", "world_size": 2, "ranks": ranks}, link)
    model = link.allreduce_s(1_000_000, 2)
    assert predicted["measured_step_s"] == 0.018
    assert predicted["predicted_step_s"] == pytest.approx(0.018 - 0.003 + model)


BUCKET_SETTINGS = ((0, 1), (6, 1), (3, 2))  # (breakdown_steps, breakdown_repeats): off, one window, two


def _train(r: int, world: int, out: Path, breakdown_steps: int, repeats: int, hooked_steps: list) -> None:
    from pipeline.loop import Training, train, weight_checksum
    from pipeline.parallel import Rank

    config = dataclasses.replace(train_config(60), breakdown_steps=breakdown_steps, trace_steps=2,
                                 throughput_warmup_steps=2, breakdown_repeats=repeats)
    folder = rank_dir(out, r)
    model, history = train(Training(config, "ddp", Rank(r, r, world, world), torch.device("cpu"), folder),
                           learnable_data(60 * 12), learnable_data(30, seed=1))
    result = {"checksum": weight_checksum(model), "breakdown": history[-1].get("breakdown"),
              "trace": sorted(p.name for p in (folder / "traces").glob("*.json")), "hooked_steps": hooked_steps,
              "steady_steps": history[-1]["steady_steps"]}
    (folder / f"result-{breakdown_steps}-{repeats}.json").write_text(json.dumps(result))


def _train_every_setting(r: int, world: int, out: str) -> None:
    """Rank r of each DDP training this module's tests read, one after the other in one group of 3
    ranks: the ranks' start (torch's imports, three processes) is paid once, not once a training.
    Each training seeds its weights and makes its data anew, so the one before it changes nothing."""
    from pipeline import breakdown

    hooked_steps = []  # the step of each call DDP makes to the comm hook, in the training at hand
    hook = breakdown.CommTimer.hook

    def counted(self, state, bucket):
        hooked_steps.append(self.step)
        return hook(self, state, bucket)

    breakdown.CommTimer.hook = counted
    try:
        for steps, repeats in BUCKET_SETTINGS:  # into one folder a rank, as one after the other they would
            hooked_steps.clear()
            _train(r, world, Path(out) / "buckets", steps, repeats, hooked_steps)
    finally:
        breakdown.CommTimer.hook = hook
    _train_with_a_slow_profiler(r, world, str(Path(out) / "slow-profiler"))


@pytest.fixture(scope="module")
def ddp_trainings(tmp_path_factory) -> Path:
    """The folder of the module's DDP trainings over gloo (_train_every_setting), read only."""
    out = tmp_path_factory.mktemp("breakdown")
    run_ranks(3, _train_every_setting, str(out))
    return out


class ModelCudaEvent:
    """torch.cuda.Event as the clock uses it, on the CPU: record() stamps the moment (a GPU's
    stream would stamp when it gets there), elapsed_time() is milliseconds from this one to `end`."""

    recorded = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at = None

    def record(self) -> None:
        import time

        ModelCudaEvent.recorded += 1
        self.at = time.perf_counter()

    def elapsed_time(self, end: "ModelCudaEvent") -> float:
        assert self.at is not None and end.at is not None, "an event read before it was recorded"
        return (end.at - self.at) * 1000


@pytest.mark.fast
def test_on_a_gpu_only_the_steps_that_are_read_record_events(monkeypatch):
    """A CUDA event costs a launch on every step it is recorded: only the measured window's steps,
    the first steady step and the epoch's last are stamped; the steady time still spans the epoch."""
    from pipeline.breakdown import Probe

    monkeypatch.setattr(torch.cuda, "Event", ModelCudaEvent)
    probe = Probe(torch.device("cuda"), window=4, warmup=2)

    def epoch(steps: int, measure: bool) -> int:
        before = ModelCudaEvent.recorded
        probe.start_epoch(steps, measure)
        for step in range(steps):
            probe.start_step(step)
            for phase in ("forward", "backward", "optimizer"):
                probe.phase(phase)
            probe.end_step()
        return ModelCudaEvent.recorded - before

    assert epoch(12, measure=False) == 2 * 5  # steps 2 and 11
    assert probe.results() is None and probe.clock.seconds_since_step(2) > 0 and probe.clock.totals() == {}
    assert epoch(12, measure=True) == 5 * 5  # steps 2 to 5, and 11
    assert probe.results()["steps"] == 4
    since_warmup, since_window_end = probe.clock.seconds_since_step(2), probe.clock.seconds_since_step(5)
    assert since_warmup > since_window_end > 0
    assert probe.clock.seconds_since_step(7) is None and probe.clock.totals() == {}
    assert epoch(2, measure=False) == 5 and probe.clock.seconds_since_step(2) is None  # no steady step
    # Two windows (2-3 and 10-11): DDP's hook waits for the last, and the steady time ends where it
    # starts, a step that is stamped anyway.
    probe = Probe(torch.device("cuda"), window=2, warmup=2, repeats=2)
    assert epoch(12, measure=True) == 4 * 5 and (probe.hook_from, probe.steady_end) == (10, 10)
    assert 0 < probe.steady_seconds() < probe.clock.seconds_since_step(2)


def kineto_trace(path: Path, devices: int) -> Path:
    """A Chrome trace as torch.profiler (Kineto) writes DataParallel's: the phases as CPU ranges (and
    their copies on the GPU's timeline), then each GPU's kernels, which name their device in args."""
    events = [{"ph": "X", "cat": "user_annotation", "name": name, "ts": 1000 + 100 * i, "dur": 100, "pid": 1, "tid": 1}
              for i, name in enumerate(("data", "forward", "backward", "optimizer"))]
    events += [{"ph": "X", "cat": "gpu_user_annotation", "name": "forward", "ts": 1100, "dur": 100, "pid": 0, "tid": 7}]
    events += [{"ph": "X", "cat": "kernel", "name": "void gemm<float>", "ts": 1110 + device, "dur": 40, "pid": device,
                "tid": 7, "args": {"device": device, "stream": 7, "correlation": 10 + device}}
               for device in range(devices)]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


@pytest.mark.fast
def test_each_gpu_s_kernels_get_a_lane_of_their_own(tmp_path):
    """DataParallel over 12 GPUs runs kernels on each from one process: a lane per device, in device
    order (GPU 2 before GPU 10), one legend entry for them all."""
    from pipeline.breakdown import timeline
    from pipeline.explain import lane_order, timeline_png

    bars = timeline(kineto_trace(tmp_path / "trace.json", 12), rank=0)
    lanes = {bar["lane"] for bar in bars}
    assert lanes == {"phases"} | {f"GPU {d} kernels" for d in range(12)}
    assert [bar["start_ms"] for bar in bars if bar["lane"] == "GPU 3 kernels"] == [0.113]
    assert sorted(lanes, key=lambda lane: lane_order((0, lane)))[:3] == ["GPU 0 kernels", "GPU 1 kernels", "GPU 2 kernels"]
    timeline_png({"dp": {"ranks": [{"timeline": bars}]}}, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ddp_ranks_measure_their_buckets_and_trace_at_an_odd_world_size(ddp_trainings):
    """3 ranks: the comm hook keeps DDP's arithmetic (the same weights, bit for bit, as DDP's
    built-in all-reduce), every rank measures its one bucket of the model's gradients, and each
    rank's trace holds gloo's all-reduce beside the phases."""
    from pipeline.model import build_model

    out = ddp_trainings / "buckets"
    off, on, apart = [[json.loads((out / f"rank-{r}" / f"result-{s}-{n}.json").read_text()) for r in range(3)]
                      for s, n in BUCKET_SETTINGS]
    checksums = {r["checksum"] for r in off + on + apart}
    assert len(checksums) == 1, checksums
    assert off[0]["breakdown"] is None
    # The hook (Python on the gradients' path) runs from its window's first step to the end, one
    # bucket a step; before it, and with the breakdown off, DDP's own. With one window (steps 2 to
    # 7, after the warm-up) that is the window; with two (2 to 4, then 9 to 11, after the trace)
    # the last, so the first window's steps and the steady throughput (2 to 8) run without it.
    assert [r["hooked_steps"] for r in off] == [[]] * 3
    assert [r["hooked_steps"] for r in on] == [[2, 3, 4, 5, 6, 7] + [None] * 4] * 3
    assert [r["hooked_steps"] for r in apart] == [[9, 10, 11]] * 3
    assert [r["steady_steps"] for r in off + on + apart] == [10] * 6 + [7] * 3
    for r, result in enumerate(apart):
        rank = result["breakdown"][r]
        assert (rank["steps"], rank["windows"], rank["hooked_steps"], len(rank["step_s"])) == (3, 1, 3, 3)
        assert rank["median_s"]["comm"] > 0 and rank["buckets"] and "pre_sync_compute_s" not in rank
        assert rank["median_s"]["compute"] == pytest.approx(rank["median_s"]["step"] - rank["median_s"]["comm_exposed"])
    gradient_bytes = sum(p.numel() * 4 for p in build_model("small").parameters())
    for r, result in enumerate(on):
        ranks = result["breakdown"]
        assert len(ranks) == 3 and ranks[r]["steps"] == 6 and ranks[r]["hooked_steps"] == 6
        median = ranks[r]["median_s"]
        assert median["comm"] > 0 and 0 <= median["comm_exposed"] <= median["comm"]
        assert [b["bytes"] for b in ranks[r]["buckets"]] == [gradient_bytes]  # under DDP's first 1 MiB bucket
        assert result["trace"] == [f"trace-rank-{r}.json"]
        lanes = {bar["lane"] for bar in ranks[r]["timeline"]}
        names = {bar["name"] for bar in ranks[r]["timeline"]}
        assert lanes == {"phases", "collectives"} and {"forward", "backward", "gloo:all_reduce"} <= names


EXPORT_DELAY_S = 6.0  # rank 1's trace export, slowed: a first CUPTI start on a GPU costs up to 1 s


def _train_with_a_slow_profiler(r: int, world: int, out: str) -> None:
    import time

    from pipeline import breakdown
    from pipeline.loop import Training, train
    from pipeline.parallel import Rank

    export = breakdown.export_trace
    if r == 1:
        def slow_export(*args, **kwargs):
            time.sleep(EXPORT_DELAY_S)
            return export(*args, **kwargs)

        breakdown.export_trace = slow_export
    try:
        # 12 steps: warm-up 2, window 4, trace 2, then 4 more whose all-reduce waits for rank 1.
        config = dataclasses.replace(train_config(60), breakdown_steps=4, trace_steps=2, throughput_warmup_steps=2)
        _, history = train(Training(config, "ddp", Rank(r, r, world, world), torch.device("cpu"),
                                    rank_dir(Path(out), r)),
                           learnable_data(60 * 12), learnable_data(30, seed=1))
    finally:
        breakdown.export_trace = export
    (Path(out) / f"times-{r}.json").write_text(json.dumps({k: history[-1][k] for k in
                                                            ("train_time_s", "steady_time_s", "epoch_time_s")}))


def test_one_rank_s_slow_profiler_stays_out_of_ddp_s_training_time(ddp_trainings):
    """Ranks 0 and 2 are done with the profiler first and wait for rank 1 at the next step's
    all-reduce: that wait is profiler time too, so the epoch's training time must not hold it."""
    out = ddp_trainings / "slow-profiler"
    times = [json.loads((out / f"times-{r}.json").read_text()) for r in range(3)]
    assert times[0] == times[1] == times[2]  # one figure for the epoch, on every rank
    # The epoch's wall time holds the slow export; the training time and the steady time must not.
    assert times[0]["epoch_time_s"] - times[0]["train_time_s"] >= 0.9 * EXPORT_DELAY_S, times[0]
    assert times[0]["epoch_time_s"] - times[0]["steady_time_s"] >= 0.9 * EXPORT_DELAY_S, times[0]


@pytest.mark.fast
def test_profiler_time_comes_off_each_rank_as_the_ranks_waited_for_it():
    from pipeline.loop import without_profiler

    walls, overheads, steady = (10.0, 10.0), (1.0, 3.0), (8.0, 8.0)
    assert without_profiler(walls, overheads, steady, steady_traced=True, waited=True) == ([7.0, 7.0], [5.0, 5.0])
    # The profiler's work was the epoch's last: nobody waited for anybody within it.
    assert without_profiler(walls, overheads, steady, steady_traced=True, waited=False) == ([9.0, 7.0], [7.0, 5.0])
    assert without_profiler(walls, overheads, (None, None), steady_traced=False, waited=True)[1] == [None, None]
