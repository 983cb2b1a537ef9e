"""Test support: bad-input corpus generator, pack scan, benchmark-output reading (not installed)."""
