"""Experiments around the pipeline: queue.py (the experiment queue, experiment names, dvc.yaml's stages),
overrides.py (params overrides as `dvc exp run -S` writes them), share.py (push/pull runs), report.py (the
experiments report), scratch.py (scratch copies of the repository), sweep.py and sweep_worker.py (hyperparameter
searches, on one machine or many), seeds.py (the pipeline over seeds), exps.py (the experiments table),
env_results.py (an experiment's metrics copied into the repository), wandb_report.py (the W&B Report), recipe.py
(params recipes applied as an experiment or in place). scripts/ holds their command lines."""
