"""What ``airquant serve`` exposes and to whom: ``ServeConfig`` and the bind check.

No fastapi import here: the CLI checks the address before it loads a model (seconds to minutes) and
before it needs the serve extra at all.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from airquant.errors import AirQuantError

API_KEY_ENV = "AIRQUANT_API_KEY"
DEFAULT_MAX_BODY_MB = 4.0  # a 2048-token prompt is ~10 kB of JSON; 4 MB leaves room for long chats, not for abuse
DEFAULT_BODY_TIMEOUT_S = 30.0  # a body of 4 MB arrives in well under a second; a client dripping bytes is cut off
DEFAULT_MAX_PROMPTS = 64  # prompts in one /v1/completions request (the queue holds --max-queue of everyone's)
DEFAULT_MAX_REQUEST_TOKENS = 32768  # prompt + max new tokens, summed over a request's prompts (16 x 2048)


class InsecureBindError(AirQuantError):
    """A non-loopback address without an API key: anyone who can reach the port could use the model."""


@dataclass(frozen=True)
class ServeConfig:
    """``airquant serve`` flags: --host --port --api-key --insecure --max-body-mb --body-timeout-s --cors-origin
    --allowed-host --max-prompts --max-request-tokens."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer key for every route but /health; None: open (loopback only)
    insecure: bool = False  # allow a non-loopback bind without a key
    max_body_mb: float = DEFAULT_MAX_BODY_MB  # larger request bodies (counted as they arrive) get 413
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a body not received whole in this time gets 408
    cors_origins: tuple[str, ...] = ()  # browser origins allowed cross-site (the API and /ui); empty: CORS off
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides loopback, IPs and --host; "*": any
    max_prompts: int = DEFAULT_MAX_PROMPTS  # prompts in one request; more get 400
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS  # prompt + new tokens of one request; more get 400

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)


def api_key_from(flag: str | None) -> str | None:
    """``--api-key`` when given, else ``$AIRQUANT_API_KEY``; an empty key is an error, not "no key"."""
    key = flag if flag is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        source = "--api-key" if flag is not None else f"${API_KEY_ENV}"
        raise AirQuantError(f"{source} is empty; give a non-empty key, or unset it to serve without one.")
    return key


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; a wildcard (0.0.0.0, ::) or a name is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name may resolve to any interface


def check_bind(config: ServeConfig) -> None:
    """Refuse a non-loopback address without a key unless ``--insecure`` (the check runs before loading)."""
    if is_loopback(config.host) or config.api_key or config.insecure:
        return
    raise InsecureBindError(
        f"refusing to listen on {config.host}: it is not a loopback address and no API key is set, so anyone who "
        f"can reach port {config.port} could run the model (and read what others send it). Set a key with "
        f"--api-key KEY or ${API_KEY_ENV} (clients send 'Authorization: Bearer KEY'), listen on 127.0.0.1, "
        "or pass --insecure if the network itself is trusted.")
