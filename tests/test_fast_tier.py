"""The fast tier (`make test-fast`: the tests marked `fast`) runs every module of pipeline/ and
stages/, in whatever process the module runs in: a module added without a fast test that runs it
fails here, in the full suite. `make test` runs the tier only here (`-m "not fast"`), so a fast
test that fails fails this one, named in its message."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT, subprocess_env


@pytest.mark.alone  # its run of the fast tier has timings of its own (a Ctrl-C answered within 3 s), and 2 workers
def test_the_fast_tier_runs_a_function_of_every_module():
    done = subprocess.run([sys.executable, "scripts/fast_tier_coverage.py"], cwd=ROOT, env=subprocess_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
    lines = done.stdout.strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    assert done.returncode == 0 and lines[-1].startswith("fast tier: every one of the"), \
        "\n".join([done.stdout[-3000:], *failed])


def test_a_module_whose_functions_never_ran_is_named(tmp_path, monkeypatch):
    """The check itself, on coverage data made here: a module imported but never called is missed;
    a module without functions counts once any of its lines ran."""
    import coverage

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import fast_tier_coverage as check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    called = tmp_path / "called.py"
    called.write_text("def f():\n    return 1\n")
    imported = tmp_path / "imported.py"
    imported.write_text("def g():\n    return 2\n")
    flat = tmp_path / "flat.py"
    flat.write_text("VALUE = 3\n")
    assert check.body_lines(called) == {2} and check.body_lines(flat) is None
    data = coverage.CoverageData(str(tmp_path / ".coverage"))
    data.add_lines({str(called): [1, 2], str(imported): [1], str(flat): [1]})
    data.write()
    rcfile = tmp_path / "rc"
    rcfile.write_text(f"[run]\ndata_file = {tmp_path / '.coverage'}\n")
    monkeypatch.setattr(check, "ROOT", tmp_path)
    monkeypatch.setattr(check, "modules", lambda: [called, imported, flat])
    assert check.unexercised(coverage, rcfile) == ["imported.py"]
