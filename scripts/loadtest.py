#!/usr/bin/env python
"""`make loadtest`: a thin CLI over agentrl.benchmarks.loadtest (`--help`)."""

from agentrl.benchmarks.loadtest import main

if __name__ == "__main__":
    main()
