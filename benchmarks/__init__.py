"""Benchmarks of the ftc10d process group (run each script directly; see docs/benchmarks.md)."""
