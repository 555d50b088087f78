"""`mesp bench budget`'s mesp-budget variant: the planner keeps every tape under its generous
budget, and the measured step holds them (exact peak above plain mesp's), on the meta device."""

from __future__ import annotations

from dataclasses import replace

from mesp.bench.child import measure
from mesp.bench.tables import QUICK, TABLES, VARIANTS
from mesp.bench.variants import ChildConfig


def test_budget_variant_keeps_every_tape() -> None:
    assert TABLES["budget"].variants == ("bp", "mesp", "mesp-budget")
    assert QUICK["budget"].shapes == ("tiny-qwen2",)
    base = ChildConfig(
        variant="mesp", shape="tiny-qwen2", seq=64, dtype="float32", steps=1, device="meta",
        **VARIANTS["mesp"],
    )  # fmt: skip
    plain = measure(base)
    kept = measure(replace(base, variant="mesp-budget", **VARIANTS["mesp-budget"]))
    assert plain["kept_tapes"] is None and kept["kept_tapes"] == 2  # both of tiny-qwen2's blocks
    assert kept["exact"]["working"] > plain["exact"]["working"]
