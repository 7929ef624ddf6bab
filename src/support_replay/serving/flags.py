"""The flags every server of ours takes (serve, router, sessions): keys, allowed hosts, body and slow-client
bounds; and the upstream keys of a hop."""

from __future__ import annotations

import argparse
import sys

from . import DEFAULT_MAX_REQUEST_BYTES
from .connection_limits import ConnectionLimits


def keys_from_args(args: argparse.Namespace):
    from .security import Keys

    if getattr(args, "api_key", None):
        print(
            "support-replay: warning: --api-key shows in the process list; prefer --api-key-file or "
            "$SUPPORT_REPLAY_API_KEY",
            file=sys.stderr,
        )
    return Keys.load(args.api_key_file, args.admin_key_file, getattr(args, "api_key", None))


def add_key_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="generation routes need Authorization: Bearer KEY (also $SUPPORT_REPLAY_API_KEY)",
    )
    parser.add_argument(
        "--admin-key-file",
        default=None,
        help="weight, version and cache routes need Authorization: Bearer KEY (also $SUPPORT_REPLAY_ADMIN_KEY)",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=None,
        help="Host header to answer (repeat; default: the loopback names when bound to loopback)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body, chunked or not (413 beyond)",
    )
    # slow clients (serving/connections.py): every server cuts them off
    slow = ConnectionLimits()
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=slow.header_timeout,
        help="seconds from a connection (or a request's first byte) to the end of its headers; 408",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=slow.body_timeout,
        help="seconds from the end of a request's headers to the end of its body; closed beyond",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=slow.max_connections,
        help="connections held at once (at most the open-file limit less 256); 503 beyond",
    )
    parser.add_argument("--max-connections-per-client", type=int, default=slow.max_connections_per_client,
                        help="connections one address may hold; 503 beyond")  # fmt: skip


def add_upstream_key_flags(parser: argparse.ArgumentParser) -> None:
    """A hop's own keys for the engines behind it; its clients' key is never sent on."""
    parser.add_argument(
        "--upstream-api-key-file",
        default=None,
        help="key sent to the engines behind (also $SUPPORT_REPLAY_UPSTREAM_API_KEY); none by default",
    )
    parser.add_argument("--upstream-admin-key-file", default=None,
                        help="admin key sent to them (also $SUPPORT_REPLAY_UPSTREAM_ADMIN_KEY)")  # fmt: skip


def upstream_keys(args: argparse.Namespace):
    from .security import Keys

    return Keys.load_upstream(args.upstream_api_key_file, args.upstream_admin_key_file)


def connections_from_args(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(
        args.header_timeout, args.body_timeout, args.max_connections, args.max_connections_per_client
    )
