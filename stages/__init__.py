"""Thin DVC entry points: each parses its options, loads params, calls `pipeline`, writes outputs."""

import pipeline  # noqa: F401  (first: it keeps another checkout's modules out; see its _only_this_projects_code)
