"""Benchmarks behind `k3compile bench NAME`: one module per bench, each with register(sub) and run(args)."""
