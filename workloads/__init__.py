"""The project's own workloads (docs/workloads.md): a module here, say `workloads/teamwork.py` with
a `pipeline.workloads.Workload` subclass `Mlp`, trains when params.yaml names it:

    workload:
      class_path: workloads.teamwork.Mlp
      init_args: {hidden: 64}

This folder is a DVC dependency of the stages that import workloads (prepare, commcheck, train,
evaluate, compare): an edit here reruns them. Every run records its files with the pipeline's code
(the `code_sha256` tag), so `mnist-pipeline reproduce` re-makes them too.
"""
