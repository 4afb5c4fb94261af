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


def _record_imports() -> None:
    """Keep the sha256 of each `pipeline`, `stages` and `workloads` (the project's own workloads)
    source file as this process imports it
    (pipeline.record.check_code_as_imported): a run records the files on disk, which an editor may
    have saved since the imports (a fork server imports long before its workers record). Each
    module runs the very bytes hashed, compiled afresh: a cached .pyc is trusted by its source's
    mtime to the second and its size, which an edit within the second keeps (about 40 ms a process)."""
    import hashlib
    import importlib.machinery
    import sys
    from pathlib import Path

    imported: dict[str, str | None] = {}
    PACKAGES = ("pipeline", "stages", "workloads")  # pipeline.record.CODE_PACKAGES
    ours = tuple(str(Path(__file__).resolve().parent.parent / name) + "/" for name in PACKAGES)

    def digest(path: str) -> str | None:
        try:
            return hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            return None

    class Recorder:
        @staticmethod
        def find_spec(name, path, target=None):
            if name.partition(".")[0] not in PACKAGES:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            loader = getattr(spec, "loader", None)
            if spec is not None and (spec.origin or "").endswith(".py") and hasattr(loader, "source_to_code"):
                def exec_module(module, _origin=spec.origin, _loader=loader):
                    source = _loader.get_data(_origin)
                    imported[_origin] = hashlib.sha256(source).hexdigest()
                    exec(_loader.source_to_code(source, _origin), module.__dict__)

                loader.exec_module = exec_module
            return spec

    # This package, and what imported it (stages.entry; `python -m stages`'s __main__).
    for module in list(sys.modules.values()):
        origin = getattr(module, "__file__", None) or ""
        if origin.endswith(".py") and str(Path(origin).resolve()).startswith(ours):
            imported.setdefault(origin, digest(origin))
    sys.meta_path.insert(0, Recorder())
    sys.modules[__name__].IMPORTED_SOURCES = imported


_only_this_projects_code()
_record_imports()
