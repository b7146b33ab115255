"""The rewrite refuses a model whose packed step would mix its sequences (an op outside attention
that reduces over all positions of the call), naming the node; a model without one is untouched."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pagedpack.models.capture import capture
from pagedpack.passes.numerics import equal_to_floor, excess_error
from pagedpack.passes.pipeline import rewrite
from pagedpack.step.contract import UnsupportedModelError


class _OneLayer(torch.nn.Module):
    """Embedding, one causal SDPA layer and a head; ``couple`` adds ``0.1 * max(position_ids)``,
    a statistic of the whole call, to every token; ``empty_past`` concatenates a zero-length past
    to the keys, as transformers' cache does on a first call (a node whose values are empty)."""

    def __init__(self, couple: bool, empty_past: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.couple, self.empty_past = couple, empty_past
        self.embed, self.qkv, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 32)

    def forward(self, input_ids, position_ids, use_cache=False):
        q, k, v = self.qkv(self.embed(input_ids)).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.empty_past:
            k = torch.cat([k.new_zeros(1, 2, 0, 8) * position_ids.max(), k], dim=2)
        hidden = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, -1, 16)
        if self.couple:
            hidden = hidden + 0.1 * position_ids.max()
        return SimpleNamespace(logits=self.head(hidden))


@pytest.mark.parametrize("empty_past", [False, True])
def test_a_model_reading_the_longest_position_of_the_call_is_refused_naming_the_node(empty_past):
    """With an empty past too: the diagnostics compare its zero-length values as equal (they raised)."""
    captured = capture(_OneLayer(couple=True, empty_past=empty_past))
    before = captured.graph_module.code
    result = rewrite(captured)
    assert not result.ok and result.report.stopped_at == "sequence_independence"
    with pytest.raises(UnsupportedModelError, match=r"first differing node: max_\d = aten\.max\.default"):
        result.raise_if_refused()
    assert result.graph_module.code == before  # left as captured


def test_the_same_model_without_the_coupling_is_rewritten():
    result = rewrite(capture(_OneLayer(couple=False)))
    result.raise_if_refused()
    (record,) = [p for p in result.report.passes if p.name == "sequence_independence"]
    assert (record.matched, record.refused) == (3, 0)


def test_empty_values_compare_as_equal():
    empty = torch.zeros(1, 2, 0, 8)
    assert excess_error(empty, empty.clone(), empty.double()) is None and equal_to_floor(empty, empty.clone())
    assert excess_error(torch.ones(2), torch.ones(2), torch.full((2,), 2.0)) is None  # own error as large
    assert excess_error(torch.full((2,), 3.0), torch.ones(2), torch.ones(2, dtype=torch.float64))
