"""ditkit tests (not installed)."""
