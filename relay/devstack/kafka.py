"""A throwaway Apache Kafka cluster in KRaft mode, run from the Maven Central jars with plain `java`.

The jars are resolved once by Maven into a cache folder (POSTBOX_CACHE_DIR, default ~/.cache/postbox) and
reused. Each node is a combined broker+controller; one node is the default, three give a real quorum for
failover tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from postbox.relay.devstack.ports import free_port, wait_for_port

POM = Path(__file__).with_name("kafka-pom.xml")


class KafkaStartError(RuntimeError):
    """The broker could not be resolved, formatted or started; the message says which step and why."""


def cache_dir() -> Path:
    return Path(os.environ.get("POSTBOX_CACHE_DIR", Path.home() / ".cache" / "postbox"))


def pom_version(pom: Path, property_name: str) -> str:
    """A `<property_name>` value from a POM's <properties> (the version it pins)."""
    text = pom.read_text()
    start = text.index(f"<{property_name}>") + len(property_name) + 2
    return text[start : text.index(f"</{property_name}>")]


def kafka_version() -> str:
    return pom_version(POM, "kafka.version")


def resolve_jars() -> Path:
    """The folder holding the broker's class path, resolved from Maven Central on first use."""
    return resolve_classpath(POM, f"kafka-{kafka_version()}")


def resolve_classpath(pom: Path, name: str) -> Path:
    """`pom`'s runtime dependencies copied into cache_dir()/name/libs by Maven, once; the folder.

    A stamp file marks a complete copy, so an interrupted download is redone rather than half-used.
    """
    libs = cache_dir() / name / "libs"
    stamp = libs / ".complete"
    if stamp.exists():
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaStartError(f"Maven (mvn) is needed once to fetch {name}'s jars: apt-get install maven")
    shutil.rmtree(libs, ignore_errors=True)
    result = subprocess.run(
        [
            mvn,
            "-B",
            "-q",
            "-f",
            str(pom),
            f"-Dmaven.repo.local={cache_dir() / 'm2'}",
            "dependency:copy-dependencies",
            f"-DoutputDirectory={libs}",
            "-DincludeScope=runtime",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    if result.returncode != 0:
        raise KafkaStartError(
            f"mvn could not resolve {name}'s jars:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    stamp.write_text(name)
    return libs


LOG4J2 = """\
status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = ${sys:kafka.logs.dir}/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
"""


# Times a node that exits during a cluster's start is started again before the start fails.
START_RESTARTS = 2


@dataclass
class KafkaNode:
    node_id: int
    port: int
    controller_port: int
    directory: Path
    host: str = "127.0.0.1"
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class LocalKafka:
    """Kafka nodes on `host` (127.0.0.1); `bootstrap` is what clients need.

    `command_prefix` runs the nodes under another command, e.g. `ip netns exec NAME` to put the broker in a
    network namespace of a test's own (with `host` its address there) so the test can cut its network.
    """

    nodes_count: int = 1
    base_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="postbox-kafka-")))
    auto_create_topics: bool = True
    default_partitions: int = 3
    heap: str = "512m"
    host: str = "127.0.0.1"
    command_prefix: list[str] = field(default_factory=list)
    nodes: list[KafkaNode] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return ",".join(node.address for node in self.nodes)

    def start(self, timeout: float = 90.0) -> LocalKafka:
        """Format and start every node, and wait until each answers metadata requests. A start that fails
        stops every node it had started and removes their directories (a failed three-node start once left
        two brokers running, and their data behind, after the test run that asked for it had ended)."""
        libs = resolve_jars()
        self._classpath = f"{libs}/*"
        try:
            return self._start(timeout)
        except BaseException:
            self.stop(remove=True)
            raise

    def _start(self, timeout: float) -> LocalKafka:
        self.nodes = [
            KafkaNode(i + 1, free_port(), free_port(), self.base_dir / f"node{i + 1}", self.host)
            for i in range(self.nodes_count)
        ]
        cluster_id = _cluster_id()
        for node in self.nodes:
            node.directory.mkdir(parents=True)
            (node.directory / "server.properties").write_text(self._properties(node))
            (node.directory / "log4j2.properties").write_text(LOG4J2)
            self._java(
                node,
                "kafka.tools.StorageTool",
                "format",
                # One argument: a cluster id can start with "-", which argparse would take for a flag.
                f"--cluster-id={cluster_id}",
                "-c",
                str(node.directory / "server.properties"),
                wait=True,
            )
        for node in self.nodes:
            self.start_node(node, wait=False)
        for node in self.nodes:
            self._wait_ready(node, timeout, restarts=START_RESTARTS)
        return self

    def _properties(self, node: KafkaNode) -> str:
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        replication = min(3, self.nodes_count)
        return "\n".join(
            [
                "process.roles=broker,controller",
                f"node.id={node.node_id}",
                f"controller.quorum.voters={voters}",
                f"listeners=PLAINTEXT://{node.host}:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
                f"advertised.listeners=PLAINTEXT://{node.host}:{node.port}",
                "controller.listener.names=CONTROLLER",
                "inter.broker.listener.name=PLAINTEXT",
                "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                f"log.dirs={node.directory / 'data'}",
                f"num.partitions={self.default_partitions}",
                f"default.replication.factor={replication}",
                f"min.insync.replicas={max(1, replication - 1)}",
                f"offsets.topic.replication.factor={replication}",
                f"transaction.state.log.replication.factor={replication}",
                f"transaction.state.log.min.isr={max(1, replication - 1)}",
                f"auto.create.topics.enable={'true' if self.auto_create_topics else 'false'}",
                "group.initial.rebalance.delay.ms=0",
                # A dead node is fenced (and its partitions move) after this; Kafka's 9 s default slows tests.
                "broker.session.timeout.ms=3000",
                "broker.heartbeat.interval.ms=500",
                "",
            ]
        )

    def _java(self, node: KafkaNode, main: str, *args: str, wait: bool) -> subprocess.Popen[bytes]:
        java = shutil.which("java")
        if java is None:
            raise KafkaStartError(
                "Java 17+ is needed to run the Kafka broker (apt-get install openjdk-17-jre-headless)"
            )
        command = [
            *self.command_prefix,
            java,
            f"-Xmx{self.heap}",
            f"-Xms{self.heap}",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={node.directory}",
            f"-Dlog4j2.configurationFile={node.directory / 'log4j2.properties'}",
            "-cp",
            self._classpath,
            main,
            *args,
        ]
        out = (node.directory / ("format.out" if wait else "stdout.log")).open("ab")
        # A session of its own, so Ctrl-C in the terminal reaches us first and we stop the broker cleanly.
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if wait and process.wait(timeout=120) != 0:
            raise KafkaStartError(
                f"{main} {args[0]} failed: {(node.directory / 'format.out').read_text()[-3000:]}"
            )
        return process

    def start_node(self, node: KafkaNode, wait: bool = True, timeout: float = 90.0) -> None:
        node.process = self._java(node, "kafka.Kafka", str(node.directory / "server.properties"), wait=False)
        if wait:
            self._wait_ready(node, timeout)

    def _wait_ready(self, node: KafkaNode, timeout: float, restarts: int = 0) -> None:
        """Wait until `node` answers metadata requests. A node that exits meanwhile is started again, up to
        `restarts` times, each with the whole `timeout` again: on a loaded machine a KRaft node can give up
        on its quorum before the others are up (node 1 of three did, at a load average of 8-10)."""
        deadline = time.monotonic() + timeout
        exits: list[int] = []
        # An open port is not a working broker: ask for cluster metadata until a controller answers.
        from confluent_kafka.admin import AdminClient  # noqa: PLC0415  (keeps this module light to import)

        admin = AdminClient({"bootstrap.servers": node.address})
        while time.monotonic() < deadline:
            code = node.process.poll() if node.process is not None else None
            if code is not None:
                exits.append(code)
                if len(exits) > restarts:
                    raise KafkaStartError(
                        f"Kafka node {node.node_id} exited during its start (exit codes {exits}, "
                        f"{len(exits) - 1} restarts): {self._tail(node)}"
                    )
                self.start_node(node, wait=False)
                deadline = time.monotonic() + timeout
                continue
            try:
                metadata = admin.list_topics(timeout=2)
                if metadata.brokers and metadata.controller_id >= 0:
                    return
            except Exception:  # noqa: BLE001,S110  (not up yet: any error means try again)
                pass
            time.sleep(0.2)
        listening = wait_for_port(node.port, 0.1, host=node.host)
        raise KafkaStartError(
            f"Kafka node {node.node_id} never answered metadata requests within {timeout:.0f} s "
            f"(port {node.port} {'open' if listening else 'never opened'}): {self._tail(node)}"
        )

    @staticmethod
    def _tail(node: KafkaNode) -> str:
        """The end of the node's server.log, and of its stdout (where the JVM says why it did not start)."""
        parts = []
        for name, size in (("server.log", 3000), ("stdout.log", 1000)):
            path = node.directory / name
            text = path.read_text(errors="replace")[-size:].strip() if path.exists() else ""
            parts.append(f"[{name}] {text or '(empty)'}")
        return "\n".join(parts)

    def stop_node(self, node: KafkaNode, kill: bool = False, timeout: float = 30.0) -> None:
        process = node.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def pause_node(self, node: KafkaNode) -> None:
        assert node.process is not None
        node.process.send_signal(signal.SIGSTOP)

    def resume_node(self, node: KafkaNode) -> None:
        assert node.process is not None
        node.process.send_signal(signal.SIGCONT)

    def stop(self, remove: bool = True) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.send_signal(signal.SIGCONT)  # a paused broker cannot act on SIGTERM
        for node in self.nodes:
            self.stop_node(node)
        if remove:
            shutil.rmtree(self.base_dir, ignore_errors=True)


def _cluster_id() -> str:
    # Kafka's cluster id is a base64url-encoded UUID without padding, 22 characters.
    import base64  # noqa: PLC0415

    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
