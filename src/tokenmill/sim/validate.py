"""`tokenmill sim validate`: accounting, silicon (held-out) and published-figure cases in one table."""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from tokenmill.sim.accounting import active_params, kv_bytes_per_token, total_params
from tokenmill.sim.fit import ErrorSummary, fit_all, fit_ttft_by_model, summarise
from tokenmill.sim.models import get_model
from tokenmill.sim.paths import silicon_csv
from tokenmill.sim.published import Case, published_cases
from tokenmill.sim.silicon import SiliconRow, load_silicon
from tokenmill.sim.tuning import FITTED_FILE, TTFT_FIELDS, Tuning, load_fitted

log = logging.getLogger(__name__)
TPOT_TARGET, TTFT_TARGET = 0.15, 0.25
ACCOUNTING_TOLERANCE = 0.01
# (model, total params B, active params B or None, BF16 KV KiB per token or None) from the issue.
# Models whose vendor's "activated" figure leaves the input-embedding lookup out and counts the MTP
# module the figure was stated with (see `active_params`).
ACTIVE_DEEPSEEK_CONVENTION = ("deepseek-r1",)
ACCOUNTING_TARGETS: tuple[tuple[str, float, float | None, float | None], ...] = (
    ("deepseek-r1", 671.0, 37.0, 68.6), ("llama-3.1-70b", 70.6, None, 320.0),
    ("qwen3-235b-a22b", 235.0, 22.0, 188.0), ("qwen3-30b-a3b", 30.5, 3.3, None), ("mixtral-8x7b", 46.7, 12.9, None),
)


def accounting_cases() -> list[Case]:
    cases = []
    for name, total, active, kv_kib in ACCOUNTING_TARGETS:
        m = get_model(name)
        src = "issue 7 accounting targets (model cards)"
        cases.append(Case("accounting", f"{name} total params (B)", total_params(m) / 1e9, total, ACCOUNTING_TOLERANCE, src))
        if active is not None:
            # Published active counts are rounded to two digits (37 B, 3.3 B); the 1% band is kept as
            # stated, and a second case checks the count rounds to the figure at its published precision.
            deepseek = name in ACTIVE_DEEPSEEK_CONVENTION
            value = active_params(m, input_embedding=not deepseek, mtp=deepseek) / 1e9
            label = f"{name} active params{' incl. MTP module' if deepseek else ''} (B)"
            cases.append(Case("accounting", label, value, active, ACCOUNTING_TOLERANCE, src))
            cases.append(Case("accounting", f"{name} active params rounds to published", value, active, 0.0, src, "rounds_to"))
        if kv_kib is not None:
            cases.append(Case("accounting", f"{name} KV KiB/token BF16", kv_bytes_per_token(m, 2.0) / 1024, kv_kib,
                              ACCOUNTING_TOLERANCE, src))
    return cases


@dataclass(slots=True)
class ValidationResult:
    cases: list[Case]
    silicon_total: int
    covered: int
    train_rows: int
    held_out: ErrorSummary
    by_mode: dict[str, ErrorSummary]
    excluded: dict[str, int]

    def to_json(self) -> dict:
        return {"cases": [asdict(c) | {"error": c.error, "passed": c.passed} for c in self.cases],
                "silicon": {"total_rows": self.silicon_total, "covered_rows": self.covered, "train_rows": self.train_rows,
                            "held_out": asdict(self.held_out), "held_out_by_mode": {k: asdict(v) for k, v in self.by_mode.items()},
                            "excluded": self.excluded}}


def silicon_cases(held: ErrorSummary) -> list[Case]:
    src = "silicon_measured.csv held-out half"
    return [Case("silicon", f"TPOT median |err| ({held.rows} held-out rows)", held.tpot_median_abs, TPOT_TARGET, 0.0, src, "at_most"),
            Case("silicon", f"TTFT median |err| ({held.rows} held-out rows)", held.ttft_median_abs, TTFT_TARGET, 0.0, src, "at_most")]


def _refit(train: list[SiliconRow], out: Path | None, scope: str = "all") -> dict[str, Tuning]:
    stored = load_fitted()
    if scope == "ttft":
        backends = {k: v for k, v in stored.items() if "/" not in k}
        fitted = backends | fit_ttft_by_model(train, backends)
    elif scope == "all":
        fitted = fit_all(train, start=stored)
    else:
        raise ValueError(f"validate: field refit must be 'all' or 'ttft', not {scope!r}")
    path = out or Path(str(resources.files("tokenmill.sim").joinpath(FITTED_FILE)))
    body = {"_comment": "Written by `tokenmill sim validate --refit`: per-backend Tuning fitted on the training half "
                        "(crc32(id) % 10 < 5) of silicon_measured.csv, and per backend/model the TTFT-only fields "
                        "refitted on that pair's aggregated training rows; held-out rows are never used here.",
            "backends": {k: v.to_dict() for k, v in fitted.items() if "/" not in k},
            "models": {k: {f: getattr(v, f) for f in TTFT_FIELDS} for k, v in fitted.items() if "/" in k}}
    Path(path).write_text(json.dumps(body, indent=1) + "\n")
    log.info("wrote fitted tunings to %s", path)
    return fitted


def run_validation(data: str | None = None, refit: str | None = None, fitted_out: Path | None = None,
                   include_slow: bool = True) -> ValidationResult:
    silicon = load_silicon(silicon_csv(data))
    train = [r for r in silicon.rows if not r.held_out]
    test = [r for r in silicon.rows if r.held_out]
    fitted = _refit(train, fitted_out, refit) if refit else load_fitted()
    held = summarise(test, fitted)
    by_mode = {mode: summarise([r for r in test if r.mode == mode], fitted) for mode in ("agg", "disagg")}
    cases = accounting_cases() + silicon_cases(held) + published_cases(include_slow)
    return ValidationResult(cases=cases, silicon_total=silicon.total, covered=len(silicon.rows), train_rows=len(train),
                            held_out=held, by_mode=by_mode, excluded=dict(silicon.excluded))


def print_validation(result: ValidationResult) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tokenmill sim validate")
    for col in ("group", "case", "value", "target", "error", "tolerance", "pass"):
        table.add_column(col, justify="right" if col not in ("group", "case") else "left")
    for c in result.cases:
        tol = {"above": "> target", "at_most": "<= target", "rounds_to": "as published"}.get(c.check, f"±{c.tolerance:.0%}")
        err = f"{c.error:+.1%}" if c.check == "within" else ""
        table.add_row(c.group, c.name, f"{c.value:.3f}", f"{c.target:.3f}", err, tol, "PASS" if c.passed else "FAIL")
    console = Console()
    console.print(table)
    console.print(f"silicon rows: {result.silicon_total} total, {result.covered} covered "
                  f"({result.train_rows} train / {result.held_out.rows} held out); excluded: {result.excluded}")
    for mode, s in result.by_mode.items():
        console.print(f"  held-out {mode}: {s.rows} rows, TPOT median |err| {s.tpot_median_abs:.1%}, "
                      f"TTFT median |err| {s.ttft_median_abs:.1%}")
    passed = sum(c.passed for c in result.cases)
    console.print(f"{passed}/{len(result.cases)} cases pass")
