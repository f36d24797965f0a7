"""Free TCP ports on the loopback interface."""

import socket
import time


def free_port() -> int:
    """A port nobody listens on right now (the kernel picks it; a race with another process is unlikely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_port(port: int, timeout: float, host: str = "127.0.0.1") -> bool:
    """True once something accepts TCP connections on host:port, False when timeout seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False
