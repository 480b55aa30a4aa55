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


def test_flash_ws_softmax_runs_before_the_wait_for_its_pv_product_with_ms(tools):
    # MS 1: each copy of the loop body (masked and plain tiles) issues all 66 exponentials of a
    # 128-key tile (64 probabilities, two rescale factors) before it waits for the PV product of the
    # tile before, so the softmax overlaps that product. With one body (MS 0) ptxas put the wait at the
    # top of the block after the masking branch, before every exponential.
    ms = sc.census("attention", "flash_ws", "MS=1,WIDE=0", "")["pv_waits"]
    assert ms == [(66, 0), (66, 0)], ms
    one = sc.census("attention", "flash_ws", "MS=0,WIDE=0", "")["pv_waits"]
    assert len(one) == 1 and one[0][0] < 66, one
