"""The REST API of the store: Agent Lightning 0.3's wire protocol under /v1/agl/, OTLP span
ingest under /v1/traces, key authentication, and a few documented extensions."""
