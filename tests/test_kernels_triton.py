"""Each Triton kernel against its torch reference: interpreter on CPU, natively on CUDA."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import (
    copy_blocks,
    copy_blocks_ref,
    fill_guard,
    guard_scan,
    paged_decode,
    paged_decode_ref,
    paged_prefill,
    paged_prefill_ref,
    store_kv,
    store_kv_ref,
)
from kvscope.kernels.common import check_attention_inputs
from kvscope.kernels.decode import DecodeConfig, launch_decode
from kvscope.kernels.split import arrival_counters, plan_splits
from tests.kernels_cases import TRITON_TARGETS, make_case, rel_err, use_triton_on

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn

# lens, block_size, slots, q_heads, kv_heads, dim, dtype
DECODE_CASES = [
    pytest.param([1, 15, 17, 40], 8, 8, 4, 2, 16, BF16, id="B4-H4/2-L40-bs8-bf16"),
    pytest.param([1023], 16, 16, 4, 1, 32, FP16, id="B1-H4/1-L1023-bs16-fp16"),
    pytest.param([5, 64, 33], 32, 32, 6, 2, 16, BF16, id="B3-H6/2-L64-bs32-bf16"),
    pytest.param([130, 7], 128, 128, 2, 2, 16, FP16, id="B2-H2/2-L130-bs128-fp16"),
    pytest.param([17, 0, 9], 16, 17, 2, 1, 16, BF16, id="B3-H2/1-L17-bs16-slots17"),
]


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize(
    ("lens", "bs", "slots", "q_heads", "kv_heads", "dim", "dtype"), DECODE_CASES
)
def test_decode_matches_reference(
    monkeypatch, device, lens, bs, slots, q_heads, kv_heads, dim, dtype
):
    case = make_case(lens, bs, kv_heads, dim, dtype, device, slots=slots)
    q = torch.randn(len(lens), q_heads, dim, device=device).to(dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, None, bs)
    want = paged_decode_ref(*args)
    use_triton_on(monkeypatch, device)
    assert rel_err(paged_decode(*args), want) < 1e-2


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize("chunk_blocks", [1, 3, 1000], ids=["split1", "split3", "nosplit"])
@pytest.mark.parametrize(
    ("fused", "kvh_fast", "merge_heads", "stream"),
    [(True, True, 1, 8), (False, False, 1, 8), (False, True, 0, 0), (False, True, 2, 0)],
    ids=["fused-kvhfast", "merge-kernel", "merge-per-kvhead-pipelined", "merge-2heads-pipelined"],
)
def test_decode_split_sizes_agree(
    monkeypatch, device, chunk_blocks, fused, kvh_fast, merge_heads, stream
):
    # GIVEN ragged lengths and splits of 1 block, 3 blocks, or the whole context, merged per
    # query head, per 2 or per kv head's group, K/V streamed into registers or pipelined
    case = make_case([1, 15, 17, 100], 8, 2, 16, BF16, device)
    q = torch.randn(4, 4, 16, device=device, dtype=BF16)
    want = paged_decode_ref(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    use_triton_on(monkeypatch, device)
    a = check_attention_inputs(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, None, None,
        None, None, None, None,
    )  # fmt: skip
    cfg = DecodeConfig(
        tile=16, chunk_blocks=chunk_blocks, fused_merge=fused, kvh_fast=kvh_fast,
        merge_heads=merge_heads, merge_split_tile=2, stream_max_tiles=stream,
    )  # fmt: skip
    for _ in range(2):  # the fused merge's counters must be back at zero for the second launch
        out = torch.full_like(q, float("nan"))
        launch_decode(a, out, cfg)
        # THEN every split size gives the same attention, and every element is written
        assert rel_err(out, want) < 1e-2
    assert int(arrival_counters(q.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize(
    ("max_len", "total"),
    [(None, None), (40, None), (100, 133), (8, 8)],
    ids=["no-hint", "max-too-small", "ragged-hint", "both-too-small"],
)
def test_decode_length_hints_never_change_the_result(monkeypatch, device, max_len, total):
    # GIVEN a ragged batch, a small split plan target, and right or wrong host hints
    case = make_case([3, 100, 17, 64], 8, 2, 16, BF16, device)
    q = torch.randn(4, 4, 16, device=device, dtype=BF16)
    want = paged_decode_ref(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    use_triton_on(monkeypatch, device)
    a = check_attention_inputs(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, None, None,
        None, None, None, None,
    )  # fmt: skip
    out = torch.full_like(q, float("nan"))
    cfg = DecodeConfig(tile=16, ctas_per_sm=2, min_chunk_tokens=16)
    launch_decode(a, out, cfg, max_seq_len=max_len, total_seq_len=total)
    # THEN a hint only shapes the launch: a too-small one means larger splits, not lost keys
    assert rel_err(out, want) < 1e-2
    got = paged_decode(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
        max_seq_len=max_len, total_seq_len=total,
    )  # fmt: skip
    assert rel_err(got, want) < 1e-2


def test_split_plan_sizes_the_grid_exactly():
    cfg = DecodeConfig()
    # uniform batches: about one wave of ctas_per_sm x 132 programs, no idle ones
    assert plan_splits(64, 8, 4096, 64 * 4096, 16, cfg, 132) == (1, 4096)
    assert plan_splits(16, 8, 4096, 16 * 4096, 16, cfg, 132) == (4, 1024)
    splits, chunk = plan_splits(1, 8, 32768, 32768, 16, cfg, 132)
    assert 60 <= splits <= 70 and chunk % 16 == 0 and splits * chunk >= 32768
    # ragged: ~1k-token splits so the longest sequences leave no tail
    splits, chunk = plan_splits(64, 8, 8192, 64 * 4160, 16, cfg, 132)
    assert chunk == 1024 and splits == 8
    assert plan_splits(3, 2, 100, 150, 8, DecodeConfig(chunk_blocks=3), 8) == (5, 24)


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize("f16", [True, False], ids=["fp16-dots", "bf16-dots"])
@pytest.mark.parametrize("chunk_blocks", [0, 1], ids=["auto", "split1"])
def test_decode_fp8_cache_matches_reference(monkeypatch, device, f16, chunk_blocks):
    case = make_case([3, 40, 19], 16, 2, 32, device=device, fp8=True)
    q = torch.randn(3, 4, 32, device=device, dtype=BF16)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    scales = {"k_scale": case.k_scale, "v_scale": torch.tensor(case.v_scale, device=device)}
    want = paged_decode_ref(*args, **scales)
    use_triton_on(monkeypatch, device)
    assert rel_err(paged_decode(*args, **scales), want) < 1e-2
    a = check_attention_inputs(*args, None, None, scales["k_scale"], scales["v_scale"], None, None)
    out = torch.full_like(q, float("nan"))
    launch_decode(a, out, DecodeConfig(fp8_f16=f16, fp8_tile=32, chunk_blocks=chunk_blocks))
    assert rel_err(out, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_decode_head_dims_on_cuda(monkeypatch, dim, dtype):
    case = make_case([1, 300, 4097, 2000], 16, 8, dim, dtype, "cuda")
    q = torch.randn(4, 32, dim, device="cuda", dtype=dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    want = paged_decode_ref(*args)
    use_triton_on(monkeypatch, "cuda")
    assert rel_err(paged_decode(*args), want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("guard", [False, True], ids=["plain", "guard"])
def test_decode_graph_replays_with_many_splits(monkeypatch, guard):
    # GIVEN a 32k sequence (~64 splits merged by the last program) beside short ones,
    # captured once in a CUDA graph
    case = make_case([32768, 5, 4000, 0], 16, 8, 128, BF16, "cuda")
    q = torch.randn(4, 32, 128, device="cuda", dtype=BF16)
    extra = {}
    if guard:
        extra = {
            "block_state": torch.ones(case.num_blocks, dtype=torch.uint8, device="cuda"),
            "errors": torch.zeros(2 + 5 * 16, dtype=torch.int32, device="cuda"),
        }
        extra["errors"][1] = 16
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    use_triton_on(monkeypatch, "cuda")
    hints = {"max_seq_len": 32768, "total_seq_len": 36773}

    def run():
        return paged_decode(*args, **hints, **extra)

    run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    # WHEN replayed with fresh queries
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # THEN each replay is right and every element written
        assert rel_err(out, paged_decode_ref(*args)) < 1e-2
    if guard:
        assert int(extra["errors"][0]) == 0


# lens, new tokens, block_size, q_heads, kv_heads, dtype
PREFILL_CASES = [
    pytest.param([20, 9, 40], [5, 9, 1], 8, 4, 2, BF16, id="B3-H4/2-midblock-bs8-bf16"),
    pytest.param([1023, 17], [21, 0], 16, 2, 1, FP16, id="B2-H2/1-L1023-bs16-fp16"),
    pytest.param([33, 50], [33, 18], 32, 6, 2, BF16, id="B2-H6/2-L50-bs32-bf16"),
]


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize(("lens", "new", "bs", "q_heads", "kv_heads", "dtype"), PREFILL_CASES)
def test_prefill_matches_reference(monkeypatch, device, lens, new, bs, q_heads, kv_heads, dtype):
    case = make_case(lens, bs, kv_heads, 16, dtype, device)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(new), q_heads, 16, device=device).to(dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, qsl.to(device))
    want = paged_prefill_ref(*args)
    use_triton_on(monkeypatch, device)
    assert rel_err(paged_prefill(*args), want) < 1e-2


@pytest.mark.parametrize("device", TRITON_TARGETS)
def test_prefill_fp8_cache_matches_reference(monkeypatch, device):
    case = make_case([30, 12], 8, 2, 16, device=device, fp8=True)
    qsl = torch.tensor([0, 7, 19], dtype=torch.int32, device=device)
    q = torch.randn(19, 4, 16, device=device, dtype=BF16)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, qsl)
    scales = {"k_scale": case.k_scale, "v_scale": case.v_scale}
    want = paged_prefill_ref(*args, **scales)
    use_triton_on(monkeypatch, device)
    assert rel_err(paged_prefill(*args, **scales), want) < 1e-2


STORE_CASES = [
    pytest.param("cpu", BF16, False, id="bf16-interp", marks=TRITON_TARGETS[0].marks),
    # the interpreter rounds float->fp8 wrongly at exponent boundaries: feed it exact values
    pytest.param("cpu", FP8, True, id="fp8-exact-interp", marks=TRITON_TARGETS[0].marks),
    pytest.param("cuda", BF16, False, id="bf16-cuda", marks=TRITON_TARGETS[1].marks),
    pytest.param("cuda", FP8, False, id="fp8-cuda", marks=TRITON_TARGETS[1].marks),
]


@pytest.mark.parametrize(("device", "dtype", "exact"), STORE_CASES)
def test_store_matches_reference(monkeypatch, device, dtype, exact):
    shape = (7, 5, 3, 16)  # odd slots and heads
    k_ref, v_ref = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    key, value = torch.randn(9, 3, 16), torch.randn(9, 3, 16)
    scales = {"k_scale": 0.25, "v_scale": 0.125} if dtype == FP8 else {}
    if exact:
        key = (key * 8).to(FP8).float() * 0.25
        value = (value * 8).to(FP8).float() * 0.125
    key, value = key.to(BF16), value.to(BF16)
    slots = torch.tensor([0, 34, -1, 12, 5, 6, 7, -1, 20])
    store_kv_ref(key, value, k_ref, v_ref, slots, **scales)
    k_out = torch.zeros(shape, dtype=dtype, device=device)
    v_out = torch.zeros(shape, dtype=dtype, device=device)
    use_triton_on(monkeypatch, device)
    store_kv(key.to(device), value.to(device), k_out, v_out, slots.to(device), **scales)
    assert torch.equal(k_out.cpu().view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_out.cpu().view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize("dtype", [FP16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_copy_matches_reference(monkeypatch, device, dtype):
    kv = torch.randn(3, 2, 9, 5, 3, 16).to(dtype)
    fill_guard(kv, [1, 4])
    want = kv.clone()
    src, dst = torch.tensor([1, 4, 8]), torch.tensor([6, 0, 3])
    copy_blocks_ref(want, src, dst)
    got = kv.to(device)
    use_triton_on(monkeypatch, device)
    copy_blocks(got, src.to(device), dst.to(device))
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize("dtype", [BF16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_guard_scan_matches_reference(monkeypatch, device, dtype):
    # GIVEN a pool whose guard slots hold the canary, two scribbled over
    kv = torch.randn(3, 2, 11, 5, 3, 16).to(dtype).to(device)
    fill_guard(kv)
    kv[2, 1, 9, -1, 2, 15] = 1.0
    kv[0, 0, 3, -1, 0, 0] = -2.0
    use_triton_on(monkeypatch, device)
    # WHEN scanned in one pass, whole pool or a subset
    # THEN exactly the scribbled blocks come back
    assert guard_scan(kv) == [3, 9]
    assert guard_scan(kv, torch.tensor([9, 10, 2], device=device)) == [9]
    assert guard_scan(kv, [0, 1]) == []
