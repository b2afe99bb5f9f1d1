"""SGLang adapter: plugin (``--kv-policy``), tiered KV pool, tiered radix cache.

Importing this package does not import SGLang; :mod:`.plugin`, :mod:`.pool` and :mod:`.radix` do.
"""
