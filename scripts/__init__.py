"""memtrain's benchmark and maintenance scripts, run from the project root as modules: `python -m scripts.bench
SUITE` runs a benchmark suite of benchmarks/suites.yaml; the measuring scripts it runs share scripts.bench_common."""
