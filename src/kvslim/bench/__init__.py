"""Benchmarks: the memory planner, throughput / latency / serving load, and their reports."""
