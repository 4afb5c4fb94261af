"""Everything MLflow: only the modules of this package import mlflow (with mlflow_model.py, the
logged model's own code, which MLflow runs when it loads the model).

One parent run per mode per training (run name = the mode), and one child run per rank
(`<mode>/rank-<r>`), every rank logging its own. Rank 0 makes the parent and broadcasts its id.
Metrics go out in one batch per epoch and run, never per step, so tracking costs next to nothing.

One concern per module, each importing only those above it:
  store           where runs go (URIs, the default SQLite store), its checks, its errors as one line
  bucket          artifacts that every rank writes to a bucket: checked before training
  facts           what a run records about where it ran (git, DVC, the datasets it read)
  model           the logged model: logged, and loaded back without running anything from the store
  outbox          calls kept on disk until the server takes them (no MLflow)
  delivery        how a call reaches the store (at once, or through the outbox), and `send-runs`
  runs            a training's runs: made, logged to from every rank, ended whatever happens
  helper          the process that makes evaluate's and compare's calls (client side; no MLflow)
  after_training  what evaluate and compare add: numbers on the mode runs, the compare run
  helper_main     that process itself
  links           the UI's pages for a training's runs
  recorded        a run's record read back, for `reproduce`

This file holds only MLflow's process-wide settings, so that importing any of them sets those first
and puts no other module on a stage's path.
"""

import logging
import os

# A run prints the project's own lines. MLflow's INFO lines (schema migrations, "Skip logging GPU
# metrics", a "View run" URL per run, each repeated by every rank) would drown them; its warnings
# stay. MLflow reads these when first imported, which is always after this module; a user's own
# setting wins.
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
# Calls during training go through an outbox that retries until the server answers (see
# outbox.py), so MLflow's own retries (minutes, at its defaults) are kept short.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
# MLflow 3 reports usage to its makers unless told not to. A training pipeline sends nothing its
# user did not ask for (air-gapped clusters, privacy rules): off, unless the user sets it to false.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per download, in a log
# boto3, under MLflow's S3 artifacts, says at INFO where it found its credentials, in every rank's log.
logging.getLogger("botocore").setLevel(logging.WARNING)
