"""Data-parallel MNIST training: the library behind the `mnist-pipeline` stages."""

__version__ = "0.1.0"


def _only_this_projects_code() -> None:
    """Drop the editable install's finder when it maps this package to another checkout than the
    one it was imported from (a DVC experiment's copy: stages/entry.py). It sits after the normal
    path search, so it would only be asked for a module this copy lacks, and would answer with
    the installed checkout's: a module deleted or renamed in the copy would still import, and run
    code the experiment never recorded. Without it, that import fails, as it should."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent
    for finder in list(sys.meta_path):
        # setuptools' editable finder keeps its package -> folder map in its module (MAPPING).
        mapping = getattr(sys.modules.get(getattr(finder, "__module__", None) or ""), "MAPPING", None)
        if isinstance(mapping, dict) and "pipeline" in mapping and Path(mapping["pipeline"]).resolve().parent != here:
            sys.meta_path.remove(finder)


_only_this_projects_code()
