"""The scaling model on links we control: DDP 2 nodes × 1 process on two emulated hosts (network
namespaces joined by a veth pair), the link shaped with `tc tbf` unshaped, at 1 Gbit/s and at
100 Mbit/s. In each setting commcheck measures the link, DDP trains on the tests' small MNIST slice,
and the table shows the measured median step beside the prediction (pipeline.scaling), and the
share of the step that waited on communication. tests/test_shaped_links.py asserts the same.

Needs root (namespaces, tc). Usage: .venv/bin/python benchmarks/shaped_links.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import ROOT  # noqa: E402
from tests.hosts import TwoHosts, skip_reason  # noqa: E402
from tests.shaped import RATES_MBIT, label, measure, node_dirs, prepared_project  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="trainings per setting; the table shows medians")
    parser.add_argument("--mnist", type=Path, default=ROOT.parent / "shared" / "data" / "mnist")
    args = parser.parse_args()
    if skip_reason():
        sys.exit(f"shaped_links: {skip_reason()}")
    root = Path(tempfile.mkdtemp(prefix="mnp-shaped-"))
    project = prepared_project(root, args.mnist)
    dirs = node_dirs(project, root)
    results: dict = {mbit: [] for mbit in RATES_MBIT}
    with TwoHosts() as hosts:
        for _ in range(args.repeats):
            for mbit in RATES_MBIT:
                results[mbit].append(measure(hosts, dirs, mbit, root))
    print(f"DDP 2 nodes x 1 process, gloo, medians of {args.repeats} trainings per link\n")
    print(f"{'link':<14} {'commcheck busbw':>16} {'step (ms)':>10} {'predicted (ms)':>15} {'error':>7} "
          f"{'comm exposed (ms)':>18} {'exposed share':>14}")
    for mbit, runs in results.items():
        med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        busbw = [r["link_busbw_gbps"] for r in runs if r["link_busbw_gbps"]]
        predicted = statistics.median(r["prediction"]["predicted_step_s"] for r in runs)
        error = statistics.median(r["prediction"]["prediction_error"] for r in runs)
        print(f"{label(mbit):<14} {f'{statistics.median(busbw) * 1000:.1f} MB/s' if busbw else 'n/a':>16} "
              f"{med('measured_step_s') * 1e3:>10.1f} {predicted * 1e3:>15.1f} {error:>+7.1%} "
              f"{med('comm_exposed_s') * 1e3:>18.1f} {med('exposed_share'):>14.0%}")
    print(f"\n(work files in {root})")


if __name__ == "__main__":
    main()
