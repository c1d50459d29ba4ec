"""`lmd bench`: offline engine benchmarks (throughput over a prompt set, latency at fixed lengths and batch sizes)."""
