"""The paged KV cache (models/runner/kv_cache.py): block tables against a dense left-padded reference."""

from __future__ import annotations

import torch

from text_generation_server.models.runner.kv_cache import BlockPool, KVCache, PoolSet

HEADS, DIM, LAYERS = 2, 4, 3


def columns(rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, HEADS, n, DIM, generator=generator),
            torch.randn(rows, HEADS, n, DIM, generator=generator))


def append(cache: KVCache, k: torch.Tensor, v: torch.Tensor, layers: range = range(LAYERS)) -> None:
    for i in layers:
        cache.append(i, k, v)
    cache.advance(k.shape[2])


def test_appends_read_back_left_padded_and_stacking_copies_nothing() -> None:
    pool = BlockPool(LAYERS, block_size=4)
    short, long = KVCache(1, LAYERS, pool=pool), KVCache(2, LAYERS, pool=pool)
    ks, vs = columns(1, 3, 0)
    kl, vl = columns(2, 10, 1)
    append(short, ks, vs)
    append(long, kl, vl)
    assert pool.used_blocks == 1 + 2 * 3  # ceil(3 / 4) + 2 x ceil(10 / 4)
    keys_before = pool.keys[0].clone()  # type: ignore[union-attr]
    both = KVCache.concatenate([short, long])
    assert pool.used_blocks == 7 and torch.equal(pool.keys[0], keys_before)  # block ids only
    keys, values = both.layer(1)  # type: ignore[misc]
    assert keys.shape == (3, HEADS, 10, DIM)
    assert torch.equal(keys[0, :, 7:], ks[0]) and torch.equal(values[0, :, :7], torch.zeros(HEADS, 7, DIM))
    assert torch.equal(keys[1:], kl) and torch.equal(values[1:], vl)
    del short, long
    assert pool.used_blocks == 7  # `both` holds them
    k_new, v_new = columns(3, 2, 2)
    keys, _ = both.append(0, k_new, v_new)
    assert torch.equal(keys[:, :, 10:], k_new) and torch.equal(keys[1:, :, :10], kl)


def test_filter_and_crop_give_blocks_back() -> None:
    pool = BlockPool(LAYERS, block_size=4)
    cache = KVCache(3, LAYERS, pool=pool)
    k, v = columns(3, 9, 3)
    append(cache, k, v)
    assert pool.used_blocks == 9
    cache.crop(5)  # drafts rejected: blocks wholly past column 5 go
    assert pool.used_blocks == 6 and cache.length == 5
    cache.filter([2, 0], 3)  # two rows, their last 3 columns (2..4): both blocks of each stay
    assert cache.num_rows == 2 and pool.used_blocks == 4
    cache.filter([0], 1)  # column 4 only: the block of columns 0..3 is left of it
    assert cache.num_rows == 1 and pool.used_blocks == 1
    keys, _ = cache.layer(0)  # type: ignore[misc]
    assert torch.equal(keys[0], k[2, :, 4:5])
    cache.release()
    assert pool.used_blocks == 0 and pool.keys == [None] * LAYERS  # an idle pool gives its memory back


def test_a_written_row_ends_where_asked_and_a_skipped_layer_holds_nothing() -> None:
    pools = PoolSet(LAYERS, block_size=4)
    cache = KVCache(2, LAYERS, length=6, pool=pools(frozenset({1})))
    k, v = columns(1, 5, 4)
    cache.write_row(1, 6, [(k[0], v[0]), None, (k[0], v[0])])
    keys, _ = cache.layer(2)  # type: ignore[misc]
    assert torch.equal(keys[1, :, 1:], k[0]) and not keys[0].any() and not keys[1, :, 0].any()
    assert cache.layer(1) is None and pools(frozenset({1})).keys[1] is None
    rows = cache.row(1, torch.tensor([2, 3]))
    assert rows[1] is None and torch.equal(rows[0][0], k[0, :, 1:3])  # type: ignore[index]
    assert pools.used_blocks() == 2 and pools(frozenset()).used_blocks == 0


def test_a_rows_padding_takes_no_blocks_and_is_never_written() -> None:
    pool = BlockPool(LAYERS, block_size=4)
    cache = KVCache(2, LAYERS, pool=pool)
    cache.begin(1, 5)  # row 1's prompt is 5 columns shorter: left padding
    k, v = columns(2, 7, 5)
    append(cache, k, v)
    assert [len(t) for t in cache.tables] == [2, 1] and pool.used_blocks == 3
    keys, values = cache.layer(2)  # type: ignore[misc]
    assert torch.equal(keys[0], k[0]) and torch.equal(keys[1, :, 5:], k[1, :, 5:])
    assert not keys[1, :, :5].any() and not values[1, :, :5].any()  # padding reads the zero block
    assert not pool.keys[2][0].any()  # type: ignore[index]  # the writes there were dropped
