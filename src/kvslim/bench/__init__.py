"""Benchmarks: throughput, latency, capacity and serving load against peers, and their report."""
