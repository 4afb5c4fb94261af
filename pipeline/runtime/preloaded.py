"""What the fork server (pipeline.runtime.forkserver) imports first, once, for every DDP worker it forks:
each worker then starts with torch, MLflow's SQL store and torchrun's worker code in place (the
command's own module comes after it, stages.common.WORKER_PRELOAD).

Importing this module is the whole point of it; nothing else imports it.
"""

import os

from pipeline import malloc

# A session of its own, as each worker takes (pipeline.runtime.forkserver.detach_worker): a signal to the
# launcher's process group (a closed terminal, `timeout`, `kill -- -PGID`, a container stopped)
# then reaches the launcher, whose agent stops the workers through this server. Killed alongside
# it, the server could no longer tell the agent that a worker lives, and the agent would signal
# none. It still ends with the launcher: its alive pipe closes.
os.setsid()

# First, as the CLI does in every process before any tensor: the workers inherit the setting.
malloc.keep_freed_memory()

from pipeline.tracking import store  # noqa: E402  (the package's MLflow settings come before MLflow reads them)

store.import_sql_store()
import torch.distributed.elastic.multiprocessing  # noqa: E402,F401  what unpickles each worker's entry
