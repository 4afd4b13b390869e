"""Experiments around the pipeline: queue.py (the experiment queue), overrides.py (params overrides as `dvc exp
run -S` writes them), share.py (push/pull runs), report.py (the experiments report), scratch.py (scratch copies
of the repository)."""
