"""Tenants of one fleet: who may call the API, in which priority class, within which quotas, and
what each one used (`config.py`, `quotas.py`, `usage.py`)."""
