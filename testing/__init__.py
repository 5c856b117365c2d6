"""Test doubles and real-server harnesses that both the tests and the benchmarks use: a scripted engine, tiny
models built from configs, real redis-server topologies (one node, a Cluster, a Sentinel set, TLS
certificates), a multi-process fault cluster and the poison-pill worker. Not part of the installed package:
it is importable from a checkout only, so no default ever runs a test double."""
