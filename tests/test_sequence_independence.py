"""The rewrite refuses a model whose packed step would mix its sequences (an op outside attention
that reduces over all positions of the call), naming the node; a model without one is untouched."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pagedpack.contract import UnsupportedModelError
from pagedpack.models.capture import capture
from pagedpack.passes.pipeline import rewrite


class _OneLayer(torch.nn.Module):
    """Embedding, one causal SDPA layer and a head; ``couple`` adds ``0.1 * max(position_ids)``,
    a statistic of the whole call, to every token."""

    def __init__(self, couple: bool):
        super().__init__()
        torch.manual_seed(0)
        self.couple = couple
        self.embed, self.qkv, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 32)

    def forward(self, input_ids, position_ids, use_cache=False):
        q, k, v = self.qkv(self.embed(input_ids)).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        hidden = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, -1, 16)
        if self.couple:
            hidden = hidden + 0.1 * position_ids.max()
        return SimpleNamespace(logits=self.head(hidden))


def test_a_model_reading_the_longest_position_of_the_call_is_refused_naming_the_node():
    captured = capture(_OneLayer(couple=True))
    before = captured.graph_module.code
    result = rewrite(captured)
    assert not result.ok and result.report.stopped_at == "sequence_independence"
    with pytest.raises(UnsupportedModelError, match=r"first differing node: max_1 = aten\.max\.default"):
        result.raise_if_refused()
    assert result.graph_module.code == before  # left as captured


def test_the_same_model_without_the_coupling_is_rewritten():
    result = rewrite(capture(_OneLayer(couple=False)))
    result.raise_if_refused()
    (record,) = [p for p in result.report.passes if p.name == "sequence_independence"]
    assert (record.matched, record.refused) == (3, 0)
