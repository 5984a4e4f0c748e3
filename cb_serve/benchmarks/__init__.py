"""Benchmarks packaged with cb-serve: ``cb-serve bench serve`` (``serve.py``) and the pieces the
repository's ``bench/`` scripts share (workloads, the HF baseline, reports)."""
