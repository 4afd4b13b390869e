"""`make bench-real`: SmolLM2-135M-Instruct's decoding against this machine's roofline (the command line of
agentrl.benchmarks.decoding.bench_real_main; its --help says how)."""

from agentrl.benchmarks.decoding import bench_real_main as main

if __name__ == "__main__":
    main()
