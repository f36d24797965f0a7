import base64
import contextlib
import hashlib
import hmac
import json
import time

import pytest
import stripe
from hypothesis import given, settings
from hypothesis import strategies as st

from postbox.inbox.webhooks.config import providers_from_env
from postbox.inbox.webhooks.providers import (
    GenericHmac,
    MalformedWebhook,
    Marqeta,
    Shopify,
    SignatureError,
    Stripe,
    stripe_event,
    stripe_signature_header,
)

SECRET = "whsec_test_secret"
EVENT = {"id": "evt_1", "type": "invoice.paid", "data": {"object": {"id": "in_1", "amount_paid": 500}}}
BODY = json.dumps(EVENT).encode()
NOW = 1_800_000_000


def test_our_stripe_header_passes_the_official_library_and_theirs_passes_ours() -> None:
    header = stripe_signature_header(SECRET, BODY, int(time.time()))
    assert stripe.Webhook.construct_event(BODY.decode(), header, SECRET).id == "evt_1"
    scheme = stripe.WebhookSignature.EXPECTED_SCHEME
    theirs = f"t={NOW},{scheme}=" + stripe.WebhookSignature._compute_signature(
        f"{NOW}.{BODY.decode()}", SECRET
    )
    Stripe((SECRET,)).verify({"stripe-signature": theirs}, BODY, NOW)


def test_stripe_rotation_several_signatures_and_several_secrets() -> None:
    header = stripe_signature_header("whsec_new", BODY, NOW) + ",v1=" + "00" * 32 + ",v0=ignored"
    Stripe(("whsec_old", "whsec_new")).verify({"stripe-signature": header}, BODY, NOW)
    with pytest.raises(SignatureError, match="no Stripe v1 signature matches"):
        Stripe(("whsec_old",)).verify({"stripe-signature": header}, BODY, NOW)


@pytest.mark.parametrize(
    ("body", "now", "message"),
    [
        (BODY + b" ", NOW, "no Stripe v1 signature matches"),
        (BODY, NOW + 301, "outside the 300s tolerance"),
        (BODY, NOW - 301, "outside the 300s tolerance"),
    ],
)
def test_stripe_refuses_tampered_bodies_and_stale_timestamps(body: bytes, now: int, message: str) -> None:
    header = stripe_signature_header(SECRET, BODY, NOW)
    with pytest.raises(SignatureError, match=message):
        Stripe((SECRET,)).verify({"stripe-signature": header}, body, now)


def test_stripe_twin_key_is_the_same_change_of_the_same_object() -> None:
    twin = {**EVENT, "id": "evt_2"}
    later = {**EVENT, "id": "evt_3", "data": {"object": {"id": "in_1", "amount_paid": 700}}}
    assert stripe_event(EVENT).twin_key == stripe_event(twin).twin_key
    assert stripe_event(EVENT).twin_key != stripe_event(later).twin_key
    assert stripe_event(EVENT).twin_key.startswith("invoice.paid:in_1:")  # type: ignore[union-attr]
    with pytest.raises(MalformedWebhook):
        stripe_event({"type": "x"})


def shopify_headers(body: bytes, secret: str = "shpss") -> dict[str, str]:
    digest = base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest()).decode()
    return {
        "x-shopify-hmac-sha256": digest,
        "x-shopify-webhook-id": "wh-1",
        "x-shopify-topic": "orders/create",
        "x-shopify-event-id": "ev-9",
        "x-shopify-shop-domain": "s.myshopify.com",
    }


def test_shopify_dedups_on_the_webhook_id_not_the_event_id() -> None:
    body = b'{"id": 1001}'
    provider = Shopify(("shpss",))
    provider.verify(shopify_headers(body), body, NOW)
    [event] = provider.events(shopify_headers(body), body)
    assert (event.event_id, event.event_type) == ("wh-1", "orders/create")
    assert event.headers["x-shopify-event-id"] == "ev-9"
    with pytest.raises(SignatureError):
        provider.verify(shopify_headers(body), body + b" ", NOW)


def marqeta_headers(body: bytes, algorithm: str = "sha256", password: str = "pw") -> dict[str, str]:
    auth = base64.b64encode(f"mq:{password}".encode()).decode()
    return {
        "authorization": f"Basic {auth}",
        "x-marqeta-signature": hmac.new(b"mqsecret", body, algorithm).hexdigest(),
    }


def test_marqeta_needs_basic_auth_and_a_matching_signature_in_either_algorithm() -> None:
    body = b'{"transactions": [{"token": "t1", "type": "authorization"}]}'
    provider = Marqeta("mq", "pw", "mqsecret")
    for algorithm in ("sha256", "sha1"):
        provider.verify(marqeta_headers(body, algorithm), body, NOW)
    with pytest.raises(SignatureError, match="Basic Authentication"):
        provider.verify(marqeta_headers(body, password="wrong"), body, NOW)
    with pytest.raises(SignatureError, match="does not match"):
        provider.verify(marqeta_headers(body), body + b"x", NOW)


def test_marqeta_batches_are_split_per_notification_and_pings_store_nothing() -> None:
    body = json.dumps(
        {
            "transactions": [
                {"token": "t1", "type": "authorization"},
                {"token": "t2"},
                {"token": "t1", "type": "authorization"},
            ]
        }
    ).encode()
    events = Marqeta("mq", "pw").events({}, body)
    assert [(e.event_id, e.event_type) for e in events] == [
        ("transactions:t1", "transactions.authorization"),
        ("transactions:t2", "transactions"),
        ("transactions:t1", "transactions.authorization"),
    ]
    assert (
        Marqeta("mq", "pw").events({}, b'{"pings": [{"token": "marqeta", "payload": "healthcheck"}]}') == []
    )
    with pytest.raises(MalformedWebhook, match="no token"):
        Marqeta("mq", "pw").events({}, b'{"transactions": [{"type": "x"}]}')


def test_generic_hmac_hex_with_prefix_and_base64() -> None:
    body = b'{"type": "thing.happened", "id": "x1"}'
    signature = hmac.new(b"s", body, hashlib.sha256)
    hex_provider = GenericHmac("acme", ("s",), id_from="payload:id")
    hex_provider.verify({"x-signature": "sha256=" + signature.hexdigest()}, body, NOW)
    assert hex_provider.events({}, body)[0].event_id == "x1"
    b64 = GenericHmac("acme", ("s",), signature_header="X-Sig", encoding="base64")
    b64.verify({"x-sig": base64.b64encode(signature.digest()).decode()}, body, NOW)
    with pytest.raises(MalformedWebhook, match="header:x-event-id is missing"):
        b64.events({}, body)


def test_configuration_names_the_variable_and_reads_mounted_files(tmp_path: object) -> None:
    from pathlib import Path  # noqa: PLC0415

    secret_file = Path(str(tmp_path)) / "stripe"
    secret_file.write_text("whsec_a\nwhsec_b\n")
    providers = providers_from_env({"POSTBOX_WEBHOOK_STRIPE_SECRETS_FILE": str(secret_file)})
    assert providers["stripe"].secrets == ("whsec_a", "whsec_b")  # type: ignore[attr-defined]
    with pytest.raises(
        ValueError, match=r"\(POSTBOX_WEBHOOK_MARQETA_PASSWORD\): required with --marqeta-user"
    ):
        providers_from_env({"POSTBOX_WEBHOOK_MARQETA_USERNAME": "u"})
    # The earlier names work for one more release (config check and the daemon log the deprecation).
    assert set(providers_from_env({"POSTBOX_STRIPE_SECRETS": "whsec_a", "POSTBOX_SHOPIFY_SECRETS": "s"})) == {
        "stripe",
        "shopify",
    }
    with pytest.raises(ValueError, match="POSTBOX_WEBHOOK_ACME_"):
        providers_from_env(
            {
                "POSTBOX_WEBHOOK_GENERIC": "acme",
                "POSTBOX_WEBHOOK_ACME_SECRETS": "s",
                "POSTBOX_WEBHOOK_ACME_ENCODING": "rot13",
            }
        )
    with pytest.raises(ValueError, match="no webhook provider is configured"):
        providers_from_env({})
    with pytest.raises(ValueError, match="cannot read it"):
        providers_from_env({"POSTBOX_WEBHOOK_SHOPIFY_SECRETS_FILE": "/nonexistent/secret"})


PROVIDERS = [
    Stripe((SECRET,)),
    Shopify(("shpss",)),
    Marqeta("mq", "pw", "mqsecret"),
    GenericHmac("g", ("s",)),
]
header_names = st.sampled_from(
    [
        "stripe-signature",
        "x-shopify-hmac-sha256",
        "authorization",
        "x-marqeta-signature",
        "x-signature",
        "x-shopify-webhook-id",
        "x-shopify-topic",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    body=st.binary(max_size=2000),
    headers=st.dictionaries(header_names, st.text(max_size=120)),
    provider=st.sampled_from(PROVIDERS),
)
def test_fuzzed_requests_only_ever_fail_verification_or_parsing_cleanly(
    body: bytes, headers: dict[str, str], provider: object
) -> None:
    with pytest.raises(SignatureError):
        provider.verify(headers, body, NOW)  # type: ignore[attr-defined]
    # Garbage may be refused, but only as MalformedWebhook (a 400), never as a crash (a 500).
    with contextlib.suppress(MalformedWebhook):
        provider.events(headers, body)  # type: ignore[attr-defined]


# Found by the atheris targets (tests/fuzz): each escaped as an exception the callers do not expect.


def test_a_deeply_nested_body_is_malformed_not_a_crash() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(MalformedWebhook, match="nested too deeply"):
        Stripe(("whsec_x",)).events({}, deep)


def test_a_unicode_digit_timestamp_is_a_signature_error() -> None:
    with pytest.raises(SignatureError):
        Stripe(("whsec_x",)).verify({"stripe-signature": "t=\u00b2,v1=00"}, b"{}", 0)


def test_a_prefixed_base64_signature_with_padding_verifies() -> None:
    provider = GenericHmac("acme", ("s3cret",), encoding="base64")
    body = b"x"  # its SHA-256 HMAC in base64 ends in "=" padding
    signature = base64.b64encode(hmac.new(b"s3cret", body, hashlib.sha256).digest()).decode()
    assert signature.endswith("=")
    provider.verify({"x-signature": f"sha256={signature}"}, body, 0)
