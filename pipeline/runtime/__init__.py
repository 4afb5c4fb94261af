"""How the pipeline's processes start, fork, get signals and end: the warm server every stage runs
in under DVC (warm, a stage's client, with its parts warm_common, warm_key, warm_address,
warm_start, warm_client and warm_exit; warm_server, the server), the DDP workers' fork server
(forkserver, preloaded), whether the NVIDIA driver was initialised before a fork (driver), how a
stop signal unwinds a command (lifecycle), and one training of a mode at a time (lockfile).
docs/fixed-cost.md tells the story.

Nothing here imports `stages`: what the warm server preloads and runs is named by the CLI's entry
point (stages/entry.py)."""
