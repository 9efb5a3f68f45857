"""Root of the test tree: pytest puts `tests/` on sys.path from here, so `support` (shared helpers) imports everywhere."""
