"""Stand-in `sglang` package for CPU tests (see tests/fake_sglang/fake_server.py)."""
