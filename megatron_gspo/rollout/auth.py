"""The per-run secret of the rollout HTTP endpoints, and which host names mean this machine.

Any process on the machine can open a TCP connection to a loopback port, so a rollout server
without a secret lets any local program (a reward's sandboxed code, another user's job, a web
page through DNS rebinding) swap the policy's weights with ``/update_weights_from_disk``. The
trainer therefore makes one random key per run (:func:`new_api_key`), starts its servers with it
and sends it as ``Authorization: Bearer <key>`` on every call, which is how SGLang's
``--api-key`` works (SGLang 0.5.23, ``sglang/srt/utils/auth.py``: every endpoint except
``/health*``, ``/ready*`` and ``/metrics*`` needs the key; a missing or wrong key is a 401).
The key never goes on a command line, which every local user reads in ``/proc/<pid>/cmdline``:
launched SGLang servers get it in a private ``--config`` file, the embedded server's process in
its environment (``sglang_launcher.SGLangServerProcess``).

Servers the trainer does not start (``rollout.sglang.urls``) take their key from the
environment variable :data:`API_KEY_ENV`, which must then hold the ``--api-key`` they were
started with.
"""

from __future__ import annotations

import os
import secrets
from typing import Optional

from megatron_gspo.config.schema import is_loopback_host

API_KEY_ENV = "MEGATRON_GSPO_SGLANG_API_KEY"
"""Environment variable with the API key of SGLang servers the trainer connects to (and of
servers it launches, when set; otherwise launched servers get a fresh key per run)."""


def new_api_key() -> str:
    """A fresh secret: 32 random bytes, URL-safe base64 (fits a header and a YAML string), never
    starting with ``-``: SGLang hands the key of its ``--config`` file to argparse as
    ``--api-key <key>``, and argparse reads a value starting with ``-`` as a flag."""
    while True:
        key = secrets.token_urlsafe(32)
        if not key.startswith("-"):  # one key in 64; the next draw is as random
            return key


def api_key_from_environment() -> Optional[str]:
    """The key in :data:`API_KEY_ENV`, or None when unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def bearer_matches(authorization: Optional[str], api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <api_key>`` (constant-time compare,
    so the answer time does not reveal how much of the key a guess got right)."""
    if not authorization:
        return False
    scheme, _, credential = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(credential.strip().encode(), api_key.encode())


def host_header_is_loopback(value: Optional[str]) -> bool:
    """Whether an HTTP ``Host`` header (``name``, ``name:port``, ``[v6]:port``) names the
    loopback interface. Anything else means the request was addressed to another name, as a
    browser does after DNS rebinding, and a loopback-only server refuses it."""
    if not value:
        return False
    value = value.strip()
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return False
    else:
        host, colon, port = value.rpartition(":")
        if not colon:
            host = port
        elif not port.isdigit():
            return False
    return is_loopback_host(host)
