"""Reference models shared by the example, the benchmark and the tests."""
