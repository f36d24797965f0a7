"""postbox inbox: effectively-once consumption of Kafka topics and provider webhooks into PostgreSQL."""
