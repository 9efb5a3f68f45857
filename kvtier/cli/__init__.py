"""The `kvtier` command line."""
