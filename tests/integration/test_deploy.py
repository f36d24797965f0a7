"""deploy/ checked with the real tools: Kubernetes schemas (offline), promtool, a real Prometheus server,
a wheel build, and PostgreSQL enforcing the least-privilege roles."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from prometheus_client import CollectorRegistry

from postbox.inbox.metrics import InboxMetrics
from postbox.inbox.webhooks.receiver import ReceiverMetrics
from postbox.inbox.webhooks.worker import WorkerMetrics
from postbox.relay.devstack.ports import free_port
from postbox.relay.outbox import enqueue
from postbox.relay.outbox.admin import migrate_schema
from postbox.relay.outbox.metrics import RelayMetrics
from tests.support.database import outbox_states
from tests.support.processes import RelayProcess, followed_modes
from tests.support.repo import REPO
from tests.support.servers import Servers
from tests.support.waiting import wait_until

BASE = REPO / "deploy" / "kubernetes" / "base"
BUILT_IN = {
    "Namespace",
    "ServiceAccount",
    "ConfigMap",
    "Secret",
    "Job",
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "NetworkPolicy",
}


def documents() -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in sorted(BASE.glob("*.yaml")):
        found += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is needed for this test (make test installs it)"
    return found


def test_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    present = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_built_in_manifests_validate_strictly_against_the_kubernetes_schemas() -> None:
    files = sorted({str(path) for path, doc in documents() if doc["kind"] in BUILT_IN})
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", *files],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_pod_meets_the_restricted_pod_security_level() -> None:
    pods = [
        (path, doc["spec"]["template"]["spec"])
        for path, doc in documents()
        if doc["kind"] in ("Deployment", "Job")
    ]
    assert len(pods) == 5
    for path, pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True, path
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", path
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, path
            assert context["readOnlyRootFilesystem"] is True, path
            assert context["capabilities"]["drop"] == ["ALL"], path
            assert "limits" in container["resources"], path
        if path.name != "migrate-job.yaml":
            container = pod["containers"][0]
            assert {"livenessProbe", "readinessProbe"} <= container.keys(), path


def test_the_custom_resources_have_the_fields_the_operator_needs() -> None:
    by_kind = {doc["kind"]: doc for _, doc in documents()}
    monitor = by_kind["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    services = {doc["metadata"]["name"] for _, doc in documents() if doc["kind"] == "Service"}
    assert set(monitor["spec"]["selector"]["matchExpressions"][0]["values"]) == services
    assert by_kind["PrometheusRule"]["spec"]["groups"]


def rules_dir(tmp_path: Path) -> Path:
    spec = next(doc for _, doc in documents() if doc["kind"] == "PrometheusRule")["spec"]
    (tmp_path / "alerts.rules.yaml").write_text(yaml.safe_dump(spec))
    shutil.copy(REPO / "deploy" / "prometheus" / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    return tmp_path


def test_the_alerts_pass_promtool_and_fire_in_its_unit_tests(tmp_path: Path) -> None:
    directory = rules_dir(tmp_path)
    for args in (["check", "rules", "alerts.rules.yaml"], ["test", "rules", "alerts_test.yaml"]):
        result = subprocess.run(
            [tool("promtool"), *args], capture_output=True, text=True, cwd=directory, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr


def exported_metric_names() -> set[str]:
    registry = CollectorRegistry()
    RelayMetrics(registry)
    InboxMetrics(registry)
    ReceiverMetrics(registry)
    WorkerMetrics(registry)
    names = set()
    for family in registry.collect():
        names.add(family.name)
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in ("_total", "_bucket", "_sum", "_count")}
    return names


def test_every_metric_the_alerts_and_dashboard_use_is_one_postbox_exports() -> None:
    used = set()
    expressions = [
        rule["expr"]
        for group in next(doc for _, doc in documents() if doc["kind"] == "PrometheusRule")["spec"]["groups"]
        for rule in group["rules"]
    ]
    dashboard = json.loads((REPO / "deploy" / "grafana" / "postbox-dashboard.json").read_text())
    expressions += [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    for expression in expressions:
        used |= set(re.findall(r"\bpostbox_[a-z_]+", expression))
    assert used, "the expressions name postbox metrics"
    assert used - exported_metric_names() == set()


ROLES = ("migrator", "relay", "inbox", "receiver", "worker")


def refused(url: str, statement: str, params: tuple[object, ...] = ()) -> None:
    """`statement` run as the role in `url` fails for want of a privilege."""
    with psycopg.connect(url) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(statement, params)


def test_every_workload_works_under_its_own_role_and_is_refused_outside_its_job(
    own_postgres: Any, servers: Servers
) -> None:
    from postbox.inbox.webhooks.providers import stripe_signature_header  # noqa: PLC0415
    from tests.apps.bank import SCHEMA_SQL as BANK_SQL  # noqa: PLC0415
    from tests.apps.hooks import SCHEMA_SQL as HOOKS_SQL  # noqa: PLC0415
    from tests.support.database import execute_script  # noqa: PLC0415
    from tests.support.kafka import create_topic, produce  # noqa: PLC0415
    from tests.support.processes import InboxProcess, ReceiverProcess, WorkerProcess  # noqa: PLC0415
    from tests.support.webhooks import STRIPE_SECRET  # noqa: PLC0415

    with psycopg.connect(own_postgres.dsn, autocommit=True) as conn:
        migrate_schema(conn, "postbox", "log")  # a new outbox, as `postbox migrate` makes it: log mode
    passwords = [arg for role in ROLES for arg in ("-v", f"{role}_password='pw-{role}'")]
    run_roles = [tool("psql"), own_postgres.dsn, "-q", "-v", "schema=postbox", *passwords]
    run_roles += ["-f", str(REPO / "deploy/sql/roles.sql")]
    subprocess.run(run_roles, check=True, capture_output=True)
    subprocess.run(run_roles, check=True, capture_output=True)  # safe to run again
    host_part = own_postgres.dsn.split("@", 1)[1]
    url = {
        role: f"postgresql://{name}@{host_part}"
        for role, name in [
            ("migrator", "postbox_migrator"),
            ("relay", "postbox_relay"),
            ("inbox", "postbox_inbox"),
            ("receiver", "postbox_webhook_receiver"),
            ("worker", "postbox_webhook_worker"),
            ("writer", "orders_service"),
        ]
    }
    with psycopg.connect(own_postgres.dsn, autocommit=True) as admin:
        admin.execute("CREATE ROLE orders_service LOGIN IN ROLE postbox_writer")
        execute_script(
            admin, f"{BANK_SQL};{HOOKS_SQL}"
        )  # the services' own tables, granted as roles.sql says
        admin.execute("GRANT SELECT, INSERT, UPDATE ON accounts, effects TO postbox_inbox")
        admin.execute("GRANT INSERT ON applied TO postbox_webhook_worker")

    # The migrator: owns the schema, so `postbox migrate` (nothing left to apply) runs as it.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "postbox",
            "migrate",
            "--database-url",
            url["migrator"],
            "--schema",
            "postbox",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0, result.stderr

    # The writer: enqueue, nothing else.
    with psycopg.connect(url["writer"]) as app:
        for i in range(20):
            enqueue(app, f"least{uuid.uuid4().hex[:4]}", f"a{i}", "E", {"i": i})
        app.commit()
        # The SQL writers too (EXECUTE from roles.sql; no SELECT needed for the ids they return), rolled back.
        app.execute("SELECT postbox.enqueue('least', 'a', 'E', '{}')")
        [ids] = app.execute(
            "SELECT postbox.enqueue_many(ARRAY['least', 'least'], ARRAY['a', 'b'], ARRAY['E', 'E'], "
            "ARRAY['{}', '{}']::jsonb[])"
        ).fetchall()
        assert len(ids[0]) == 2
        app.rollback()
    refused(url["writer"], "SELECT count(*) FROM postbox.outbox")
    for column, value in [
        ("state", "published"),
        ("attempts", 2147483647),
        ("created_at", "infinity"),
        ("published_at", "now"),
        ("last_error", "x"),
    ]:
        refused(
            url["writer"],
            f"INSERT INTO postbox.outbox (aggregate_type, aggregate_id, event_type, {column}) "
            "VALUES ('least', 'a', 'E', %s)",
            (value,),
        )

    # The relay: publishes, and reaches neither the inboxes nor the rows' content columns for writing.
    with RelayProcess(url["relay"], servers.kafka_bootstrap, "postbox") as relay:
        wait_until(
            lambda: outbox_states(own_postgres.dsn, "postbox") == {"published": 20},
            60,
            what="published by the least-privilege relay",
        )
        assert relay.terminate() == 0
    assert followed_modes(relay) == ["log"], "the outbox's mode, read as the relay's role"
    # It kept the outbox's partitions ahead through the function it may execute, which runs as the
    # migrator; it cannot empty or drop a partition itself, and a writer cannot call that function.
    with psycopg.connect(own_postgres.dsn) as admin:
        owners = admin.execute(
            "SELECT DISTINCT pg_get_userbyid(c.relowner) FROM postbox.outbox_partition AS p "
            "JOIN pg_class AS c ON c.relname = p.name AND c.relnamespace = 'postbox'::regnamespace "
            "WHERE p.xid_from IS NOT NULL"
        ).fetchall()
    assert owners == [("postbox_migrator",)], "partitions created ahead, owned by the migrator"
    refused(url["relay"], "TRUNCATE postbox.outbox_default")
    refused(url["relay"], "DROP TABLE postbox.outbox_parked")
    refused(url["writer"], "SELECT postbox.outbox_maintain_partitions(16, NULL)")
    refused(url["relay"], "DELETE FROM postbox.outbox")
    refused(url["relay"], "UPDATE postbox.outbox SET payload = '{}'")
    refused(url["relay"], "SELECT count(*) FROM postbox.inbox_message")
    refused(url["relay"], "SELECT count(*) FROM postbox.webhook_inbox")

    # The inbox consumer: claims and applies (its handlers' tables granted to it), nothing of the outbox.
    topic = f"least-{uuid.uuid4().hex[:6]}"
    create_topic(servers.kafka_bootstrap, topic, 1)
    produce(
        servers.kafka_bootstrap,
        topic,
        [(f"m{i}", "Deposit", {"account": "acc", "amount": 1}) for i in range(5)],
    )
    with InboxProcess(
        url["inbox"], servers.kafka_bootstrap, "postbox", "tests.apps.bank:inbox", [topic]
    ) as inbox:
        wait_until(
            lambda: (
                psycopg.connect(own_postgres.dsn).execute("SELECT balance FROM accounts").fetchall() == [(5,)]
            ),
            60,
            what="deposits applied by the least-privilege consumer",
        )
        assert inbox.terminate() == 0
    refused(url["inbox"], "SELECT count(*) FROM postbox.outbox")
    refused(
        url["inbox"],
        "INSERT INTO postbox.outbox (aggregate_type, aggregate_id, event_type) VALUES ('a', 'b', 'c')",
    )
    refused(url["inbox"], "SELECT count(*) FROM postbox.webhook_inbox")
    refused(url["inbox"], "DELETE FROM postbox.inbox_message")

    # The webhook receiver: stores verified events; reads no payload back, reaches no outbox.
    body = json.dumps(
        {"id": "evt_least", "type": "invoice.paid", "data": {"object": {"id": "in_1"}}}
    ).encode()
    with ReceiverProcess(url["receiver"], "postbox") as receiver:
        signature = stripe_signature_header(STRIPE_SECRET, body, int(time.time()))
        assert receiver.post("stripe", body, {"Stripe-Signature": signature}) == (
            200,
            {"accepted": 1, "duplicates": 0},
        )
        assert receiver.terminate() == 0
    refused(url["receiver"], "SELECT payload FROM postbox.webhook_inbox")
    refused(url["receiver"], "UPDATE postbox.webhook_inbox SET status = 'done'")
    refused(url["receiver"], "SELECT count(*) FROM postbox.outbox")
    refused(url["receiver"], "SELECT count(*) FROM postbox.inbox_message")

    # The webhook worker: processes the stored event; stores none of its own, reaches no outbox.
    with WorkerProcess(url["worker"], "postbox") as worker:
        wait_until(
            lambda: (
                psycopg.connect(own_postgres.dsn).execute("SELECT event_id FROM applied").fetchall()
                == [("evt_least",)]
            ),
            60,
            what="the event processed by the least-privilege worker",
        )
        assert worker.terminate() == 0
    refused(
        url["worker"],
        "INSERT INTO postbox.webhook_inbox (provider, event_id, event_type, payload) "
        "VALUES ('x', 'y', 'z', '{}')",
    )
    refused(url["worker"], "SELECT count(*) FROM postbox.outbox")
    refused(url["worker"], "DELETE FROM postbox.webhook_inbox")

    # Without EXECUTE on the partitions' function (roles.sql not rerun after migration 0007), a relay
    # refuses to start and names the grant, before anything is claimed or sent.
    with psycopg.connect(own_postgres.dsn, autocommit=True) as admin:
        admin.execute(
            "REVOKE EXECUTE ON FUNCTION postbox.outbox_maintain_partitions(bigint, interval) "
            "FROM postbox_relay"
        )
    with RelayProcess(url["relay"], servers.kafka_bootstrap, "postbox") as relay:
        assert relay.process.wait(timeout=30) == 2
        assert "relay_misconfigured" in relay.log()
        assert "GRANT EXECUTE ON FUNCTION postbox.outbox_maintain_partitions" in relay.log()
    subprocess.run(run_roles, check=True, capture_output=True)  # granted again

    # Without the DELETE grant, --delete-on-publish is refused before anything is claimed or sent.
    with psycopg.connect(url["writer"]) as app:
        enqueue(app, "least", "a", "E", {"i": "after"})
        app.commit()
    with RelayProcess(url["relay"], servers.kafka_bootstrap, "postbox", "--delete-on-publish") as relay:
        assert relay.process.wait(timeout=30) == 2
        assert "relay_misconfigured" in relay.log()
        assert "GRANT DELETE ON postbox.outbox" in relay.log()
    assert outbox_states(own_postgres.dsn, "postbox") == {"published": 20, "pending": 1}


def test_a_real_prometheus_scrapes_a_running_relay_and_promtool_accepts_its_metrics(
    servers: Servers, schema: str, tmp_path: Path
) -> None:
    with psycopg.connect(servers.database_url) as app:
        enqueue(app, f"prom{uuid.uuid4().hex[:4]}", "a", "E", {"x": 1}, schema=schema)
        app.commit()
    with RelayProcess(servers.database_url, servers.kafka_bootstrap, schema) as relay:
        wait_until(
            lambda: outbox_states(servers.database_url, schema) == {"published": 1}, 60, what="published"
        )
        text = urllib.request.urlopen(f"http://127.0.0.1:{relay.metrics_port}/metrics", timeout=5).read()
        lint = subprocess.run(
            [tool("promtool"), "check", "metrics"], input=text, capture_output=True, check=False
        )
        assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()
        assert lint.stdout.decode() + lint.stderr.decode() == "", "no naming-convention complaints"
        web_port = free_port()
        (tmp_path / "prometheus.yml").write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": "postbox-relay",
                            "static_configs": [{"targets": [f"127.0.0.1:{relay.metrics_port}"]}],
                        }
                    ],
                }
            )
        )
        prometheus = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{web_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("wb"),
        )
        try:

            def series(expr: str) -> list[dict[str, Any]]:
                url = f"http://127.0.0.1:{web_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
                try:
                    reply = json.loads(urllib.request.urlopen(url, timeout=5).read())
                except OSError:
                    return []
                return list(reply["data"]["result"])

            wait_until(
                lambda: bool(series('up{job="postbox-relay"} == 1')),
                60,
                interval=0.5,
                what="Prometheus scraping the relay",
            )
            wait_until(
                lambda: bool(series("postbox_relay_published_total > 0")),
                30,
                interval=0.5,
                what="the relay's published counter in Prometheus",
            )
            assert series("postbox_relay_shards_owned")[0]["value"][1] == "64"
            assert series("postbox_relay_ready")[0]["value"][1] == "1"
        finally:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        assert relay.terminate() == 0
