"""materialise(): storage for what is still on the meta device, real buffers kept, stated ranges filled."""
import pytest
import torch

from megalite.parallel.data.materialise import LocalElements, materialise
from megalite.parallel.param_meta import mark, param_meta


class Stated:
    """A layout that keeps the first ``n`` elements of each parameter of ``model``, in the parameter."""

    def __init__(self, model, n):
        self.model, self.n = model, n

    def local_elements(self):
        return [LocalElements(p, 0, self.n, p.detach().view(-1)[:self.n]) for p in self.model.parameters()]


def test_meta_parameters_get_storage_and_their_stated_values_and_buffers_keep_theirs():
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    model.register_buffer("table", torch.arange(4.0))
    for p in model.parameters():
        mark(p, init_values=lambda lo, hi, device: torch.arange(lo, hi, dtype=torch.float32, device=device))
    materialise([model], Stated(model, 2), torch.device("cpu"))
    assert torch.equal(model.weight.detach().view(-1)[:2], torch.tensor([0.0, 1.0]))
    assert torch.equal(model.bias.detach(), torch.tensor([0.0, 1.0]))
    assert torch.equal(model.table, torch.arange(4.0))
    assert all(param_meta(p).init_values is None for p in model.parameters())


def test_meta_parameters_beside_ones_with_storage_are_refused():
    model = torch.nn.Linear(3, 2)
    model.bias = torch.nn.Parameter(torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match="beside parameters with storage"):
        materialise([model], Stated(model, 1), torch.device("cpu"))
