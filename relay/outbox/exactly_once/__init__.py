"""Exactly-once publication (--exactly-once, log mode): each batch is one Kafka transaction that carries
its rows' messages and the batch's settlement (where its cursors move, which rows it parks), produced by a
transactional producer bound to a fixed group of shards, so that whoever takes a group over fences the
previous owner and reads the last committed settlement back before producing anything.

groups.py: which shards form a group (pure). settlement.py: what a batch's transaction records and
which of its rows it sends (pure). transactions.py: the producers, the transactions and the read-back.
"""
