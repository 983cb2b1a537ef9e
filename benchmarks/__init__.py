"""ditkit benchmarks (not installed)."""
