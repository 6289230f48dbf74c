"""Bit packing: round trips for every width, byte counts, and the pinned 3-bit layout."""

import pytest
import torch

from airquant.kv.pack import pack, packed_width, unpack


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [16, 64, 128, 40])
def test_round_trip(bits, dim):
    gen = torch.Generator().manual_seed(bits * 1000 + dim)
    codes = torch.randint(0, 2**bits, (3, 2, 5, dim), generator=gen)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 2, 5, dim * bits // 8) == (3, 2, 5, packed_width(dim, bits))
    assert torch.equal(unpack(packed, bits, dim), codes)


def test_three_bit_layout_is_little_endian_24_bit_words():
    codes = torch.arange(8)  # code i at bits 3i..3i+2 of one 24-bit word
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    assert pack(codes, 3).tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]


def test_two_and_four_bit_layouts():
    assert pack(torch.tensor([1, 2, 3, 0]), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack(torch.tensor([0xA, 0x5]), 4).tolist() == [0x5A]


def test_rejects_dims_outside_the_packing_group():
    with pytest.raises(ValueError, match="multiple of 8"):
        packed_width(12, 3)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_a_byte_tables_rows_are_its_codes_centroids_in_dimension_order(bits):
    """``Codec.byte_table``: gathering row ``b`` for each packed byte ``b`` decodes the same unit vectors as
    unpacking the codes and gathering each (what the Triton kernel's byte-table tiles rely on)."""
    from airquant.kv.codec import Codec

    codec = Codec(dim=64, bits=bits, seed=3)
    codes = torch.randint(0, 1 << bits, (5, 64), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    table = codec.byte_table("cpu")
    assert table.shape == (256, 8 // bits)
    assert torch.equal(table[packed.long()].reshape(5, 64), codec.centroids_of(packed))
    assert codec.byte_table("cpu", torch.float16).dtype == torch.float16


def test_three_bit_codes_have_no_byte_table():
    from airquant.kv.codec import Codec

    with pytest.raises(ValueError, match="straddle bytes"):
        Codec(dim=64, bits=3, seed=0).byte_table("cpu")
