"""`python examples/django_project/manage.py place_order 9.99`: places an order and writes its OrderChanged
event in one transaction (`transaction.atomic()`), so the event exists if and only if the order does."""

import uuid
from decimal import Decimal
from typing import Any

import django
from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from django.db import connection, transaction

from postbox import enqueue
from shop.models import ORDERS_TABLE, Order


class Command(BaseCommand):
    help = "Place an order and write its OrderChanged event in the same transaction."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("total", type=Decimal, help="the order's total, e.g. 9.99")

    def handle(self, *args: Any, total: Decimal, **options: Any) -> None:
        with connection.cursor() as cursor:
            cursor.execute(ORDERS_TABLE)
        with transaction.atomic():
            order = Order.objects.create(id=str(uuid.uuid4()), total=total.quantize(Decimal("0.01")))
            event_id = enqueue(
                connection,
                "order",
                order.id,
                "OrderChanged",
                {"order": order.id, "total": str(order.total), "seq": order.version},
                schema=settings.POSTBOX_SCHEMA,
            )
        driver = connection.Database  # the module Django's backend runs on: psycopg or psycopg2
        self.stdout.write(
            f"order {order.id} placed, event {event_id} "
            f"(Django {django.get_version()} on {driver.__name__} {driver.__version__.split()[0]})"
        )
