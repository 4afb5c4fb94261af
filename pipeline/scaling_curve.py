"""The strong-scaling curves of ddp (and fsdp) on this host: the same global batch at several world
sizes, measured (median step with its interval, pipeline.spread) beside what the scaling model
predicts, a curve for each mode.

Speed-up at N ranks is the smallest world's median step over N's (the same global batches: how
much faster a typical step runs). The ideal is the hardware the ranks add: one device each on GPUs, up to
the devices there are; on a CPU the first rank already runs on every core (torch's intra-op
threads), and more ranks only divide the same cores, so the ideal stays 1x at every N.

The model: the smallest world's compute, divided by the hardware N ranks add (as above), plus
the communication at N ranks on the link commcheck measured: ddp's buckets all-reduced (pipeline.
scaling's ring formula and bucket order), or fsdp's all-gathers and reduce-scatters, their calls and
bytes a step as the smallest world of 2 or more ranks measured them (one rank makes none), all of
them exposed, as on a CPU they are (pipeline.scaling.fsdp_comm_s). On a CPU with more ranks than
cores the ranks time-share the cores; the model has no term for that (its compute keeps the total
work on the same cores, its communication the link measured with commcheck's ranks), so the gap
there is what oversubscription costs.
"""

from __future__ import annotations

from pathlib import Path

from pipeline import scaling, spread
from pipeline.errors import PipelineError
from pipeline.plotting import pyplot
from pipeline.report import interval_text


def capacity(ranks: int, device: str, devices: int) -> int:
    """How many times the smallest world's hardware N ranks have (see the module's doc)."""
    return 1 if device == "cpu" else max(1, min(ranks, devices))


def predicted_step_s(base: dict, link: scaling.Link | None, ranks: int, device: str, devices: int,
                     collectives: dict | None = None) -> float | None:
    """The model's step at `ranks` from the smallest world's breakdown `base` (fsdp's: with the
    `collectives` a step of a world of 2 or more made, see `fsdp_collectives`)."""
    rank = scaling.slowest_rank(base)
    if rank is None:
        return None
    m, share = rank["median_s"], capacity(ranks, device, devices) / capacity(base["world_size"], device, devices)
    compute = m["compute"] / share
    if ranks == 1 or (base["mode"] == "ddp" and not rank.get("buckets")):
        return compute
    if link is None:
        return None
    if base["mode"] == "fsdp":
        return compute + scaling.fsdp_comm_s(collectives, link, ranks) if collectives else None
    _, exposed = scaling.ddp_exposed_s(rank["buckets"], m["backward_compute"] / share, link, ranks)
    return compute + exposed


def fsdp_collectives(runs: dict[int, dict]) -> dict | None:
    """fsdp's all-gathers and reduce-scatters a step (calls, bytes), from the smallest world that
    timed them: their count is the layers', their bytes the whole model's, at any world size."""
    for ranks in sorted(runs):
        rank = scaling.slowest_rank(runs[ranks])
        if ranks > 1 and rank and rank.get("collectives"):
            return rank["collectives"]
    return None


def beyond_hardware(ranks: int, smallest: int, speedup: float, bound: float, device: str,
                    mode: str = "ddp") -> list[str]:
    """compare's bound, here: a speed-up over the smallest world above the cores (CPU ranks share
    them; the smallest world's threads already used them all) or the GPUs added is no measurement
    of the ranks, but of the smallest world's run slowed (another job, a busy host)."""
    if speedup <= bound:
        return []
    what = f"{bound:g} core(s)" if device == "cpu" else f"{bound:g}x the GPUs of {smallest} rank(s)"
    return [f"{mode} on {ranks} rank(s): a speed-up of {speedup:.2f}x over {smallest} rank(s) is more than its {what} "
            f"allow: the run on {smallest} rank(s) was probably slowed by other work on the host; run make scaling "
            "again on a quiet machine"]


def curve(runs: dict[int, dict], link: scaling.Link | None, cores: int, devices: int) -> list[dict]:
    """One row per world size from each run's results/breakdown/<mode>.json (`runs`: ranks -> it),
    all of one mode."""
    sizes = sorted(runs)
    base = runs[sizes[0]]
    device, mode = base["device"], base["mode"]
    collectives = fsdp_collectives(runs) if mode == "fsdp" else None
    base_steps, base_windows = spread.step_series(base), spread.windows_of(base)
    base_predicted = predicted_step_s(base, link, sizes[0], device, devices, collectives)
    rows = []
    for ranks in sizes:
        steps, windows = spread.step_series(runs[ranks]), spread.windows_of(runs[ranks])
        if not steps:
            raise PipelineError(f"{mode} on {ranks} rank(s) measured no step (an epoch shorter than "
                                "train.trace_steps?): nothing to draw")
        step = spread.median_interval(steps, windows)
        speedup = (spread.speedup_interval(base_steps, steps, base_windows, windows) if ranks != sizes[0]
                   else spread.Interval(1.0, 1.0, 1.0))
        ideal = capacity(ranks, device, devices) / capacity(sizes[0], device, devices)
        predicted = predicted_step_s(base, link, ranks, device, devices, collectives)
        rows.append({
            "mode": mode, "ranks": ranks, "device": device, "steps_measured": len(steps),
            "step": step, "speedup": speedup, "ideal_speedup": ideal,
            "efficiency": speedup.scaled(1 / ideal) if speedup else None,
            "predicted_step_s": predicted,
            "predicted_speedup": base_predicted / predicted if predicted and base_predicted else None,
            # More ranks than the cores they share: each time-shares a core (CPU ranks only).
            "oversubscribed": device == "cpu" and ranks > cores,
            # On a CPU the smallest world kept min(its ranks, the cores) busy at least: the rest is the most more ranks add.
            "warnings": [*beyond_hardware(ranks, sizes[0], speedup.value,
                                          cores / min(sizes[0], cores) if device == "cpu" else ideal, device, mode),
                         *spread.disturbances(f"{mode} on {ranks} rank(s)", steps, step, None,
                                              runs[ranks].get("host_load"))],
        })
    return rows


def as_json(rows: list[dict], cores: int, link: scaling.Link | None) -> dict:
    def interval(value: spread.Interval | None) -> dict | None:
        return None if value is None else {"value": value.value, "low": value.low, "high": value.high}

    return {"cores": cores, "link": vars(link) if link else None,
            "points": [{**row, "step": interval(row["step"]), "speedup": interval(row["speedup"]),
                        "efficiency": interval(row["efficiency"])} for row in rows]}


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.2f}"


def markdown(rows: list[dict], cores: int, link: scaling.Link | None) -> str:
    device = rows[0]["device"] if rows else "cpu"
    modes = list(dict.fromkeys(row["mode"] for row in rows)) or ["ddp"]
    lines = [f"# The scaling curve{'s' if len(modes) > 1 else ''} of {' and '.join(modes)} on this host", "",
             f"The same global batch on 1 to {max(row['ranks'] for row in rows)} ranks of {' and '.join(modes)} "
             f"({device}, {cores} core(s)), one training each (`make scaling`); medians of the measured steps with "
             "their 95% bootstrap intervals.", "",
             "| mode | ranks | steps measured | step (ms) | speed-up | ideal | scaling efficiency "
             "| predicted step (ms) | predicted speed-up | cores |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        step, speedup, efficiency = row["step"], row["speedup"], row["efficiency"]
        lines.append(
            f"| {row['mode']} | {row['ranks']} | {row['steps_measured']} | {interval_text(step, '.2f', scale=1000)} | "
            f"{interval_text(speedup, '.2f', 'x')} | {row['ideal_speedup']:g}x | "
            f"{interval_text(efficiency, '.0f', '%', scale=100)} | {_ms(row['predicted_step_s'])} | "
            + ("n/a" if row["predicted_speedup"] is None else f"{row['predicted_speedup']:.2f}x")
            + f" | {'oversubscribed: ' if row['oversubscribed'] else ''}"
            f"{row['ranks']} rank(s) on {cores} |")
    lines += ["", "![speed-up and efficiency against ranks](curve.png)", "",
              "Speed-up is a mode's smallest world's median step over this one's (every world trains on the same "
              "global batches). The ideal is the hardware the ranks add: a device each on GPUs; on a CPU none, "
              "since one rank already runs on every core, so the ideal stays 1x and the efficiency is the "
              "speed-up.",
              "",
              "The model: the smallest world's compute, divided by the hardware the ranks add, plus the "
              "communication at N ranks (ddp: its buckets all-reduced"
              + ("; fsdp: its all-gathers and reduce-scatters, as many and as large a step as its smallest world "
                 "of 2 or more ranks made them, all exposed" if "fsdp" in modes else "")
              + ") on "
              + (f"the link commcheck measured ({link.source})" if link else "no link (commcheck did not measure one: "
                 "no prediction past one rank)")
              + ". Ranks beyond the cores time-share them: the model has no term for that (its compute keeps "
                "the total work on the same cores, its communication the link as measured with fewer ranks), so "
                "the gap between the measured and predicted points there is what oversubscription costs."]
    for row in rows:
        for found in row["warnings"]:
            lines += ["", f"**Timing disturbed:** {found}."]
    return "\n".join(lines) + "\n"


COLOURS = {"ddp": "tab:blue", "fsdp": "tab:green"}


def png(rows: list[dict], path: Path, cores: int) -> None:
    """Speed-up and efficiency against ranks, a curve for each mode: measured with their intervals,
    the model's line, the ideal, and the ranks past the cores shaded."""
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    modes = list(dict.fromkeys(row["mode"] for row in rows))
    every = sorted({row["ranks"] for row in rows})
    for axes, key, label in ((left, "speedup", "speed-up over the smallest world"),
                             (right, "efficiency", "scaling efficiency")):
        for mode in modes:
            mine = [row for row in rows if row["mode"] == mode]
            ranks, values = [row["ranks"] for row in mine], [row[key] for row in mine]
            colour = COLOURS.get(mode, "tab:purple")
            axes.errorbar(ranks, [v.value for v in values],
                          yerr=[[v.value - v.low for v in values], [v.high - v.value for v in values]],
                          fmt="o-", capsize=4, color=colour, label=f"{mode}, measured (95% interval)")
            predicted = [(row["ranks"], row["predicted_speedup"] if key == "speedup"
                          else row["predicted_speedup"] / row["ideal_speedup"])
                         for row in mine if row["predicted_speedup"] is not None]
            if predicted:
                axes.plot(*zip(*predicted), "s:", color=colour, alpha=0.7, label=f"{mode}, scaling model")
        first = [row for row in rows if row["mode"] == modes[0]]
        ideal = [row["ideal_speedup"] if key == "speedup" else 1.0 for row in first]
        axes.plot([row["ranks"] for row in first], ideal, "--", color="tab:gray",
                  label="ideal (the hardware the ranks add)")
        if any(row["oversubscribed"] for row in rows):
            axes.axvspan(cores + 0.5, max(every) + 0.5, color="tab:red", alpha=0.08,
                         label=f"more ranks than the {cores} cores")
        axes.set(xlabel="ranks", ylabel=label, xticks=every)
        axes.set_ylim(bottom=0)
    left.legend(fontsize="small")
    figure.suptitle(f"{' and '.join(modes)} on this host: the same global batch over more ranks")
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")
    plt.close(figure)


def summary(rows: list[dict]) -> dict[str, list[tuple[float, int]]]:
    """The curves as MLflow metric series, one point per world size (the step is the ranks): ddp's
    named as ever (speedup, ...), fsdp's with an fsdp_ in front (fsdp_speedup, ...)."""
    series: dict[str, list[tuple[float, int]]] = {}
    for row in rows:
        prefix = "" if row["mode"] == "ddp" else f"{row['mode']}_"
        figures = {"speedup": row["speedup"].value, "speedup_low": row["speedup"].low,
                   "speedup_high": row["speedup"].high, "scaling_efficiency": row["efficiency"].value,
                   "step_s": row["step"].value, "step_s_low": row["step"].low, "step_s_high": row["step"].high,
                   "predicted_speedup": row["predicted_speedup"]}
        for name, value in figures.items():
            if value is not None:
                series.setdefault(prefix + name, []).append((value, row["ranks"]))
    return series
