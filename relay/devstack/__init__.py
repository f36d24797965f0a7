"""A real PostgreSQL and a real Apache Kafka on this machine, with no Docker.

Used by `postbox dev`, the demo, the tests and the benchmarks. Each server picks free ports, keeps its data in
a temporary folder, waits until it really answers, and is stopped (and its folder removed) on exit.
"""
