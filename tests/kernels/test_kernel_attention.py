"""streamserve_kernels/attention.py against its reference, and the reference against the engine's CPU path."""

from __future__ import annotations

import pytest
import torch

from kernel_batches import TOLERANCE, make_paged_batch, randn, rel_err
from streamserve_kernels.attention import (DecodeWorkspace, choose_num_splits, paged_attention, paged_attention_ref,
                                           paged_decode_attention)
from streamserve_kernels.cache import reshape_and_cache
from streamserve.worker.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention

DTYPES = [torch.float32, torch.bfloat16]
BLOCK_SIZES = [16, 32]
# (query heads, KV heads, head_dim): SmolLM2's 9 on 3 with 64, and 4 on 1 with 32.
HEADS = [(9, 3, 64), (4, 1, 32)]


def mixed_seqs(bs: int) -> list[tuple[int, int]]:
    """(cached context, query rows): decodes first, as the engine orders them, then prefill chunks."""
    return [(0, 1),              # a decode seeing only itself
            (bs - 1, 1),         # fills its block exactly
            (2 * bs + 4, 1),     # crosses blocks, last block partly filled
            (0, 13),             # a fresh prefill inside one block
            (bs - 7, 20),        # a chunk that starts mid-block and crosses into the next
            (3 * bs, 5)]         # a chunk starting exactly on a block boundary


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "{}q{}kv{}d".format(*h))
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_batch_matches_reference(gen, device, dtype, block_size, heads):
    hq, hkv, d = heads
    b = make_paged_batch(gen, mixed_seqs(block_size), hq, hkv, d, block_size, dtype, device, num_padding=3)
    out = torch.full_like(b.q, float("nan"))

    result = paged_attention(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, d ** -0.5,
                             b.max_query_len, out=out)

    ref = paged_attention_ref(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, d ** -0.5)
    n = b.num_real_tokens
    assert result is out
    assert not out[:n].isnan().any()
    assert rel_err(out[:n], ref[:n]) < TOLERANCE[dtype]
    assert out[n:].isnan().all()  # padding rows are left alone


def test_mixed_batch_pads_head_dim_and_reads_strided_q(gen, device):
    """head_dim 48 (padded to 64 inside), no GQA, q a view into a fused qkv tensor, and the
    sequences starting at row 70 (as when earlier rows went to the decode kernel)."""
    b = make_paged_batch(gen, [(5, 1), (0, 9), (20, 11)], 2, 2, 48, 16, torch.float32, device)
    skip = 70
    qkv = randn(gen, skip + b.q.shape[0], 6, 48, dtype=torch.float32, device=device)
    qkv[skip:, :2] = b.q
    q = qkv[:, :2]
    out = torch.full_like(q, float("nan"))

    paged_attention(q, b.kv_cache, b.query_start_loc + skip, b.seq_lens, b.block_tables, 0.3, b.max_query_len,
                    out=out)

    ref = paged_attention_ref(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, 0.3)
    assert rel_err(out[skip:], ref) < TOLERANCE[torch.float32]
    assert out[:skip].isnan().all()


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "{}q{}kv{}d".format(*h))
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_decode_matches_reference(gen, device, dtype, block_size, heads):
    hq, hkv, d = heads
    bs = block_size
    # With 16-token tiles and 3 splits the short sequences leave later splits empty; the last
    # sequence is graph padding (seq_len 0) and must come out as zeros.
    seqs = [(0, 1), (bs - 1, 1), (bs, 1), (3 * bs + 4, 1), (0, 1)]
    b = make_paged_batch(gen, seqs, hq, hkv, d, bs, dtype, device)
    seq_lens = b.seq_lens.clone()
    seq_lens[-1] = 0
    workspace = DecodeWorkspace.allocate(8, hq, d, 4, device)
    buffers = (workspace.partial_out.data_ptr(), workspace.lse.data_ptr())
    out = torch.full_like(b.q, float("nan"))

    result = paged_decode_attention(b.q, b.kv_cache, seq_lens, b.block_tables, d ** -0.5, num_splits=3,
                                    workspace=workspace, out=out, tile_n=16)

    ref = paged_attention_ref(b.q, b.kv_cache, b.query_start_loc[:-1], seq_lens[:-1], b.block_tables, d ** -0.5)
    assert result is out
    assert (workspace.partial_out.data_ptr(), workspace.lse.data_ptr()) == buffers
    assert rel_err(out[:-1], ref[:-1]) < TOLERANCE[dtype]
    assert (out[-1] == 0).all()
    # the last split of each (sequence, KV head) merged them and counted back to 0: the same
    # workspace serves the next launch (a graph's next replay) at any number of splits
    assert (workspace.arrived == 0).all()
    out.fill_(float("nan"))
    paged_decode_attention(b.q, b.kv_cache, seq_lens, b.block_tables, d ** -0.5, num_splits=4,
                           workspace=workspace, out=out, tile_n=16)
    assert rel_err(out[:-1], ref[:-1]) < TOLERANCE[dtype]
    assert (out[-1] == 0).all() and (workspace.arrived == 0).all()


def test_decode_without_split_writes_out_directly(gen, device):
    b = make_paged_batch(gen, [(40, 1), (3, 1)], 9, 3, 64, 16, torch.float32, device)
    out = torch.full_like(b.q, float("nan"))

    paged_decode_attention(b.q, b.kv_cache, b.seq_lens, b.block_tables, 0.125, num_splits=1, out=out)

    ref = paged_attention_ref(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, 0.125)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_split_decode_refuses_a_small_workspace(gen, device):
    b = make_paged_batch(gen, [(4, 1), (3, 1)], 4, 1, 32, 16, torch.float32, device)
    with pytest.raises(ValueError, match="too small"):
        paged_decode_attention(b.q, b.kv_cache, b.seq_lens, b.block_tables, 0.1, num_splits=4,
                               workspace=DecodeWorkspace.allocate(2, 4, 32, 2, device))


def test_choose_num_splits():
    assert choose_num_splits(100, num_seqs=4, num_kv_heads=3, max_splits=16) == 1  # short: no split
    assert choose_num_splits(4096, num_seqs=1, num_kv_heads=3, max_splits=16) == 16  # long, few programs
    assert choose_num_splits(4096, num_seqs=1, num_kv_heads=3, max_splits=8) == 8  # workspace cap
    assert choose_num_splits(4096, num_seqs=64, num_kv_heads=8, max_splits=16) == 1  # GPU already full
    assert choose_num_splits(1000, num_seqs=8, num_kv_heads=4, max_splits=16) == 4  # 256 tokens a split


def engine_attention(b, num_decodes: int, block_size: int, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> torch.Tensor:
    """The same step through streamserve's CPU TorchPagedAttention (it writes K/V itself)."""
    n = b.num_real_tokens
    cache = torch.nan_to_num(b.kv_cache, nan=0.0)  # its decode path masks whole blocks: NaN would leak
    seq_lens, starts = b.seq_lens.tolist(), b.query_start_loc.tolist()
    max_blocks = -(-max(seq_lens[:num_decodes]) // block_size)
    tables = b.block_tables[:num_decodes, :max_blocks].contiguous()
    visible = torch.arange(max_blocks * block_size)[None, :] < torch.tensor(seq_lens[:num_decodes])[:, None]
    mask = torch.zeros(visible.shape, dtype=b.q.dtype).masked_fill_(~visible, float("-inf"))
    prefills = [PrefillChunk(starts[i], starts[i + 1], seq_lens[i] - (starts[i + 1] - starts[i]),
                             b.block_tables[i, :-(-seq_lens[i] // block_size)])
                for i in range(num_decodes, len(seq_lens))]
    meta = AttentionMetadata(slot_mapping=b.slot_mapping[:n], num_decodes=num_decodes, decode_block_tables=tables,
                             decode_mask=mask.view(num_decodes, 1, 1, -1), prefills=prefills)
    attn = TorchPagedAttention([cache], meta, num_heads, num_kv_heads, head_dim)
    return attn(0, b.q[:n], b.k[:n], b.v[:n]).view(n, num_heads, head_dim)


def test_kernel_step_and_reference_match_the_engine(gen, device):
    """A whole attention step on the kernels (cache write, split decode for the decode rows,
    the mixed kernel for the prefill rows), the reference, and the engine's CPU path agree."""
    hq, hkv, d, bs = 9, 3, 64, 16
    seqs = mixed_seqs(bs)
    nd = 3
    b = make_paged_batch(gen, seqs, hq, hkv, d, bs, torch.float32, device, num_padding=2, write_step_kv=False)
    engine_out = engine_attention(b, nd, bs, hq, hkv, d)
    out = torch.full_like(b.q, float("nan"))
    workspace = DecodeWorkspace.allocate(4, hq, d, 4, device)

    reshape_and_cache(b.k, b.v, b.kv_cache, b.slot_mapping)
    paged_decode_attention(b.q[:nd], b.kv_cache, b.seq_lens[:nd], b.block_tables[:nd], d ** -0.5,
                           num_splits=2, workspace=workspace, out=out[:nd], tile_n=16)
    paged_attention(b.q, b.kv_cache, b.query_start_loc[nd:], b.seq_lens[nd:], b.block_tables[nd:], d ** -0.5,
                    b.max_query_len, out=out)

    n = b.num_real_tokens
    ref = paged_attention_ref(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, d ** -0.5)
    assert rel_err(ref[:n], engine_out) < 1e-5
    assert rel_err(out[:n], engine_out) < TOLERANCE[torch.float32]
    assert out[n:].isnan().all()


# (window, softcap): a window inside one block, one crossing blocks, one past every sequence; a cap
WINDOWS = [(5, 0.0), (21, 0.0), (1000, 0.0), (0, 1.5), (7, 1.5)]


@pytest.mark.parametrize("window, softcap", WINDOWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_windows_and_soft_caps_match_reference(gen, device, dtype, window, softcap):
    """Sliding windows (Mistral, Gemma) and soft-capped scores (Gemma 2), in the mixed kernel and
    the split decode kernel (whose splits then cover only the window)."""
    hq, hkv, d, bs = 4, 1, 32, 16
    b = make_paged_batch(gen, mixed_seqs(bs), hq, hkv, d, bs, dtype, device, num_padding=2)
    n, nd = b.num_real_tokens, 3
    ref = paged_attention_ref(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, 0.2, window, softcap)
    mixed = torch.full_like(b.q, float("nan"))
    paged_attention(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, 0.2, b.max_query_len,
                    out=mixed, window=window, softcap=softcap)
    assert rel_err(mixed[:n], ref[:n]) < TOLERANCE[dtype]
    assert mixed[n:].isnan().all()
    decode = torch.full_like(b.q[:nd], float("nan"))
    paged_decode_attention(b.q[:nd], b.kv_cache, b.seq_lens[:nd], b.block_tables[:nd], 0.2, num_splits=3,
                           workspace=DecodeWorkspace.allocate(4, hq, d, 4, device), out=decode, tile_n=16,
                           window=window, softcap=softcap)
    assert rel_err(decode, ref[:nd]) < TOLERANCE[dtype]
    full = paged_attention_ref(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, 0.2)
    if window < 100 or softcap:  # (a window past every sequence changes nothing)
        assert rel_err(full[:n], ref[:n]) > 1e-2


@pytest.mark.parametrize("window, softcap", WINDOWS)
def test_the_engines_cpu_path_windows_and_caps_as_the_reference(gen, device, window, softcap):
    """TorchPagedAttention (the CPU path, its masks and its plain product for a cap) agrees with
    the reference the kernels are checked against."""
    hq, hkv, d, bs = 4, 2, 32, 16
    b = make_paged_batch(gen, mixed_seqs(bs), hq, hkv, d, bs, torch.float32, device, write_step_kv=False)
    n, nd = b.num_real_tokens, 3
    cache = torch.nan_to_num(b.kv_cache, nan=0.0)
    seq_lens, starts = b.seq_lens.tolist(), b.query_start_loc.tolist()
    max_blocks = -(-max(seq_lens[:nd]) // bs)
    lens = torch.tensor(seq_lens[:nd])[:, None]
    slots = torch.arange(max_blocks * bs)[None, :]
    masks = {w: torch.zeros(nd, max_blocks * bs).masked_fill_((slots >= lens) | (slots < lens - w) if w else
                                                              slots >= lens, float("-inf")).view(nd, 1, 1, -1)
             for w in (0, window)}
    prefills = [PrefillChunk(starts[i], starts[i + 1], seq_lens[i] - (starts[i + 1] - starts[i]),
                             b.block_tables[i, :-(-seq_lens[i] // bs)]) for i in range(nd, len(seq_lens))]
    meta = AttentionMetadata(slot_mapping=b.slot_mapping[:n], num_decodes=nd,
                             decode_block_tables=b.block_tables[:nd, :max_blocks].contiguous(),
                             decode_mask=masks[0], prefills=prefills, decode_window_masks=masks)
    attn = TorchPagedAttention([cache], meta, hq, hkv, d, scale=0.2, windows=(window,), softcap=softcap)
    out = attn(0, b.q[:n], b.k[:n], b.v[:n]).view(n, hq, d)
    ref = paged_attention_ref(b.q[:n], cache, b.query_start_loc, b.seq_lens, b.block_tables, 0.2, window, softcap)
    assert rel_err(out, ref) < 1e-5
