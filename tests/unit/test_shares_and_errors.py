import pytest
from confluent_kafka import KafkaError

from postbox.relay.outbox.errors import Disposition, classify
from postbox.relay.outbox.shares import SHARD_COUNT, fair_share, split_lanes


@pytest.mark.parametrize("count", [1, 2, 3, 5, 7, 64, 65, 100])
def test_shares_add_up_to_all_shards_and_differ_by_at_most_one(count: int) -> None:
    members = [f"relay-{i}" for i in range(count)]
    shares = [fair_share(m, members) for m in members]
    assert sum(shares) == SHARD_COUNT
    assert max(shares) - min(shares) <= 1


def test_a_member_not_yet_listed_counts_itself() -> None:
    assert fair_share("new", []) == SHARD_COUNT
    assert fair_share("new", ["old"]) == SHARD_COUNT // 2


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (KafkaError.MSG_SIZE_TOO_LARGE, Disposition.PARK),
        (KafkaError._MSG_TIMED_OUT, Disposition.RETRY),
        (KafkaError._TRANSPORT, Disposition.RETRY),
        (KafkaError.NOT_ENOUGH_REPLICAS, Disposition.RETRY),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, Disposition.TOPIC_BLOCKED),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, Disposition.TOPIC_BLOCKED),
        (KafkaError.CLUSTER_AUTHORIZATION_FAILED, Disposition.FATAL),
    ],
)
def test_error_classification(code: int, expected: Disposition) -> None:
    assert classify(code) is expected


def test_a_fatal_flag_wins() -> None:
    assert classify(KafkaError._MSG_TIMED_OUT, fatal=True) is Disposition.FATAL


@pytest.mark.parametrize("lanes", [1, 2, 3, 8])
@pytest.mark.parametrize("owned", [[], [5], [9, 3], list(range(64)), [1, 2, 3, 40, 41, 63]])
def test_lanes_deal_every_owned_shard_to_exactly_one_lane(owned: list[int], lanes: int) -> None:
    dealt = split_lanes(owned, lanes)
    flat = [shard for lane in dealt for shard in lane]
    assert sorted(flat) == sorted(owned)  # none lost, none twice
    assert len(flat) == len(set(flat))
    assert all(dealt)  # no empty lane
    assert len(dealt) == min(lanes, len(owned))
    assert all(lane == sorted(lane) for lane in dealt)
