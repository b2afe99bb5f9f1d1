"""The tier engine: engine-agnostic units, tiers, ledger, codecs, scores, allocators and
diagnostics."""
