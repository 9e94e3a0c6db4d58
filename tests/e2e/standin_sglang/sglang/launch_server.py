"""``python -m sglang.launch_server`` stand-in: takes SGLang's launch flags and serves the embedded
engine (``megatron_gspo.rollout.server``, the same HTTP subset) for the model of ``--model-path``;
with ``STANDIN_SGLANG_FAIL`` set it exits with status 3 instead, as a server that dies at start.
It is a real child process with a real HTTP server on loopback, which is what the tests of
launching and stopping servers need."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from megatron_gspo.config import ModelConfig
from megatron_gspo.convert.hf_config import resolve_model_config
from megatron_gspo.rollout import server
from megatron_gspo.rollout.auth import API_KEY_ENV

if os.environ.get("STANDIN_SGLANG_FAIL"):  # a server that dies while starting (CUDA OOM, ...)
    print("stand-in SGLang: failing at start as asked", flush=True)
    sys.exit(3)
parser = argparse.ArgumentParser()
parser.add_argument("--model-path", required=True)
parser.add_argument("--port", required=True)
parser.add_argument("--config", required=True)  # as SGLang's: the launcher puts the key there
args, _ = parser.parse_known_args()  # --host, --tp-size, --weight-version, ...: not needed
with open(args.config) as config_file:
    os.environ[API_KEY_ENV] = json.load(config_file)["api-key"]  # the launcher writes JSON
model = resolve_model_config(ModelConfig(hf_path=args.model_path))
fields = {k: v for k, v in dataclasses.asdict(model).items() if k != "hf_path"}
server.main(["--port", args.port, "--model-config", json.dumps(fields)])
