"""tools/bench_routing_replay.py on the CPU at a tiny shape: its table's columns, and R3's gap below no replay's.

Why R3's gap must be the smaller one here. The engine samples in bfloat16 and the trainer recomputes in float32, so
every token's ``|trainer - rollout|`` holds the engine's bfloat16 rounding, the same in each row: the rollout
log-probs are one tensor, and the float32 trainer's passes differ only by float32 rounding (~1e-7) on a token whose
routes agree with the engine's. Where the float32 router picks another expert than the bfloat16 one (a flip, counted
by the R2 row), the no-replay trainer computes that token through another expert, a change of the order of the expert
outputs themselves, not of a rounding; R3 computes it through the engine's experts, which leaves the shared bfloat16
rounding alone. So, once some token flips, no replay's maximum gap (a flipped token) exceeds R3's (rounding only),
and its mean does too (the unflipped tokens contribute the same to both). The R2 row records while routing as usual:
its log-probs are no replay's, bitwise, so its gaps print the same.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import bench_routing_replay  # noqa: E402

COLUMNS = [
    "trainer",
    "mean abs gap",
    "p99 abs gap",
    "max abs gap",
    "tokens whose experts differ from the engine's",
]
ROWS = ["no replay", "R2 record (own routes)", "R3 replay"]


def test_cpu_run_of_a_bfloat16_engine_shows_r3_closing_the_flips_gap(capsys):
    # Catches: R3 not replaying the engine's routes in the bench's trainer (its gap would equal no replay's), the
    # flipped share computed over padding or against the trainer's own routes (0%), the R2 pass changing the
    # log-probs it records, and a column renamed or dropped from the table.
    argv = ["--prompts", "8", "--prompt-len", "8", "--new-tokens", "16", "--micro-batch-size", "4"]
    assert bench_routing_replay.main([*argv, "--engine-dtype", "bfloat16"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header, _, *lines = ([cell.strip() for cell in line.strip()[1:-1].split("|")] for line in table)
    assert header == COLUMNS
    rows = {cells[0]: cells[1:] for cells in lines}
    assert list(rows) == ROWS
    none, r2, r3 = (rows[name] for name in ROWS)
    flipped = float(r2[3].rstrip("%")) / 100
    assert 0 < flipped < 1  # the derivation's premise: some token's bfloat16 experts differ from float32's
    assert none[3] == r3[3] == ""  # the flipped share is the R2 row's alone
    assert r2[:3] == none[:3]
    assert float(r3[2]) < float(none[2])  # max
    assert float(r3[0]) < float(none[0])  # mean
