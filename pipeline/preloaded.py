"""What the fork server (pipeline.forkserver) imports first, once, for every DDP worker it forks:
each worker then starts with torch, MLflow's SQL store and torchrun's worker code in place (the
command's own module comes after it, pipeline.forkserver.PRELOAD).

Importing this module is the whole point of it; nothing else imports it.
"""

from pipeline import malloc

# First, as the CLI does in every process before any tensor: the workers inherit the setting.
malloc.keep_freed_memory()

import pipeline.tracking  # noqa: E402  (its MLflow settings come before MLflow reads them)
import mlflow.store.tracking.sqlalchemy_store  # noqa: E402,F401  the default store, opened by every rank
import torch.distributed.elastic.multiprocessing  # noqa: E402,F401  what unpickles each worker's entry
