#!/usr/bin/env python
"""`make sweep-grid|sweep-random|sweep-optuna`: the command line of agentrl.experiments.sweep (its --help says how)."""

from agentrl.experiments import sweep

if __name__ == "__main__":
    sweep.main()
