"""The `tiered-radix` command line."""
