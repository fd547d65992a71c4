"""The GPU bench's profile summary (tools/gpu/bench_ladder.py `device_time_summary`): where a step's device time
went — compute busy on the timeline (overlapping kernels counted once), copies by direction, idle time."""

from __future__ import annotations

import pytest

from tools.gpu.bench_ladder import device_time_summary


def test_overlapping_kernels_count_once_and_copies_are_split_by_direction():
    events = [
        (0, 400, "void flash_fwd_kernel<...>"),  # attention, 400 µs
        (300, 600, "ampere_bf16_gemm"),  # overlaps the first by 100 µs on another stream
        (100, 350, "Memcpy HtoD (Pinned -> Device)"),
        (500, 900, "Memcpy DtoH (Device -> Pinned)"),
        (950, 1000, "Memset (Device)"),
        (800, 1000, "ampere_bf16_gemm"),
    ]
    s = device_time_summary(events, wall_s=0.0012)
    assert s["compute_busy_s"] == pytest.approx(800e-6)  # [0, 600] ∪ [800, 1000]
    assert s["compute_kernel_s"] == pytest.approx(900e-6)
    assert s["idle_s"] == pytest.approx(400e-6)  # 1200 µs wall, 800 busy
    assert s["attention_kernel_s"] == pytest.approx(400e-6)
    assert (s["copy_htod_s"], s["copy_dtoh_s"]) == (pytest.approx(250e-6), pytest.approx(400e-6))
    assert s["top_kernels"][0] == ["ampere_bf16_gemm", 0.0005]


def test_no_device_events_is_all_idle():
    s = device_time_summary([], wall_s=2.0)
    assert s["compute_busy_s"] == 0 and s["idle_s"] == 2.0 and s["top_kernels"] == []
