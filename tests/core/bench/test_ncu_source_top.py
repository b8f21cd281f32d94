"""``scripts/ncu_source_top.py``: ncu's per-instruction stall samples, summed by reason and
ranked by instruction, from the CSV that ``ncu --page source --csv`` prints."""

from __future__ import annotations

import csv
import gzip

from script_module import load

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "stall_barrier", "stall_long_sb",
          "stall_selected", "stall_barrier (Not Issued)"]  # fmt: skip


def test_samples_are_summed_by_reason_and_ranked_by_instruction(tmp_path):
    path = tmp_path / "source.csv.gz"
    with gzip.open(path, "wt", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Kernel Name", "_decode_fp8_mma_kernel"])
        out.writerow(HEADER)
        out.writerow(["0x7f00000010", "  BAR.SYNC 0x0", "10", "9", "9", "0", "1", "9"])
        out.writerow(
            ["0x7f00000020", "  SHF.R.S32.HI R62, RZ, 0x1f, R113", "30", "29", "0", "29", "1", "0"]
        )
        out.writerow(["0x7f00000030", "  EXIT", "", "", "", "", "", ""])  # no samples
    ncu = load("ncu_source_top")
    header, rows = ncu.read(str(path))
    assert header == HEADER and len(rows) == 3
    lines = ncu.summary(header, rows, top=2)
    assert lines[0] == "40 samples"
    # reasons by count (the "(Not Issued)" columns are not reasons of their own)
    assert lines[1].split()[:2] == ["stall_long_sb", "29"]
    assert lines[2].split()[:2] == ["stall_barrier", "9"]
    assert not any("Not Issued" in line for line in lines)
    # the instruction with the most samples first, its share and its main reason
    assert "SHF.R.S32.HI" in lines[4] and "75.0%" in lines[4] and "'long_sb': 29" in lines[4]
    assert "BAR.SYNC" in lines[5] and "'barrier': 9" in lines[5]
    assert len(lines) == 6  # top=2
