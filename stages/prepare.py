"""prepare: the workload's raw inputs -> verified splits in data/prepared/ (MNIST: IDX files -> uint8
tensors, their MD5s checked)."""

from pathlib import Path

import click

from pipeline import workloads
from pipeline.atomic import atomic_dir
from pipeline.config import load_config
from pipeline.errors import DataError, PipelineError
from pipeline.prepared import PREPARED_FILES, STATS_FILE, SPLITS, load_stats
from stages.common import params_option


@click.command(short_help="Read, verify and split the workload's data (MNIST) into data/prepared/.")
@params_option
@click.option("--out", default="data/prepared", show_default=True, type=click.Path(file_okay=False))
@click.option("--download-root", default="data/raw", show_default=True, type=click.Path(file_okay=False),
              help="Where the raw inputs are downloaded (MNIST: when MNIST_SOURCE is not set).")
def prepare(params_path: str, out: str, download_root: str) -> None:
    """Read the workload's raw inputs (MNIST: MNIST_SOURCE or a download), verify them, split them,
    write data/prepared/."""
    config = load_config(params_path)
    workload = workloads.workload_of(config.workload)  # refused here, before anything is written
    out_dir = Path(out)
    with atomic_dir(out_dir, PREPARED_FILES) as tmp:  # refuses a folder it did not make, before any download
        try:
            said = workload.prepare(tmp, Path(download_root), config.data)
            counts = described_counts(tmp, out_dir, config.workload.class_path)
        except PipelineError as exc:  # named by the folder it was for, not the one it is made in
            raise type(exc)(str(exc).replace(str(tmp), str(out_dir))) from None
        except Exception as exc:
            if type(workload).prepare is workloads.Workload.prepare:  # the package's own: a bug, with its traceback
                raise
            raise DataError(f"{config.workload.class_path}.prepare() failed ({type(exc).__name__}: "
                            f"{str(exc).replace(str(tmp), str(out_dir))}); nothing was written to {out_dir}") from None
    click.echo(f"prepared {counts}{f' from {said}' if said else ''} -> {out}")


def described_counts(folder: Path, out_dir: Path, class_path: str) -> str:
    """"train 54000, val 6000, test 10000", from the stats.json a workload's prepare wrote: every
    split named with its count, as the later stages read them."""
    if not (folder / STATS_FILE).is_file():
        raise DataError(f"{class_path}.prepare() wrote no {STATS_FILE} into {out_dir}: write one that gives each "
                        f"split's count, {{\"splits\": {{\"train\": {{\"count\": N}}, ...}}}}")
    splits = load_stats(folder).get("splits")
    counts = {name: (splits or {}).get(name, {}).get("count") if isinstance(splits, dict) else None
              for name in SPLITS}
    wrong = [name for name, count in counts.items() if not (isinstance(count, int) and count > 0)]
    if wrong:
        raise DataError(f"{class_path}.prepare(): {out_dir / STATS_FILE} gives no count of samples for "
                        f"{', '.join(wrong)}: it must give every split's, {{\"splits\": {{\"train\": {{\"count\": N}}, "
                        "...}}")
    return ", ".join(f"{name} {count}" for name, count in counts.items())
