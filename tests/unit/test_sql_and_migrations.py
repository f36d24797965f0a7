import pytest

from postbox.relay.core.migrate import MigrationError, load_migrations, parse_migrations
from postbox.relay.core.sql import UnknownQuery, parse_queries, query
from postbox.relay.outbox.daemon import QUERIES


def test_named_queries_are_split_on_name_lines() -> None:
    queries = parse_queries("-- a comment\n-- name: one\nSELECT 1\n\n-- name: two\nSELECT 2;\n")
    assert queries == {"one": "SELECT 1", "two": "SELECT 2;"}


def test_a_query_defined_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="defined twice"):
        parse_queries("-- name: a\nSELECT 1\n-- name: a\nSELECT 2\n")


def test_relay_queries_load_and_unknown_names_are_clear() -> None:
    assert "FOR UPDATE SKIP LOCKED" in query(QUERIES, "claim_batch")
    with pytest.raises(UnknownQuery, match="no query named 'nope'"):
        query(QUERIES, "nope")


def test_shipped_migrations_are_numbered_from_one() -> None:
    migrations = load_migrations()
    assert [m.version for m in migrations] == list(range(1, len(migrations) + 1))


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"0001_a.sql": "", "0003_c.sql": ""}, "expected"),
        ({"1_a.sql": ""}, "NNNN_name.sql"),
    ],
)
def test_migration_names_and_gaps_are_checked(files: dict[str, str], message: str) -> None:
    with pytest.raises(MigrationError, match=message):
        parse_migrations(files)
