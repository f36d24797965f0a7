from django.db import models

# The table every example in examples/ shares; the place_order command creates it when missing.
ORDERS_TABLE = """
CREATE TABLE IF NOT EXISTS orders (
    id      text PRIMARY KEY,
    total   numeric(12, 2) NOT NULL CONSTRAINT orders_total_check CHECK (total >= 0),
    version integer NOT NULL DEFAULT 1
)"""


class Order(models.Model):
    id = models.TextField(primary_key=True)
    total = models.DecimalField(max_digits=12, decimal_places=2)
    version = models.IntegerField(default=1)

    class Meta:
        db_table = "orders"
        managed = False  # created by ORDERS_TABLE (a service of your own would have a migration)
