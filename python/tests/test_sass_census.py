"""bench/sass_census.py without a GPU: the control words of real SASS decoded, and the census of a
real NVRTC build disassembled by pip's cuobjdump / nvdisasm (nvidia-cuda-cuobjdump,
nvidia-cuda-nvdisasm, which scripts/test.sh installs; skipped when missing, failed instead with
KSEARCH_REQUIRE_NVRTC=1).

    cd python && python -m pytest -q tests/test_sass_census.py
"""
import os
import shutil
import sys

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import sass_census as sc  # noqa: E402

# Two instructions as cuobjdump prints them (sm_90): a MUFU that sets write scoreboard 1 and stalls
# 1 cycle, then an FMUL that waits on scoreboard 1 and stalls 4.
SNIPPET = """
        /*0100*/                   MUFU.EX2 R4, R4 ;                                            /* 0x0000000400047308 */
                                                                                                /* 0x000e620000000800 */
        /*0110*/                   FMUL R5, R4, R4 ;                                            /* 0x0000000404057220 */
                                                                                                /* 0x002fc80000400000 */
"""


def test_control_words_decode_stall_scoreboards_and_wait_mask():
    a, b = sc.parse(SNIPPET)
    assert (a["addr"], a["text"]) == (0x100, "MUFU.EX2 R4, R4")
    # 0x000e62...: stall 1 (and yield), write scoreboard 1, read scoreboard none (7), no wait
    assert (a["stall"], a["wb"], a["rb"], a["wait"]) == (1, 1, 7, 0)
    # 0x002fc8...: stall 4, no scoreboards set, waits on scoreboard 1
    assert (b["stall"], b["wb"], b["rb"], b["wait"]) == (4, 7, 7, 0b10)
    # one warp: the FMUL issues once the MUFU's result is ready (18 cycles), then stalls 4
    assert sc.schedule([a, b]) == 18 + 4


def _tools():
    try:
        return sc.tool("cuobjdump"), sc.tool("nvdisasm")
    except SystemExit:
        return None


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    have_nvrtc = any(
        os.path.exists(os.path.join(d, "libnvrtc.so.13")) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d
    )
    found = _tools()
    if found is None or not have_nvrtc:
        if os.environ.get("KSEARCH_REQUIRE_NVRTC") == "1":
            pytest.fail("cuobjdump / nvdisasm or NVRTC from pip not found and KSEARCH_REQUIRE_NVRTC=1")
        pytest.skip("cuobjdump / nvdisasm or NVRTC from pip not found")
    os.environ["KS_CUBIN_DIR"] = str(tmp_path_factory.mktemp("cubins"))
    return found


def test_census_of_warp_scan_sees_one_shuffle_less_per_state_with_cq(tools):
    base = sc.census("mamba_scan", "warp_scan", "", "K*NS")
    cq = sc.census("mamba_scan", "warp_scan", "CQ=1", "K*NS")
    # the hot block is the unrolled chunk: K * NS = 128 exponentials per lane
    assert base["mix"]["MUFU"] == 128 and cq["mix"]["MUFU"] == 128
    assert base["units"] == 128.0
    assert base["regs"] <= 128 and base["local"] == 0
    # per state: 5 scan rounds of two shuffles, then two (the map before) or one (the end state before)
    assert base["mix"]["SHFL"] == 16 * 12
    assert cq["mix"]["SHFL"] == 16 * 11
    # and one multiply more per step and state (Cm times the decay product)
    assert cq["mix"]["FMUL"] - base["mix"]["FMUL"] == 128
    assert base["sched"] >= base["n"] and base["mio"] >= base["mix"]["SHFL"]


# A tile's loop as ptxas lays it out: S waited on (one group, the PV product, still in flight), two
# exponentials, the wait for everything, one more exponential, then the next products.
WAITS = """
        /*0100*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;                              /* 0x000000000000781b */
                                                                                                /* 0x000fe20000000000 */
        /*0110*/                   MUFU.EX2 R4, R4 ;                                            /* 0x0000000400047308 */
                                                                                                /* 0x000e620000000800 */
        /*0120*/                   MUFU.EX2 R5, R5 ;                                            /* 0x0000000500057308 */
                                                                                                /* 0x000e620000000800 */
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                              /* 0x000000000000781b */
                                                                                                /* 0x000fe20000000000 */
        /*0140*/                   MUFU.EX2 R6, R6 ;                                            /* 0x0000000600067308 */
                                                                                                /* 0x000e620000000800 */
        /*0150*/                   HGMMA.64x128x16.F32 R24, gdesc[UR16], RZ, !UPT ;             /* 0x0000000010187df0 */
                                                                                                /* 0x000fe20008000818 */
"""


def test_pv_waits_counts_exponentials_on_each_side_of_the_wait_for_the_product_in_flight():
    assert sc.pv_waits(sc.parse(WAITS)) == [(2, 1)]


def test_pv_waits_of_flash_ws_sees_every_exponential_of_each_tile_width(tools):
    # The shipped build holds the loop three times (128-key tiles, and 176 / 160 without the mask for
    # ragged L): each tile's softmax issues BN / 2 exponentials a thread and two rescale factors,
    # before or after the wait for the PV product (ptxas decides; bench/README.md has what each cost).
    # PM (the default, 128-key tiles only) holds that softmax twice in the loop: against the running
    # maxima (64, and two factors on its scaling path) and the plain one it falls back to (66), all
    # of them ahead of the wait.
    waits = sc.census("attention", "flash_ws", "", "")["pv_waits"]
    assert sorted(b + a for b, a in waits) == [82, 90, 132], waits
    assert (132, 0) in waits, waits
    # At PM 0 the 128-key loop's 66, all after the wait.
    waits = sc.census("attention", "flash_ws", "PM=0", "")["pv_waits"]
    assert sorted(b + a for b, a in waits) == [66, 82, 90], waits
    assert (0, 66) in waits, waits
