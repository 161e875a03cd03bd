"""A block row -> speculators' training sample: the shift, the state split and the loss positions."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from eagle3ray.blocks import build_block  # noqa: E402
from eagle3ray.train import row_to_sample  # noqa: E402
from eagle3ray.verifier import to_storage_bytes  # noqa: E402


def _row(T=6, H=4):
    # states[t, l, h] = 100 t + 10 l + h, so every value tells where it came from
    states = (100 * np.arange(T)[:, None, None] + 10 * np.arange(4)[None, :, None]
              + np.arange(H)[None, None, :]).astype(np.float32)
    mask = [0, 0, 0, 1, 1, 1][:T]
    table = build_block([{"sample_id": "s0", "input_ids": list(range(10, 10 + T)), "loss_mask": mask}],
                        [{"sample_id": "s0", "shape": [T, 4, H],
                          "hidden_states": to_storage_bytes(torch.from_numpy(states), "float32")}], "float32")
    return table.to_pylist()[0], states, mask


def test_sample_is_shifted_and_split_into_aux_and_final_states():
    row, states, mask = _row()
    s = row_to_sample(row)
    T = len(mask)
    # token t+1 is paired with the auxiliary states of token t and the final state of token t+1 (speculators)
    assert s["input_ids"].tolist() == list(range(11, 10 + T))
    assert s["hidden_states"].shape == (T - 1, 3 * 4)
    assert torch.equal(s["hidden_states"], torch.from_numpy(states[:-1, :3].reshape(T - 1, -1)))
    assert torch.equal(s["verifier_last_hidden_states"], torch.from_numpy(states[1:, 3]))
    assert s["loss_mask"].tolist() == mask[1:]
    assert int(s["lengths"][0]) == T - 1


def test_all_positions_puts_the_loss_on_prompt_tokens_too():
    row, _, mask = _row()
    s = row_to_sample(row, all_positions=True)
    assert s["loss_mask"].tolist() == [1] * (len(mask) - 1)
    # only the mask changes
    ref = row_to_sample(row)
    for k in ("input_ids", "hidden_states", "verifier_last_hidden_states", "position_ids"):
        assert torch.equal(s[k], ref[k])
