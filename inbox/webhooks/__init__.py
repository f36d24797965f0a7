"""Provider webhooks into the inbox: verify on the raw body, deduplicate on the provider's documented id,
acknowledge fast, and process later with SKIP LOCKED workers."""
