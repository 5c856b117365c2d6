"""The CPU engine's native kernels: their C sources, each function's one declared signature (`signatures.py`) and
the loader that builds them on first use and binds them (`cpu_kernels.py`)."""
