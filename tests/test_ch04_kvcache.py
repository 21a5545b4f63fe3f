"""Chapter 04: the KV pool, the page table and the token pool (minisgl/kvcache/).

References: a plain-torch clone of the pool's buffers updated one row at a time in a Python loop
(for ``store_kv``), and Python loops over requests and positions (for ``pages_to_slots``,
``batch_positions``, ``batch_out_loc`` and ``batch_input_ids``).
Exercises: 4.1 store_kv, 4.2 pages_to_slots, 4.3 batch_row_map (behind batch_out_loc and
batch_input_ids), 4.4 allocate_pages.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minisgl.core import Req
from minisgl.distributed import reset_tp_info, set_tp_info, try_get_tp_info
from minisgl.kvcache import (
    MHAKVCache,
    allocate_pages,
    batch_input_ids,
    batch_out_loc,
    batch_positions,
    batch_row_map,
    create_kvcache_pool,
    create_page_table,
    create_token_pool,
    pages_to_slots,
)

HQ, HKV, D, LAYERS = 4, 2, 8, 3  # a small GQA shape: qkv rows are (4 + 2 + 2) * 8 = 64 wide


@pytest.fixture(scope="module", autouse=True)
def _earlier_chapters_and_tp_info():
    from prereq import require

    require("01")
    previous = try_get_tp_info()
    reset_tp_info()
    set_tp_info(0, 1)  # MHAKVCache reads the tp size to know how many KV heads this rank keeps
    yield
    reset_tp_info()
    if previous is not None:
        set_tp_info(previous.rank, previous.size)


# ----------------------------------------------------------------------------- helpers


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_pool(num_pages: int, ps: int, dtype=torch.float32, seed: int = 0) -> MHAKVCache:
    """A pool whose every slot holds random numbers, so that any stray write shows up."""
    pool = MHAKVCache(HKV, LAYERS, D, num_pages, ps, dtype, "cpu")
    g = gen(seed)
    for layer in range(LAYERS):
        for cache in (pool.k_cache(layer), pool.v_cache(layer)):
            cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    return pool


def snapshot(pool: MHAKVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An independent copy of every layer's K and V, ``[num_pages, ps, Hkv, D]`` each."""
    return [(pool.k_cache(l).clone(), pool.v_cache(l).clone()) for l in range(LAYERS)]


def strided_kv(T: int, dtype=torch.float32, seed: int = 1):
    """k, v as the attention layer hands them over: column slices of one fused qkv tensor."""
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=gen(seed)).to(dtype)
    _, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    assert k.stride(0) == v.stride(0) == (HQ + 2 * HKV) * D  # rows are qkv's rows: strided
    return k, v


def reference_store(ref, k, v, out_loc, layer: int, ps: int) -> None:
    """What store_kv must do, one token at a time: row j -> page s // ps, offset s % ps."""
    for j, s in enumerate(out_loc.tolist()):
        ref[layer][0][s // ps, s % ps] = k[j].reshape(HKV, D)
        ref[layer][1][s // ps, s % ps] = v[j].reshape(HKV, D)


def assert_pool_equals(pool: MHAKVCache, ref, out_loc: torch.Tensor, what: str) -> None:
    """Every slot of every layer must equal the reference; name the first wrong slot."""
    ps = pool.page_size
    written = {s: j for j, s in enumerate(out_loc.tolist())}
    for layer in range(LAYERS):
        for kind, got, want in (("key", pool.k_cache(layer), ref[layer][0]),
                                ("value", pool.v_cache(layer), ref[layer][1])):
            bad = (got != want).flatten(2).any(-1).flatten().nonzero().flatten()  # slot ids
            if len(bad) == 0:
                continue
            s = int(bad[0])
            if s in written:
                why = (f"it should hold row {written[s]} of {kind[0]} (out_loc[{written[s]}] = "
                       f"{s}), reshaped to [Hkv, D]")
            else:
                why = ("no token was sent there (it is not in out_loc), yet it changed: "
                       "store_kv must write the slots in out_loc and nothing else")
            raise AssertionError(
                f"Exercise 4.1 (store_kv), {what}: layer {layer}, slot {s} (page {s // ps}, "
                f"offset {s % ps}) holds the wrong {kind}: {why}. {len(bad)} slot(s) differ.")


def named(exercise: str, fn, *args, **kwargs):
    """Call the learner's function; an error raised inside it names the exercise."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        if exercise in str(e):
            raise
        raise AssertionError(f"{exercise}: {getattr(fn, '__name__', fn)} raised "
                             f"{type(e).__name__} ({e})") from e


def make_req(ids: list[int], row: int, cached: int, uid: int, output_len: int = 4) -> Req:
    return Req(input_ids=torch.tensor(ids, dtype=torch.int32), table_idx=row, cached_len=cached,
               output_len=output_len, uid=uid, sampling_params=None)


def fill_rows(table: torch.Tensor, rows_pages: dict[int, list[int]], ps: int) -> None:
    """Write page-table rows by hand (a Python loop, independent of pages_to_slots)."""
    for row, pages in rows_pages.items():
        for i, page in enumerate(pages):
            for off in range(ps):
                table[row, i * ps + off] = page * ps + off


# ----------------------------------------------------------------------------- the pool


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_store_kv_writes_each_token_into_its_slot_only(ps, index_dtype):
    num_pages = 64 // ps
    pool = random_pool(num_pages, ps, seed=ps)
    ref = snapshot(pool)
    for step, (layer, T) in enumerate([(1, 11), (2, 5), (1, 1)]):  # prefill-ish, then decode-ish
        k, v = strided_kv(T, seed=10 * ps + step)
        out_loc = torch.randperm(num_pages * ps, generator=gen(step))[:T].to(index_dtype)
        named("Exercise 4.1", pool.store_kv, k, v, out_loc, layer)
        reference_store(ref, k, v, out_loc, layer, ps)
        assert_pool_equals(pool, ref, out_loc, f"page_size={ps}, {index_dtype} out_loc, "
                           f"store {step} ({T} token(s) into layer {layer})")


def test_store_kv_keeps_the_pool_dtype():
    ps = 4
    pool = random_pool(8, ps, dtype=torch.bfloat16)
    ref = snapshot(pool)
    k, v = strided_kv(6, dtype=torch.bfloat16)
    out_loc = torch.tensor([31, 0, 5, 4, 17, 12], dtype=torch.int32)
    named("Exercise 4.1", pool.store_kv, k, v, out_loc, 0)
    reference_store(ref, k, v, out_loc, 0, ps)
    assert pool.dtype == torch.bfloat16 and pool.k_cache(0).dtype == torch.bfloat16, (
        f"the pool was built with bfloat16 but holds {pool.k_cache(0).dtype} now: store_kv must "
        "write into the existing buffer, never replace it")
    assert_pool_equals(pool, ref, out_loc, "bfloat16 pool")


def test_dummy_page_absorbs_padding_writes():
    """Engine-style: P real pages + 1 dummy page; padding requests all write the dummy slot."""
    P, ps, max_req = 6, 4, 3
    dummy_slot = P * ps
    pool = random_pool(P + 1, ps, seed=3)  # the Engine builds num_pages + 1 pages
    ref = snapshot(pool)
    table = create_page_table(max_req, 16, dummy_slot=dummy_slot)
    fill_rows(table, {0: [4, 1], 1: [2]}, ps)
    reqs = [make_req(list(range(100, 106)), row=0, cached=5, uid=0),  # decodes position 5
            make_req(list(range(200, 203)), row=1, cached=0, uid=1)]  # prefills positions 0..2
    dummies = [make_req([0], row=max_req, cached=0, uid=-1, output_len=1) for _ in range(3)]
    out_loc = torch.tensor([int(table[r.table_idx, p]) for r in reqs + dummies
                            for p in range(r.cached_len, r.device_len)], dtype=torch.int32)
    assert out_loc[-3:].tolist() == [dummy_slot] * 3, (
        f"create_page_table: the dummy row (row {max_req}) must hold dummy_slot={dummy_slot} in "
        f"every entry, got {table[max_req, :4].tolist()}...")
    k, v = strided_kv(len(out_loc), seed=4)
    named("Exercise 4.1", pool.store_kv, k, v, out_loc, 2)
    real = len(out_loc) - 3
    reference_store(ref, k[:real], v[:real], out_loc[:real], 2, ps)
    # the three padding rows race for one slot: any of them may win, nothing else may change
    got_k = pool.k_cache(2)[P, 0]
    assert any(torch.equal(got_k, k[j].reshape(HKV, D)) for j in range(real, len(out_loc))), (
        f"Exercise 4.1 (store_kv): the dummy slot {dummy_slot} (page {P}, offset 0) should hold "
        "one of the padding requests' keys")
    ref[2][0][P, 0] = got_k
    ref[2][1][P, 0] = pool.v_cache(2)[P, 0]
    assert_pool_equals(pool, ref, out_loc[:real], "two real requests + three padding requests")


def test_k_cache_and_v_cache_are_views_of_the_pool():
    pool = MHAKVCache(HKV, LAYERS, D, 5, 4, torch.float32, "cpu")
    for layer in range(LAYERS):
        for name in ("k_cache", "v_cache"):
            shape = tuple(getattr(pool, name)(layer).shape)
            assert shape == (5, 4, HKV, D), (
                f"pool.{name}({layer}) has shape {shape}, expected [num_pages, page_size, Hkv, D] "
                f"= {(5, 4, HKV, D)}")
    kc, vc = pool.k_cache(2), pool.v_cache(2)  # taken *before* the store
    k, v = strided_kv(2, seed=7)
    named("Exercise 4.1", pool.store_kv, k, v, torch.tensor([9, 0], dtype=torch.int32), 2)
    assert torch.equal(kc[2, 1], k[0].reshape(HKV, D)) and torch.equal(vc[0, 0], v[1].reshape(HKV, D)), (
        "k_cache(2) / v_cache(2) taken before store_kv do not show what it wrote into slots 9 "
        "(page 2, offset 1) and 0: they must be views of the one pool buffer (index it, don't "
        "copy it), and store_kv must write into that buffer (Exercise 4.1)")
    pool.k_cache(0)[3, 2] = 7.0  # and writing through a view changes the pool
    assert bool((pool.k_cache(0)[3, 2] == 7.0).all()), "k_cache(0) returned a copy, not a view"
    assert bool((pool.v_cache(0) == 0).all()), "v_cache(0) shares memory with k_cache(0)"
    assert not bool((pool.k_cache(1) != 0).any()), "writing layer 0 changed layer 1"
    assert (pool.num_layers, pool.dtype, pool.device.type, pool.num_slots) == (
        LAYERS, torch.float32, "cpu", 20), "num_layers / dtype / device / num_slots are wrong"


def test_pool_shards_kv_heads_over_tp_ranks():
    previous = try_get_tp_info()
    reset_tp_info()
    set_tp_info(1, 2)
    try:
        pool = MHAKVCache(4, 1, D, 3, 2, torch.float32, "cpu")
        assert tuple(pool.k_cache(0).shape) == (3, 2, 2, D), (
            "with tp size 2, each rank keeps 4 / 2 = 2 KV heads")
        one = MHAKVCache(1, 1, D, 3, 2, torch.float32, "cpu")  # one KV head: replicated
        assert tuple(one.k_cache(0).shape) == (3, 2, 1, D)
    finally:
        reset_tp_info()
        set_tp_info(previous.rank, previous.size)


def test_create_kvcache_pool_reads_the_model_config():
    cfg = SimpleNamespace(num_kv_heads=3, num_layers=2, head_dim=16)
    pool = create_kvcache_pool(cfg, num_pages=7, page_size=2, dtype=torch.float16, device="cpu")
    assert tuple(pool.k_cache(1).shape) == (7, 2, 3, 16) and pool.dtype == torch.float16
    assert pool.num_layers == 2


# ----------------------------------------------------------------------------- the tables


@pytest.mark.parametrize("max_req,max_len", [(4, 100), (1, 32), (3, 33), (2, 1)])
def test_page_table_and_token_pool_shapes(max_req, max_len):
    width = -(-max_len // 32) * 32
    table = create_page_table(max_req, max_len, dummy_slot=123)
    assert tuple(table.shape) == (max_req + 1, width) and table.dtype == torch.int32, (
        f"create_page_table({max_req}, {max_len}) gave {tuple(table.shape)} {table.dtype}; "
        f"expected [max_running_req + 1, max_seq_len rounded up to 32] = "
        f"{(max_req + 1, width)} int32")
    assert bool((table[max_req] == 123).all()), "the last row (the dummy's) must be all dummy_slot"
    assert not bool(table[:max_req].any()), "the request rows must start at 0"
    pool = create_token_pool(table)
    assert pool.shape == table.shape and pool.dtype == torch.int32 and not bool(pool.any()), (
        "the token pool is a zero int32 tensor shaped like the page table")
    pool[0, 0] = 5
    assert int(table[0, 0]) == 0, "the token pool must not share memory with the page table"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ps", [1, 2, 4, 8, 16])
def test_pages_to_slots_matches_a_loop(ps, dtype):
    pages = torch.randperm(12, generator=gen(ps))[:7].to(dtype)
    want = [p * ps + off for p in pages.tolist() for off in range(ps)]
    got = named("Exercise 4.2", pages_to_slots, pages, ps)
    assert got.dtype == dtype, (
        f"Exercise 4.2 (pages_to_slots): slots keep the dtype of the pages ({dtype}), got "
        f"{got.dtype}; build the offsets with torch.arange(page_size, dtype=pages.dtype)")
    assert got.tolist() == want, (
        f"Exercise 4.2 (pages_to_slots): pages {pages.tolist()} with page_size={ps} should give "
        f"{want} (page p -> p*ps + 0 .. ps-1, page after page), got {got.tolist()}")
    empty = named("Exercise 4.2", pages_to_slots, torch.empty(0, dtype=dtype), ps)
    assert empty.numel() == 0, "Exercise 4.2 (pages_to_slots): no pages should give no slots"


def batch_setup():
    """Three requests in page-table rows 2, 0, 3 (page_size 4), two with a cached prefix."""
    ps, max_req = 4, 4
    table = create_page_table(max_req, 32, dummy_slot=40 * ps)
    pool = create_token_pool(table)
    pages = torch.randperm(40, generator=gen(5)).tolist()
    rows = {2: pages[0:3], 0: pages[3:5], 3: pages[5:8]}
    fill_rows(table, rows, ps)
    g = gen(6)
    reqs = [make_req(torch.randint(3, 1000, (11,), generator=g).tolist(), row=2, cached=6, uid=0),
            make_req(torch.randint(3, 1000, (5,), generator=g).tolist(), row=0, cached=0, uid=1),
            make_req(torch.randint(3, 1000, (9,), generator=g).tolist(), row=3, cached=8, uid=2)]
    for r in reqs:
        pool[r.table_idx, :r.device_len] = r.input_ids
    return table, pool, reqs


def loop_reference(table, pool, reqs):
    pos, loc, ids = [], [], []
    for r in reqs:
        for p in range(r.cached_len, r.device_len):
            pos.append(p)
            loc.append(int(table[r.table_idx, p]))
            ids.append(int(pool[r.table_idx, p]))
    return pos, loc, ids


@pytest.mark.parametrize("phase", ["prefill with cached prefixes", "decode", "padded decode"])
def test_batch_helpers_match_loops(phase):
    table, pool, reqs = batch_setup()
    if phase != "prefill with cached prefixes":
        for r in reqs:  # one forward later: every request computes exactly its newest position
            r.complete_one()
            r.append_host(torch.tensor([77 + r.uid], dtype=torch.int32))
            pool[r.table_idx, r.device_len - 1] = 77 + r.uid
    if phase == "padded decode":  # two padding requests in the dummy row, as the GraphRunner adds
        reqs = reqs + [make_req([0], row=table.shape[0] - 1, cached=0, uid=-1, output_len=1)] * 2
    pos, loc, ids = loop_reference(table, pool, reqs)
    rows = [r.table_idx for r in reqs for _ in range(r.extend_len)]
    got_rows = named("Exercise 4.3", batch_row_map, reqs)
    assert got_rows.dtype == torch.int64 and got_rows.tolist() == rows, (
        f"Exercise 4.3 (batch_row_map), {phase}: each request's table_idx once per new token "
        f"(extend_len times), as int64: expected {rows}, got {got_rows.dtype} {got_rows.tolist()}")

    got_pos = batch_positions(reqs)
    assert got_pos.dtype == torch.int32 and got_pos.tolist() == pos, (
        f"batch_positions ({phase}): expected int32 {pos}, got {got_pos.dtype} {got_pos.tolist()}")
    got_loc = named("Exercise 4.3", batch_out_loc, table, reqs)
    assert not got_loc.dtype.is_floating_point and got_loc.tolist() == loc, (
        f"Exercise 4.3 (batch_out_loc), {phase}: token j must write slot page_table[row of its "
        f"request, its position]; expected {loc}, got {got_loc.tolist()}")
    again = batch_out_loc(table, reqs, positions=got_pos)
    assert again.tolist() == loc, (
        "Exercise 4.3 (batch_out_loc): with positions given explicitly the result changed; use "
        "the positions argument when it is not None")
    got_ids = batch_input_ids(pool, reqs)
    assert got_ids.tolist() == ids, (
        f"batch_input_ids ({phase}): expected {ids}, got {got_ids.tolist()}")


def test_batch_helpers_equal_the_milestone_lines():
    """examples/stage1_milestone.py fills positions and out_loc by hand; the helpers must agree."""
    table, pool, reqs = batch_setup()
    positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs]).int()
    out_loc = torch.cat([table[r.table_idx, r.cached_len:r.device_len] for r in reqs])
    input_ids = torch.cat([r.input_ids[r.cached_len:r.device_len] for r in reqs])
    assert torch.equal(batch_positions(reqs), positions)
    assert torch.equal(batch_out_loc(table, reqs).to(out_loc.dtype), out_loc), (
        "Exercise 4.3 (batch_out_loc) disagrees with the milestone's hand-written out_loc")
    assert torch.equal(batch_input_ids(pool, reqs).to(input_ids.dtype), input_ids)


def test_batch_row_map_reads_table_idx_not_the_position_in_the_batch():
    _table, _pool, reqs = batch_setup()  # rows 2, 0, 3 in batch order; extend_len 5, 5, 1
    want = [r.table_idx for r in reqs for _ in range(r.extend_len)]
    got = named("Exercise 4.3", batch_row_map, reqs)
    assert got.dtype == torch.int64 and got.tolist() == want, (
        f"Exercise 4.3 (batch_row_map): requests in rows 2, 0, 3 with extend_len 5, 5, 1 give "
        f"{want} (table_idx once per new token), got {got.dtype} {got.tolist()}")


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_allocate_pages_grows_a_row_page_by_page(ps):
    table = create_page_table(3, 64, dummy_slot=999)
    free = torch.randperm(40, generator=gen(ps)).tolist()
    free_before = list(free)
    req = make_req(list(range(3, 3 + 6)), row=2, cached=0, uid=0, output_len=40)
    taken, slots = [], []
    for step in range(12):  # prefill of 6 tokens, then 11 decode steps
        got = named("Exercise 4.4", allocate_pages, table, req, free, ps)
        want_new = -(-req.device_len // ps) - -(-req.cached_len // ps)
        assert len(got) == want_new, (
            f"Exercise 4.4 (allocate_pages), page_size={ps}: with cached_len={req.cached_len} and "
            f"device_len={req.device_len} the request holds ceil(cached_len / ps) pages and needs "
            f"ceil(device_len / ps): {want_new} new, got {got}")
        taken += got
        assert taken == free_before[:len(taken)] and free == free_before[len(taken):], (
            f"Exercise 4.4 (allocate_pages): take pages from the front of free_pages and remove "
            f"them from it (in place); took {taken}, {len(free)} left")
        slots = [p * ps + off for p in taken for off in range(ps)]
        row = table[2, :len(slots)].tolist()
        assert row == slots, (
            f"Exercise 4.4 (allocate_pages), page_size={ps}, device_len={req.device_len}: row 2 "
            f"should hold the slots of pages {taken} in order, {slots}, got {row}")
        assert not table[:2].any() and bool((table[3] == 999).all()), (
            "Exercise 4.4 (allocate_pages): only row table_idx may change")
        req.complete_one()
        req.append_host(torch.tensor([7], dtype=torch.int32))


@pytest.mark.parametrize("ps", [2, 4])
def test_allocate_pages_after_an_unaligned_prefix(ps):
    """Several new tokens after a cached prefix that ends inside a page (a chunked prefill, a
    prefix-cache hit): the new pages go at whole-page columns, the held page is kept."""
    table = create_page_table(2, 32, dummy_slot=999)
    free = [9, 4, 7, 1, 6, 2, 8, 3]
    ids = list(range(3, 3 + 13))
    named("Exercise 4.4", allocate_pages, table, make_req(ids[:5], row=1, cached=0, uid=0), free, ps)
    held = -(-5 // ps)  # pages of the 5-token prefix
    req = make_req(ids, row=1, cached=5, uid=0)  # 8 new tokens after it
    got = named("Exercise 4.4", allocate_pages, table, req, free, ps)
    need = -(-13 // ps)
    pages = [9, 4, 7, 1, 6, 2, 8, 3][:need]  # hand loop: page j of the request holds j*ps ..
    want_row = [p * ps + off for p in pages for off in range(ps)]
    assert list(got) == pages[held:], (
        f"Exercise 4.4 (allocate_pages), page_size={ps}: after a 5-token prefix (it holds "
        f"ceil(5/{ps}) = {held} pages) 8 new tokens need ceil(13/{ps}) = {need} pages in all: "
        f"it should take {pages[held:]}, took {list(got)}")
    row = table[1, :len(want_row)].tolist()
    assert row == want_row and not table[1, len(want_row):].any(), (
        f"Exercise 4.4 (allocate_pages), page_size={ps}: row 1 should be {want_row} (the new "
        f"pages at columns {held * ps}..{need * ps - 1}, whole pages, not from cached_len = 5), "
        f"got {table[1, :len(want_row) + ps].tolist()}")


# ----------------------------------------------------------------------------- quick check


def quick_check() -> None:
    """Fast smoke check of minisgl.kvcache (raises on failure; later chapters call it)."""
    own_tp = try_get_tp_info() is None
    if own_tp:
        set_tp_info(0, 1)
    try:
        ps = 4
        pool = MHAKVCache(HKV, 2, D, 4, ps, torch.float32, "cpu")
        k, v = strided_kv(3, seed=9)
        pool.store_kv(k, v, torch.tensor([13, 2, 7], dtype=torch.int32), 1)
        flat_k = pool.k_cache(1).reshape(-1, HKV, D)
        if not (torch.equal(flat_k[[13, 2, 7]], k.reshape(3, HKV, D))
                and torch.equal(pool.v_cache(1)[3, 1], v[0].reshape(HKV, D))):
            raise AssertionError("MHAKVCache.store_kv does not put row j into slot out_loc[j] "
                                 "(Exercise 4.1)")
        if int((flat_k != 0).any(-1).any(-1).sum()) != 3 or bool(pool.k_cache(0).any()):
            raise AssertionError("MHAKVCache.store_kv wrote slots outside out_loc (Exercise 4.1)")
        slots = pages_to_slots(torch.tensor([3, 0], dtype=torch.int32), ps).tolist()
        if slots != [12, 13, 14, 15, 0, 1, 2, 3]:
            raise AssertionError(f"pages_to_slots([3, 0], 4) gave {slots} (Exercise 4.2)")
        table = create_page_table(2, 8, dummy_slot=16)
        table[1, :8] = torch.tensor([12, 13, 14, 15, 0, 1, 2, 3], dtype=torch.int32)
        req = make_req([5, 6, 7, 8, 9], row=1, cached=3, uid=0)
        loc = batch_out_loc(table, [req]).tolist()
        if loc != [15, 0] or batch_positions([req]).tolist() != [3, 4]:
            raise AssertionError(f"batch_out_loc gave {loc} for positions 3, 4 of row "
                                 "[12, 13, 14, 15, 0, ...]; expected [15, 0] (Exercise 4.3)")
        rows = batch_row_map([req, make_req([1, 2], row=0, cached=0, uid=1)]).tolist()
        if rows != [1, 1, 0, 0]:
            raise AssertionError(f"batch_row_map gave {rows} for requests in rows 1 (2 new tokens) "
                                 "and 0 (2 new tokens); expected [1, 1, 0, 0] (Exercise 4.3)")
        free = [3, 1, 2]
        got = allocate_pages(table, make_req(list(range(5)), row=0, cached=0, uid=2), free, ps)
        if got != [3, 1] or free != [2] or table[0, :8].tolist() != [12, 13, 14, 15, 4, 5, 6, 7]:
            raise AssertionError(f"allocate_pages gave pages {got} (free list left: {free}) for a "
                                 "5-token prompt with page_size 4 and free list [3, 1, 2]; "
                                 "expected [3, 1], leaving [2] (Exercise 4.4)")
    finally:
        if own_tp:
            reset_tp_info()


def test_quick_check():
    quick_check()


def test_the_pool_and_the_slots_stay_on_their_device():
    """On a GPU the pool, k, v, out_loc and the pages are device tensors: "meta" tensors (shapes
    only, on any machine) stand in for them, so a tensor made on the CPU on the way (an index
    built from a Python list, offsets from a bare torch.arange) fails here."""
    pool = MHAKVCache(num_kv_heads=HKV, num_layers=2, head_dim=D, num_pages=4, page_size=2,
                      dtype=torch.float32, device="meta")
    k = torch.empty(3, HKV * D, device="meta")
    for dt in (torch.int32, torch.int64):
        named("Exercise 4.1", pool.store_kv, k, k, torch.empty(3, dtype=dt, device="meta"), 1)
    for dt in (torch.int32, torch.int64):
        slots = named("Exercise 4.2", pages_to_slots, torch.tensor([3, 0], dtype=dt,
                                                                  device="meta"), 4)
        assert slots.device.type == "meta" and slots.dtype == dt and tuple(slots.shape) == (8,), (
            f"Exercise 4.2: {dt} pages on 'meta' gave {slots.dtype} slots on {slots.device}, shape "
            f"{tuple(slots.shape)}: keep the dtype and device of pages")
