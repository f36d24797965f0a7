"""The harness tests.bench.run's parts share (and the other benchmarks in tests/bench use): servers and the
processes that publish (servers), writers and consumers (traffic), statistics and printing (stats)."""
