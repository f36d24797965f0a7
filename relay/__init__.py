"""postbox's relay (imported as `postbox.relay`; the idempotent inbox is `postbox.inbox`).

`relay.core` holds what both sides share (configuration, database access, migrations, logging);
`relay.outbox` is the daemon that moves outbox rows to Kafka; `relay.devstack` starts real local servers.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("postbox-outbox")  # the name on PyPI; "postbox" there is another project
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
