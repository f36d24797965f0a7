"""A FastAPI service on SQLAlchemy 2's AsyncSession (asyncpg): `POST /orders` places an order and writes its
OrderChanged event in the same transaction, so the event exists if and only if the order does.

    uvicorn --app-dir examples/fastapi_sqlalchemy orders_api:app --port 8000

DATABASE_URL names the database (a libpq URL, postgresql://...), POSTBOX_SCHEMA the outbox's schema
(default postbox). The `orders` table is created at startup when missing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import CheckConstraint, Numeric, Text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from postbox import enqueue_async

OUTBOX_SCHEMA = os.environ.get("POSTBOX_SCHEMA", "postbox")
engine = create_async_engine(make_url(os.environ["DATABASE_URL"]).set(drivername="postgresql+asyncpg"))
sessions = async_sessionmaker(engine, expire_on_commit=False)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    __table_args__ = (CheckConstraint("total >= 0", name="orders_total_check"),)

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    total: Mapped[Decimal] = mapped_column(Numeric(12, 2))
    version: Mapped[int] = mapped_column(server_default="1")


class PlaceOrder(BaseModel):
    total: Decimal = Field(max_digits=12, decimal_places=2)  # a negative one is the database's to refuse


class OrderChanged(BaseModel):
    """The event's payload, as the inbox example (postbox.inbox.example) projects it."""

    order: str
    total: Decimal  # sent as its exact digits, "9.99"
    seq: int


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)  # CREATE TABLE orders, when missing
    yield
    await engine.dispose()


app = FastAPI(lifespan=lifespan)


async def get_session() -> AsyncIterator[AsyncSession]:
    async with sessions() as opened:
        yield opened


@app.post("/orders", status_code=201)
async def place_order(
    body: PlaceOrder, session: Annotated[AsyncSession, Depends(get_session)]
) -> dict[str, str]:
    order = Order(id=str(uuid.uuid4()), total=body.total, version=1)
    try:
        async with session.begin():  # one transaction: commit writes both rows, an error neither
            session.add(order)  # INSERTed when enqueue_async runs its statement (the session's autoflush)
            event = OrderChanged(order=order.id, total=order.total, seq=order.version)
            event_id = await enqueue_async(
                session, "order", order.id, "OrderChanged", event, schema=OUTBOX_SCHEMA
            )
    except IntegrityError as error:  # e.g. a negative total, which the table's CHECK refuses
        raise HTTPException(422, f"order refused: {error.orig}") from None
    return {"order": order.id, "event": str(event_id)}
