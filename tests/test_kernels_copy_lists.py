"""copy_blocks takes block ids as lists (append's copy-on-write pairs) and says what is wrong
with anything else in one line."""

import pytest
import torch

from kvscope.kernels import copy_blocks


def test_block_ids_as_lists_copy_as_tensors_do():
    kv = torch.arange(2 * 2 * 4 * 3 * 1 * 2, dtype=torch.float32).reshape(2, 2, 4, 3, 1, 2)
    want = kv.clone()
    want[:, :, 3] = want[:, :, 1]
    copy_blocks(kv, [1], [3])
    assert torch.equal(kv, want)


@pytest.mark.parametrize("bad", [["a"], [[1, 2]], "x"])
def test_bad_block_ids_are_a_one_line_type_error(bad):
    kv = torch.zeros(1, 2, 4, 3, 1, 2)
    with pytest.raises(TypeError, match="copy_blocks: src must be"):
        copy_blocks(kv, bad, [1])
