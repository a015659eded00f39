"""FT-HSDP's local state reads the modules' own tensors, not ``state_dict()``: a model whose
state-dict hooks convert (torchtitan's llama3 splits its fused ``wqkv`` into ``wq/wk/wv``,
gathering shards over the shard group) must still send and receive exactly its parameters."""

from __future__ import annotations

from typing import Any

import torch

from ftc10d.train.fsdp import load_local_state, local_state


class Fused(torch.nn.Module):
    """A fused weight whose state_dict() shows three split copies (a conversion hook), plus a
    persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = torch.nn.Parameter(torch.arange(12.0).reshape(6, 2))
        self.register_buffer("scale", torch.tensor([2.0]))
        self.register_buffer("cache", torch.zeros(3), persistent=False)
        self._register_state_dict_hook(self._split)

    @staticmethod
    def _split(module: Any, sd: dict, prefix: str, _: Any) -> dict:
        w = sd.pop(prefix + "wqkv")
        for name, part in zip(("wq", "wk", "wv"), w.clone().chunk(3)):
            sd[prefix + name] = part
        return sd


def test_local_state_is_the_modules_tensors_whatever_state_dict_hooks_do() -> None:
    model = torch.nn.Sequential(Fused())
    assert set(model.state_dict()) == {"0.wq", "0.wk", "0.wv", "0.scale"}  # the hook converts
    state = local_state(model)
    assert set(state["model"]) == {"0.wqkv", "0.scale"}  # persistent ones, by module name
    other = torch.nn.Sequential(Fused())
    with torch.no_grad():
        other[0].wqkv.mul_(-1)
        other[0].scale.fill_(7.0)
    wqkv = other[0].wqkv
    load_local_state(other, None, state)
    assert other[0].wqkv is wqkv  # in place: the same parameter object (FSDP2 keeps it)
    assert torch.equal(other[0].wqkv, model[0].wqkv) and torch.equal(other[0].scale, model[0].scale)


def test_local_state_with_an_optimizer_round_trips() -> None:
    model = torch.nn.Sequential(Fused())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model[0].wqkv.sum().backward()
    opt.step()
    state = local_state(model, opt)
    other = torch.nn.Sequential(Fused())
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    load_local_state(other, other_opt, state)
    assert torch.equal(other[0].wqkv, model[0].wqkv)
    got = other_opt.state[other[0].wqkv]
    assert torch.equal(got["exp_avg"], opt.state[model[0].wqkv]["exp_avg"])
    assert other_opt.param_groups[0]["lr"] == 0.1
