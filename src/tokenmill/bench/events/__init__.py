"""The KV event plane: synthetic publishers over NATS or ZeroMQ into a consumer."""
