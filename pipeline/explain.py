"""The report's "Where the time goes": each mode's measured step, what the scaling model predicts
for it, a projection to more devices, and a timeline of two traced steps per mode."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from pipeline import scaling, spread
from pipeline.config import CompareConfig
from pipeline.plotting import pyplot

PHASE_ROWS = (("data", "data"), ("forward_compute", "forward (compute)"), ("backward_compute", "backward (compute)"),
              ("comm_exposed", "communication, exposed"), ("optimizer", "optimizer"))
COLOURS = {"data": "tab:gray", "forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green",
           "dp:scatter": "tab:purple", "dp:replicate": "tab:pink", "dp:replicas": "tab:cyan", "dp:gather": "tab:olive"}


def links(comm: dict | None, config: CompareConfig) -> list[scaling.Link]:
    measured = scaling.measured_link(comm) if comm else None
    return ([measured] if measured else []) + [
        scaling.named_link(*spec) for spec in zip(config.link_names, config.link_busbw_gbps, config.link_latency_us)]


def scaling_report(breakdowns: dict[str, dict], config: CompareConfig) -> dict:
    """Predicted against measured for each mode that ran, and DDP (and DataParallel, on GPUs)
    projected to compare.devices on each link: commcheck's, as DDP's training recorded it, and
    the named ones."""
    # commcheck's link, as the distributed modes' trainings recorded it
    every_link = links(next((breakdowns[m]["link"] for m in ("ddp", "fsdp") if (breakdowns.get(m) or {}).get("link")),
                            None), config)
    own = next((link for link in every_link if link.name == "commcheck"), None)
    predictions = {mode: scaling.predict(b, own) for mode, b in breakdowns.items()}
    projections = []
    for mode, breakdown in breakdowns.items():
        for devices in config.devices:
            if mode == "ddp":
                projections += [p for p in (scaling.project_ddp(breakdown, link, devices) for link in every_link) if p]
            elif mode == "dp" and devices <= 16:  # one process on one machine
                projections += [p for p in [scaling.project_dp(breakdown, devices)] if p]
    for p, mode in ((p, "ddp" if p["link"] != "one machine" else "dp") for p in projections):
        p["mode"] = mode
    return {"links": [vars(link) for link in every_link], "predictions": predictions, "projections": projections,
            "assumptions": list(scaling.ASSUMPTIONS)}


def step_median(breakdown: dict, rank: dict) -> float:
    """The mode's step time (pipeline.spread's one definition); the slowest rank's median step for
    results from before the per-step series."""
    series = spread.step_series(breakdown)
    return statistics.median(series) if series else rank["median_s"]["step"]


def run_figures(breakdown: dict, prediction: dict | None) -> dict[str, float]:
    """The numbers each mode's MLflow run gets, under the same names in every mode."""
    rank = scaling.slowest_rank(breakdown)
    if rank is None:
        return {}
    m = rank["median_s"]
    step = step_median(breakdown, rank)
    if rank.get("comm_unmeasured"):  # no communication figure rather than a false 0
        return {"step_s": step}
    figures = {"step_s": step, "step_compute_s": m["compute"], "step_comm_s": m["comm"],
               "step_comm_exposed_s": m["comm_exposed"],
               "comm_exposed_share": m["comm_exposed"] / step if step else 0.0}
    for kind, k in (rank.get("collectives") or {}).items():  # fsdp's: step_all_gather_s, step_reduce_scatter_s
        figures[f"step_{kind}_s"] = k["median_s"]
    if rank.get("comm_overlap_fraction") is not None:
        figures["comm_overlap_fraction"] = rank["comm_overlap_fraction"]
    if prediction:
        figures["predicted_step_s"] = prediction["predicted_step_s"]
        if prediction["prediction_error"] is not None:
            figures["prediction_error"] = prediction["prediction_error"]
    return figures


def phase(rank: dict, key: str) -> float | None:
    """A measured rank's median of `key`: None (n/a) for communication where it was not measured;
    the whole forward for a breakdown made before the forward's own communication was (no forward_compute)."""
    if rank.get("comm_unmeasured") and key in ("comm", "comm_exposed", "backward_compute", "forward_compute"):
        return rank["median_s"][key.replace("_compute", "")] if key.endswith("_compute") else None
    median = rank["median_s"]
    return median.get(key, median["forward"]) if key == "forward_compute" else median[key]


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.2f}"


def markdown(breakdowns: dict[str, dict], report: dict) -> str:
    measured = {mode: scaling.slowest_rank(b) for mode, b in breakdowns.items()}
    measured = {mode: rank for mode, rank in measured.items() if rank}
    lines = ["## Where the time goes", ""]
    if not measured:
        why = next((b["unmeasured"] for b in breakdowns.values() if b.get("unmeasured")), "train.breakdown_steps is 0")
        return "\n".join(lines + [f"No step was measured: {why}.", ""])
    modes = list(measured)
    some = next(iter(measured.values()))
    lines += [f"The median of {some['steps']} steady-state steps of the last epoch ({some.get('windows', 1)} "
              f"window(s), the first after {some['first_step']} warm-up steps), on each mode's slowest rank, in "
              "milliseconds; each phase's median, so they add up to about the step. The step is the one "
              "every view shows: each measured step on the rank slowest at it, the median, with its 95% "
              "bootstrap interval.", "",
              "| | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    for key, label in PHASE_ROWS:
        lines.append(f"| {label} | " + " | ".join(_ms(phase(measured[m], key)) for m in modes) + " |")
    steps = {m: spread.median_interval(spread.step_series(breakdowns[m]), spread.windows_of(breakdowns[m]))
             for m in modes}
    lines.append("| **step** | " + " | ".join(
        f"**{_ms(measured[m]['median_s']['step'])}**" if steps[m] is None else
        f"**{_ms(steps[m].value)}** ({_ms(steps[m].low)}-{_ms(steps[m].high)})" for m in modes) + " |")
    lines.append("| communication, all | " + " | ".join(_ms(phase(measured[m], "comm")) for m in modes) + " |")
    lines.append("| of it overlapped with the compute | " + " | ".join(
        "n/a" if measured[m].get("comm_overlap_fraction") is None else f"{measured[m]['comm_overlap_fraction']:.0%}"
        for m in modes) + " |")
    for m in modes:
        if measured[m].get("buckets"):
            sizes = ", ".join(f"{b['bytes'] / 2**20:.2f} MiB (ready at {b['ready_fraction']:.0%} of the backward)"
                              for b in measured[m]["buckets"])
            lines += ["", f"{m}'s gradient buckets: {sizes}. A bucket's all-reduce can only overlap the backward "
                          "computing the buckets after it: with one bucket, none of it can."]
        if measured[m].get("collectives"):
            kinds = measured[m]["collectives"]
            lines += ["", f"{m}'s collectives a step: " + "; ".join(
                f"{k['calls']:g} {name.replace('_', '-')}s of {k['bytes'] / 2**20:.2f} MiB in all, {_ms(k['median_s'])} ms"
                for name, k in kinds.items()) + ". FSDP2 makes each on the training thread on the CPU, and the "
                "step waits for it: all exposed, in the phase it falls in (the weights gathered in the forward, "
                "again in the backward, the gradients scattered there)."]
        if measured[m].get("comm_unmeasured"):
            lines += ["", f"{m}'s communication is not measured: {measured[m]['comm_unmeasured']}."]
        if measured[m].get("dp_median_s"):
            parts = measured[m]["dp_median_s"]
            lines += ["", f"{m}'s forward: " + ", ".join(f"{part} {_ms(s)}" for part, s in parts.items())
                      + " ms (scatter from GPU 0, replicate the module, the replicas in threads, gather on GPU 0); "
                      "its gradient reduce onto GPU 0 is in the backward."]
    lines += ["", "How it is measured: each phase between stamps on the training thread (CUDA events on a GPU); "
                  "each DDP bucket's all-reduce from when it is handed to the backend to when it completes "
                  "(a communication hook with DDP's own arithmetic). Communication during the backward's compute "
                  "(until the last bucket is handed over) is overlapped; the rest is exposed. A rank's exposed "
                  "communication includes its wait for slower ranks: no all-reduce ends before every rank joined it. "
                  "fsdp's all-gathers and reduce-scatters: each from its call to its return (FSDP's own collectives, "
                  "timed where they run).",
              "", "![two traced steps per mode](timeline.png)", "", "### Predicted against measured", "",
              "| mode | ranks | measured step (ms) | predicted (ms) | error | predicted communication (ms) "
              "| of it exposed (ms) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, p in report["predictions"].items():
        if p is None:
            rank = scaling.slowest_rank(breakdowns[mode])
            why = (f"no step measured: {breakdowns[mode].get('unmeasured') or 'train.breakdown_steps is 0'}"
                   if rank is None else f"its communication is not measured ({rank['comm_unmeasured']})"
                   if rank.get("comm_unmeasured") else "its collectives were not timed (trained before they were)"
                   if mode == "fsdp" and not rank.get("collectives") else
                   "no link measured for this world (commcheck off, failed, or its all_reduce stopped below 64 KiB)")
            lines.append(f"| {mode} | | | n/a: {why} | | | |")
            continue
        error = "n/a" if p["prediction_error"] is None else f"{p['prediction_error']:+.1%}"
        lines.append(f"| {mode} | {p['world_size']} | {_ms(p['measured_step_s'])} | {_ms(p['predicted_step_s'])} | "
                     f"{error} | {_ms(p['predicted_comm_s'])} | {_ms(p['predicted_exposed_s'])} |")
    lines += ["", "The measured step is the step time above. DDP's prediction: the compute of the rank slowest at "
                  "each step, plus the exposed all-reduce the model computes from commcheck's measured link at DDP's "
                  "bucket sizes (with the comm timer in a window of its own: the measured step with the all-reduce "
                  "its window saw replaced by the model's). fsdp's: the measured step with its all-gathers and "
                  "reduce-scatters (all exposed on a CPU) replaced by the model's on the same link, at the calls "
                  "and bytes a step it measured: an all-gather half a ring all-reduce, a reduce-scatter a whole "
                  "one (gloo all-reduces for it). A mode on one device has no "
                  "communication to predict: its row checks that the phases add up to the step.",
              "", "### Projected", "", "| mode | link | devices | global batch | step (ms) | communication (ms) "
              "| exposed (ms) | samples/s | scaling efficiency |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in report["projections"]:
        efficiency = f"{p['scaling_efficiency']:.0%}" if "scaling_efficiency" in p else "n/a"
        lines.append(f"| {p['mode']} | {p['link']} | {p['devices']} | {p['global_batch']} | {_ms(p['step_s'])} | "
                     f"{_ms(p.get('comm_s'))} | {_ms(p.get('exposed_s'))} | {p['samples_per_s']:,.0f} | {efficiency} |")
    if not report["projections"]:
        lines.append("| | nothing to project: no DDP breakdown (and DataParallel needs GPUs) | | | | | | | |")
    lines += ["", "Links: " + "; ".join(f"{link['name']}: {link['source']}" for link in report["links"]) + ".",
              "", "Assumptions:", *[f"- {a}" for a in report["assumptions"]], ""]
    return "\n".join(lines)


KERNELS = re.compile(r"^GPU \d+")  # "GPU 3 kernels": one lane per device, one entry in the legend


def lane_order(lane: tuple[int, str]) -> tuple:
    """Rank by rank, and GPU 2's kernels before GPU 10's."""
    rank, name = lane
    return rank, [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def timeline_png(breakdowns: dict[str, dict], path: Path) -> None:
    """Two traced steps of each mode, drawn from each rank's profiler trace: the training thread's
    phases, the backend's collectives, DataParallel's parts and GPU kernels, lane by lane."""
    plt = pyplot()
    modes = [(mode, [bar for r in b.get("ranks", []) for bar in r.get("timeline", [])]) for mode, b in breakdowns.items()]
    modes = [(mode, bars) for mode, bars in modes if bars] or [("no trace (train.trace_steps: 0)", [])]
    lanes = [sorted({(b["rank"], b["lane"]) for b in bars}, key=lane_order, reverse=True) or [(0, "")]
             for _, bars in modes]
    figure, panels = plt.subplots(len(modes), 1, figsize=(10, 1.0 + sum(0.9 + 0.45 * len(l) for l in lanes)),
                                  gridspec_kw={"height_ratios": [1 + len(l) for l in lanes]}, squeeze=False)
    shown = {}
    for axes, (mode, bars), mode_lanes in zip(panels[:, 0], modes, lanes):
        for row, lane in enumerate(mode_lanes):
            mine = [b for b in bars if (b["rank"], b["lane"]) == lane]
            colours = [COLOURS.get(b["name"], "tab:red" if lane[1] == "collectives" else "black") for b in mine]
            axes.broken_barh([(b["start_ms"], b["ms"]) for b in mine], (row - 0.4, 0.8), color=colours)
            for b, colour in zip(mine, colours):
                shown.setdefault(b["name"] if b["name"] in COLOURS else KERNELS.sub("GPU", lane[1]), colour)
        axes.set_yticks(range(len(mode_lanes)), [f"rank {r}: {lane}" for r, lane in mode_lanes], fontsize="small")
        axes.set_title(mode, loc="left", fontsize="medium")
        axes.set_xlabel("ms from the first traced step's start")
    figure.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in shown.values()], list(shown), loc="upper right",
                  fontsize="x-small", ncol=min(len(shown), 6) or 1)
    figure.tight_layout(rect=(0, 0, 1, 0.95))
    figure.savefig(path, dpi=100, format="png")
    plt.close(figure)
