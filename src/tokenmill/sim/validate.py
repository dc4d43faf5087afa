"""`tokenmill sim validate`: accounting, silicon (held-out) and published-figure cases in one table, each with
its reference's source; the command exits 1 when any case fails."""
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
EXIT_ALL_PASS, EXIT_CHECK_FAILED = 0, 1  # bad input exits 2 (ValueError, in sim/cli.py)
# Models whose vendor's "activated" figure leaves the input-embedding lookup out and counts the MTP
# module the figure was stated with (see `active_params`).
ACTIVE_DEEPSEEK_CONVENTION = ("deepseek-r1",)


@dataclass(slots=True, frozen=True)
class AccountingTarget:
    """One model's reference counts (billions of parameters, BF16 KV KiB per token), each with its source."""

    model: str
    total_b: float
    total_src: str
    active_b: float | None = None
    active_src: str = ""
    kv_kib: float | None = None
    kv_src: str = ""


ACCOUNTING_TARGETS: tuple[AccountingTarget, ...] = (
    AccountingTarget("deepseek-r1", 671.0, "DeepSeek-V3 model card: 671 B main model (685 B with the MTP module)",
                     37.0, "DeepSeek-V3 paper (hyper-parameters, MTP depth 1): 37 B activated per token",
                     68.6, "config.json: 61 layers x (512 latent + 64 rope) values x 2 B = 68.6 KiB"),
    AccountingTarget("llama-3.1-70b", 70.6, "Llama-3.1-70B on Hugging Face: 70.6 B parameters",
                     kv_kib=320.0, kv_src="config.json: 80 layers x 8 KV heads x 128 x (K, V) x 2 B = 320 KiB"),
    AccountingTarget("qwen3-235b-a22b", 235.0, "Qwen3-235B-A22B model card: 235 B total",
                     22.0, "Qwen3-235B-A22B model card: 22 B activated",
                     188.0, "config.json: 94 layers x 4 KV heads x 128 x (K, V) x 2 B = 188 KiB"),
    AccountingTarget("qwen3-30b-a3b", 30.5, "Qwen3-30B-A3B model card: 30.5 B total (29.9 B non-embedding)",
                     3.35, "Qwen3-30B-A3B config.json: 48 x (18.87 M attn + 8 x 4.72 M experts + 0.26 M router) "
                           "+ 2 x 311 M embeddings = 3.353 B (the card's 3.3 B is this truncated)"),
    AccountingTarget("mixtral-8x7b", 46.7, "Mistral AI, Mixtral of experts announcement: 46.7 B total",
                     12.9, "Mistral AI, Mixtral of experts announcement: 12.9 B used per token"),
)


def accounting_cases() -> list[Case]:
    cases = []
    for t in ACCOUNTING_TARGETS:
        m = get_model(t.model)
        cases.append(Case("accounting", f"{t.model} total params (B)", total_params(m) / 1e9, t.total_b,
                          ACCOUNTING_TOLERANCE, t.total_src))
        if t.active_b is not None:
            cases += _active_cases(t)
        if t.kv_kib is not None:
            cases.append(Case("accounting", f"{t.model} KV KiB/token BF16", kv_bytes_per_token(m, 2.0) / 1024, t.kv_kib,
                              ACCOUNTING_TOLERANCE, t.kv_src))
    return cases


def _active_cases(t: AccountingTarget) -> list[Case]:
    """Reference active counts are stated to two or three digits (37 B, 3.35 B): the 1% band is kept, and a
    second case checks the count rounds to the reference at the precision it is stated with."""
    m = get_model(t.model)
    deepseek = t.model in ACTIVE_DEEPSEEK_CONVENTION
    value = active_params(m, input_embedding=not deepseek, mtp=deepseek) / 1e9
    label = f"{t.model} active params{' incl. MTP module' if deepseek else ''} (B)"
    return [Case("accounting", label, value, t.active_b, ACCOUNTING_TOLERANCE, t.active_src),
            Case("accounting", f"{t.model} active params rounds to reference", value, t.active_b, 0.0, t.active_src,
                 "rounds_to")]


@dataclass(slots=True)
class ValidationResult:
    cases: list[Case]
    silicon_total: int
    covered: int
    train_rows: int
    held_out: ErrorSummary
    by_mode: dict[str, ErrorSummary]
    excluded: dict[str, int]

    @property
    def failed(self) -> list[Case]:
        return [c for c in self.cases if not c.passed]

    @property
    def exit_code(self) -> int:
        """Non-zero when any check fails, so CI and scripts can gate on `sim validate`."""
        return EXIT_CHECK_FAILED if self.failed else EXIT_ALL_PASS

    def to_json(self) -> dict:
        return {"passed": not self.failed, "failed": [c.name for c in self.failed],
                "cases": [asdict(c) | {"error": c.error, "passed": c.passed} for c in self.cases],
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


def _source_refs(cases: list[Case]) -> dict[str, int]:
    """Number each distinct source in order of first use: the table shows the number, the legend the text."""
    refs: dict[str, int] = {}
    for c in cases:
        refs.setdefault(c.source, len(refs) + 1)
    return refs


def print_validation(result: ValidationResult) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    refs = _source_refs(result.cases)
    table = Table(title="tokenmill sim validate")
    table.add_column("group")
    # The case folds rather than ellipsizes (a name cut to "qwen3-30…" says nothing); its [n] points to its source.
    table.add_column(Text("case [source]"), overflow="fold")
    for col in ("value", "target", "error", "tolerance", "pass"):
        table.add_column(col, justify="right")
    for c in result.cases:
        tol = {"above": "> target", "at_most": "<= target", "rounds_to": "as stated"}.get(c.check, f"±{c.tolerance:.0%}")
        err = f"{c.error:+.1%}" if c.check == "within" else ""
        table.add_row(c.group, Text(f"{c.name} [{refs[c.source]}]"), f"{c.value:.3f}", f"{c.target:.3f}", err, tol,
                      "PASS" if c.passed else "FAIL")
    console = Console()
    console.print(table)
    console.print("sources:")
    for text, n in refs.items():
        console.print(f"  [{n}] {text}", markup=False, highlight=False)
    console.print(f"silicon rows: {result.silicon_total} total, {result.covered} covered "
                  f"({result.train_rows} train / {result.held_out.rows} held out); excluded: {result.excluded}")
    for mode, s in result.by_mode.items():
        console.print(f"  held-out {mode}: {s.rows} rows, TPOT median |err| {s.tpot_median_abs:.1%}, "
                      f"TTFT median |err| {s.ttft_median_abs:.1%}")
    console.print(f"{len(result.cases) - len(result.failed)}/{len(result.cases)} cases pass")
    for c in result.failed:
        console.print(f"FAIL: {c.name}", markup=False, highlight=False)
