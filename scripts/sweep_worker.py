#!/usr/bin/env python
"""`make sweep-worker|sweep-status|sweep-dashboard`: the command line of agentrl.experiments.sweep_worker (its --help
says how)."""

from agentrl.experiments import sweep_worker

if __name__ == "__main__":
    sweep_worker.main()
