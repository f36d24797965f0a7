"""Fuzz targets (atheris) for the code that parses what strangers send: webhook signatures and bodies of
each provider, message ids in Kafka records, outbox rows an application writes, and settings.

Each target feeds the fuzzer's bytes to one parser and lets through only the errors that parser promises
(SignatureError, MalformedWebhook, MessageIdMissing, PayloadError, ValueError for settings). Anything else
escaping (a RecursionError, an OverflowError, a TypeError) is a crash the fuzzer reports with its input:
in the receiver or the consumer it would be a 500 or a poison message. The signed paths also check a
property: a body signed with the right secret always verifies, whatever the body.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
from collections.abc import Callable

import atheris

from postbox.inbox.message import IdSource, MessageIdMissing, event_type_of
from postbox.inbox.webhooks.config import providers_from_env
from postbox.inbox.webhooks.providers import (
    GenericHmac,
    MalformedWebhook,
    Marqeta,
    Shopify,
    SignatureError,
    Stripe,
    stripe_signature_header,
)
from postbox.relay.cli import services
from postbox.relay.core.kafka_config import parse_kafka_config
from postbox.relay.core.redact import redact, scrub
from postbox.relay.core.settings import declared, duration, load
from postbox.relay.outbox.enqueue import OutboxEvent, PayloadError, _row
from postbox.relay.outbox.routing import OutboxRow, RoutingError, check_topic_name, to_message, topic_for

NOW = 1_800_000_000
SECRET = "whsec_fuzz"


def _headers(fdp: atheris.FuzzedDataProvider, names: tuple[str, ...]) -> dict[str, str]:
    return {name: fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 200)) for name in names}


def _events_or_malformed(parse: Callable[[], object]) -> None:
    with contextlib.suppress(MalformedWebhook):
        parse()


def stripe(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    provider = Stripe((SECRET,))
    header = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 300))
    body = fdp.ConsumeBytes(fdp.remaining_bytes())
    with contextlib.suppress(SignatureError):
        provider.verify({"stripe-signature": header}, body, NOW)
    # Extra items (another v1, junk) must not spoil a valid signature; another t= changes what is signed.
    extra = [item for item in header.split(",") if item.strip().partition("=")[0] != "t"]
    signed = ",".join([stripe_signature_header(SECRET, body, NOW), *extra])
    provider.verify({"stripe-signature": signed}, body, NOW)
    _events_or_malformed(lambda: provider.events({}, body))


def shopify(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    provider = Shopify((SECRET,))
    headers = _headers(fdp, ("x-shopify-hmac-sha256", "x-shopify-webhook-id", "x-shopify-topic"))
    body = fdp.ConsumeBytes(fdp.remaining_bytes())
    with contextlib.suppress(SignatureError):
        provider.verify(headers, body, NOW)
    good = base64.b64encode(hmac.new(SECRET.encode(), body, hashlib.sha256).digest()).decode()
    provider.verify({**headers, "x-shopify-hmac-sha256": good}, body, NOW)
    _events_or_malformed(lambda: provider.events(headers, body))


def marqeta(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    provider = Marqeta("user", "password", SECRET)
    headers = _headers(fdp, ("authorization", "x-marqeta-signature"))
    body = fdp.ConsumeBytes(fdp.remaining_bytes())
    with contextlib.suppress(SignatureError):
        provider.verify(headers, body, NOW)
    good = {
        "authorization": "Basic " + base64.b64encode(b"user:password").decode(),
        "x-marqeta-signature": hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest(),
    }
    provider.verify(good, body, NOW)
    _events_or_malformed(lambda: provider.events(good, body))


def generic(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    encoding = fdp.PickValueInList(["hex", "base64"])
    provider = GenericHmac(
        "acme",
        (SECRET,),
        encoding=encoding,
        id_from=fdp.PickValueInList(["header:x-event-id", "payload:id", "payload:a.b.c"]),
        type_from=fdp.PickValueInList(["payload:type", "header:x-type", "payload:x.0"]),
    )
    headers = _headers(fdp, ("x-signature", "x-event-id", "x-type"))
    body = fdp.ConsumeBytes(fdp.remaining_bytes())
    with contextlib.suppress(SignatureError):
        provider.verify(headers, body, NOW)
    digest = hmac.new(SECRET.encode(), body, hashlib.sha256).digest()
    signature = digest.hex() if encoding == "hex" else base64.b64encode(digest).decode()
    provider.verify({**headers, "x-signature": f"sha256={signature}"}, body, NOW)
    _events_or_malformed(lambda: provider.events(headers, body))


def message_id(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    spec = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
    try:
        source = IdSource.parse(spec)
    except ValueError:
        source = IdSource.parse(
            fdp.PickValueInList(["header:id", "payload:id", "payload:a.b", "coordinates"])
        )
    headers = {
        fdp.ConsumeUnicodeNoSurrogates(8): fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        for _ in range(fdp.ConsumeIntInRange(0, 4))
    }
    headers["id"] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
    value = fdp.ConsumeBytes(fdp.remaining_bytes())
    try:
        extracted = source.extract("topic", 0, 1, headers, value)
        assert isinstance(extracted, str)
    except MessageIdMissing:
        pass
    event_type_of(headers, "eventType")


def outbox_row(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    texts = [fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 30)) for _ in range(3)]
    headers = {fdp.ConsumeUnicode(10): fdp.ConsumeUnicode(20) for _ in range(fdp.ConsumeIntInRange(0, 3))}
    depth = fdp.ConsumeIntInRange(0, 3000)
    payload: object = fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 100))
    for _ in range(depth):
        payload = [payload]
    if fdp.ConsumeBool():
        payload = fdp.ConsumeBytes(fdp.remaining_bytes())
    event = OutboxEvent(texts[0], texts[1], texts[2], payload, headers)  # type: ignore[arg-type]
    with contextlib.suppress(PayloadError):
        _row(event)


def settings(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    with contextlib.suppress(ValueError):
        duration(fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40)))
    with contextlib.suppress(ValueError):
        parse_kafka_config([fdp.ConsumeUnicodeNoSurrogates(30) for _ in range(fdp.ConsumeIntInRange(0, 3))])
    names = [
        "POSTBOX_WEBHOOK_STRIPE_SECRETS",
        "POSTBOX_WEBHOOK_STRIPE_TOLERANCE",
        "POSTBOX_WEBHOOK_SHOPIFY_SECRETS",
        "POSTBOX_WEBHOOK_MARQETA_USERNAME",
        "POSTBOX_WEBHOOK_MARQETA_PASSWORD",
        "POSTBOX_WEBHOOK_MARQETA_SECRET",
        "POSTBOX_WEBHOOK_MARQETA_ALGORITHMS",
        "POSTBOX_WEBHOOK_GENERIC",
        "POSTBOX_WEBHOOK_ACME_SECRETS",
        "POSTBOX_WEBHOOK_ACME_ALGORITHM",
        "POSTBOX_WEBHOOK_ACME_ENCODING",
        "POSTBOX_WEBHOOK_ACME_ID_FROM",
    ]
    environ = {name: fdp.ConsumeUnicodeNoSurrogates(12) for name in names if fdp.ConsumeBool()}
    with contextlib.suppress(ValueError):
        providers_from_env(environ)
    # Every declared setting of every service, from the environment: a value is taken or refused with
    # SettingsError (a ValueError), never another exception.
    for cls in services().values():
        declared_names = [item.env for item in declared(cls) if "<" not in item.env]
        environ = {
            name: fdp.ConsumeUnicodeNoSurrogates(16)
            for name in declared_names
            if fdp.ConsumeIntInRange(0, 3) == 0
        }
        with contextlib.suppress(ValueError):
            load(cls, None, environ)


def relay_row(data: bytes) -> None:
    """A row as any writer with INSERT could leave it (any text, headers of any JSON type): routing either
    gives a legal topic and a message, or a RoutingError the relay parks the row with."""
    fdp = atheris.FuzzedDataProvider(data)
    texts = [fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 300)) for _ in range(4)]
    values: list[object] = [fdp.ConsumeUnicodeNoSurrogates(20), fdp.ConsumeInt(8), None, [1], {"a": 1}, 1.5]
    headers = {
        fdp.ConsumeUnicodeNoSurrogates(10): fdp.PickValueInList(values)
        for _ in range(fdp.ConsumeIntInRange(0, 4))
    }
    row = OutboxRow(
        1, "e", texts[0], texts[1], texts[2], "{}", None, headers or None, texts[3] or None, 0, 0.0, 10
    )
    template = fdp.PickValueInList(["outbox.event.{aggregate_type}", "svc.{aggregate_type}.{event_type}"])
    try:
        topic = topic_for(row, template)
        assert check_topic_name(topic) == topic
        to_message(row, topic, "eventType")
    except RoutingError:
        pass


def secrets(data: bytes) -> None:
    """Whatever a password holds, masking never shows it: in a URL, in libpq's keyword form, quoted in an
    error message; nor a PEM block's body."""
    fdp = atheris.FuzzedDataProvider(data)
    password = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(6, 40))
    if len(password.strip()) < 6:
        return
    url = f"postgresql://app:{password}@db.example:5432/x?sslmode=require"
    assert password not in redact("POSTBOX_DATABASE_URL", url), url
    assert password not in scrub(f'invalid URI query parameter: "{url}"', password)
    pem = f"-----BEGIN PRIVATE KEY-----\n{password}\n-----END PRIVATE KEY-----"
    assert password not in redact("anything", f"tls {pem} end")
    redact(fdp.ConsumeUnicodeNoSurrogates(30), fdp.ConsumeUnicodeNoSurrogates(fdp.remaining_bytes()))


TARGETS: dict[str, Callable[[bytes], None]] = {
    "stripe": stripe,
    "shopify": shopify,
    "marqeta": marqeta,
    "generic": generic,
    "message_id": message_id,
    "outbox_row": outbox_row,
    "settings": settings,
    "relay_row": relay_row,
    "secrets": secrets,
}
