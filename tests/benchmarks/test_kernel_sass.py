"""benchmarks/kernel_sass.py: the TurboQuant split kernel compiled offline for sm_90 as the decode loop launches it,
its loops read from the SASS listing (no GPU)."""

import json

import pytest

from benchmarks.kernel_sass import loops, main

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E.64 R2, desc[UR4][R4.64] ;
        /*0020*/              @!P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0040*/               @P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0050*/                   IMAD R1, R2, R3, RZ ;
        /*0060*/                   BRA `(.L_x_2) ;
        /*0070*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0080*/                   EXIT ;
"""


def test_loops_are_the_backward_branches_largest_first():
    """A branch to an earlier label closes a loop (a forward one does not); opcodes count without predicates or
    modifiers."""
    found = loops(LISTING)
    assert [r["instructions"] for r in found] == [4, 2]
    assert found[0]["ops"] == {"LDG": 1, "BAR": 1, "HMMA": 1, "BRA": 1}


def test_every_variant_compiles_without_spills(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "sass.json"
    assert main(["--out", str(out)]) == 0
    rows = json.loads(out.read_text())["variants"]
    gluon = rows.pop("gluon")
    assert set(rows) == {"v00", "v10", "v01"}
    for row in rows.values():
        assert 0 < row["registers"] <= 255 and row["local_bytes"] == 0 and row["shared_bytes"] > 0
        assert len(row["loops"]) >= 2 and row["history_loop"]["ops"]["HMMA"] > 0  # history and window loops
    # the Gluon history kernel gathers its operands straight into the MMA's registers: no shared memory, no barrier
    assert 0 < gluon["registers"] <= 255 and gluon["local_bytes"] == 0 and gluon["shared_bytes"] == 0
    assert gluon["history_loop"]["ops"]["HMMA"] > 0 and "BAR" not in gluon["history_loop"]["ops"]
