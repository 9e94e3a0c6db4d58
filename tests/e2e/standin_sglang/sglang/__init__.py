"""A stand-in for the ``sglang`` package in tests that launch "SGLang" servers: a real SGLang
server needs a GPU. Only ``python -m sglang.launch_server`` exists (launch_server.py)."""
