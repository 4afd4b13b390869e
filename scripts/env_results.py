"""`make env`'s copy of an experiment's metrics: the command line of agentrl.experiments.env_results (its --help says
how)."""

from agentrl.experiments.env_results import exp_ref, main  # noqa: F401  (exp_ref: scripts/compare_locks.py imports it)

if __name__ == "__main__":
    main()
