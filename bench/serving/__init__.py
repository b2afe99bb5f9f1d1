"""The multi-turn serving benchmark (``bench/serve_multiturn.py``): its workload, client,
servers, statistics and report, one module each."""
