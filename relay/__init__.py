"""postbox: transactional-outbox relay (this package) and idempotent inbox (the `inbox` package).

`relay.core` holds what both sides share (configuration, database access, migrations, logging);
`relay.outbox` is the daemon that moves outbox rows to Kafka; `relay.devstack` starts real local servers.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("postbox")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
