"""The tenants file's checks, and each quota's arithmetic on a clock the test moves."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.tenants.config import Quotas, load_tenants
from tokenmill.tenants.quotas import QuotaGate

GOOD = """
[tenants.assistant]
keys = ["k-assistant", "k-assistant-2"]
class = "interactive"
weight = 2.5

[tenants.sweeps]
keys = ["k-sweeps"]
class = "batch"
requests_per_s = 20
tokens_per_min = 60000
max_concurrent = 4

[tenants.plain]
keys = ["k-plain"]
"""


def test_a_good_file_gives_each_tenant_its_keys_class_weight_and_quotas(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    tenants = load_tenants(path)
    assert [t.name for t in tenants.tenants] == ["assistant", "sweeps", "plain"]
    assistant, sweeps, plain = tenants.tenants
    assert tenants.by_key("k-assistant-2") is assistant and tenants.by_key("k-sweeps") is sweeps
    assert tenants.by_key("k-nobody") is None and tenants.by_key("") is None
    assert (assistant.priority_class, assistant.weight, assistant.quotas) == ("interactive", 2.5, Quotas())
    assert sweeps.quotas == Quotas(requests_per_s=20.0, tokens_per_min=60000, max_concurrent=4)
    assert (plain.priority_class, plain.weight) == ("standard", 1.0)


@pytest.mark.parametrize(("text", "named"), [
    ('[tenants.a]\nkeys = ["k"]\nclass = "gold"', "tenants.a.class: must be one of interactive, standard, batch"),
    ('[tenants.a]\nkeys = []', "tenants.a.keys: must be a list of at least one key"),
    ('[tenants.a]\nkeys = [" k "]', "tenants.a.keys: must be a list of at least one key, each printable ASCII"),
    ('[tenants.a]\nkeys = ["ké"]', "tenants.a.keys"),
    ('[tenants.a]\nkeys = ["k", "k"]', "tenants.a.keys: a key is listed twice"),
    ('[tenants.""]\nkeys = ["k"]', "a tenant needs a name"),
    ('[tenants.a]\nkeys = ["k"]\nweight = 1e-320', "tenants.a.weight: must be between 0.001 and 1e+06"),
    ('[tenants.a]\nclass = "batch"', "tenants.a.keys"),
    ('[tenants.a]\nkeys = ["k", " "]', "tenants.a.keys"),
    ('[tenants.a]\nkeys = ["k"]\n[tenants.b]\nkeys = ["k"]', "tenants.b.keys: a key of tenants.a too"),
    ('[tenants.a]\nkeys = ["k"]\nweight = 0', "tenants.a.weight: must be a number > 0, got 0"),
    ('[tenants.a]\nkeys = ["k"]\ntokens_per_min = 1.5', "tenants.a.tokens_per_min: must be a whole number > 0"),
    ('[tenants.a]\nkeys = ["k"]\nmax_concurrent = true', "tenants.a.max_concurrent"),
    ('[tenants.a]\nkeys = ["k"]\nrequests_per_s = -1', "tenants.a.requests_per_s: must be a number > 0"),
    ('[tenants.a]\nkeys = ["k"]\npriority = "high"', "tenants.a.priority: unknown field"),
    ('[tenant.a]\nkeys = ["k"]', "tenant: unknown table"),
    ("", "tenants: no tenant"),
    ("tenants = 3", "tenants: no tenant"),
    ("[tenants.a", "not TOML"),
])
def test_a_bad_file_is_refused_naming_the_field(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="--tenants .*tenants.toml: ") as caught:
        load_tenants(path)
    assert named in str(caught.value)


def test_a_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tenants .*absent.toml: cannot read it"):
        load_tenants(tmp_path / "absent.toml")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_second_refill_and_a_refusal_takes_nothing() -> None:
    clock = Clock()
    gate = QuotaGate("t", Quotas(requests_per_s=2), clock)
    assert gate.admit() is None and gate.admit() is None
    refusal = gate.admit()
    assert refusal is not None and refusal.quota == "requests_per_s" and refusal.retry_after_s == pytest.approx(0.5)
    assert "tenant 't' is over its requests_per_s quota (2" in refusal.message
    clock.now += 0.25
    assert gate.admit() is not None  # half a request refilled: still refused, and nothing taken
    clock.now += 0.25
    assert gate.admit() is None and gate.in_flight == 3


def test_tokens_per_minute_lets_one_request_into_debt_and_the_next_waits_it_out() -> None:
    clock = Clock()
    gate = QuotaGate("t", Quotas(tokens_per_min=60), clock)  # a token a second
    assert gate.admit() is None
    gate.charge(90)  # 30 over
    refusal = gate.admit()
    assert refusal is not None and refusal.quota == "tokens_per_min" and refusal.retry_after_s == pytest.approx(30)
    clock.now += 30
    assert gate.admit() is None


def test_max_concurrent_frees_a_slot_when_a_request_ends() -> None:
    gate = QuotaGate("t", Quotas(max_concurrent=2), Clock())
    assert gate.admit() is None and gate.admit() is None
    refusal = gate.admit()
    assert refusal is not None and refusal.quota == "max_concurrent" and refusal.retry_after_s == 1.0
    gate.release()
    assert gate.admit() is None and gate.in_flight == 2
