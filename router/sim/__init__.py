"""Simulation and benchmarks: trace replay, trace reading, the HTTP load generator and the router microbenchmark."""
