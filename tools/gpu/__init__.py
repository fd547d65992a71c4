"""The GPU run kit: run scripts for a device lease (run_short.sh, run_next.sh, ...), their phases, and the
bench harness they call (bench_ladder.py). docs/benchmarks/README.md says how a lease runs them."""
