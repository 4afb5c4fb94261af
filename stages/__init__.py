"""Thin DVC entry points: each parses its options, loads params, calls `pipeline`, writes outputs."""
