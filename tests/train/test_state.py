"""State transfer format: a JSON skeleton and one byte buffer, never pickle."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ftc10d.train.state import StateFormatError, fingerprint, pack, state_hash, unpack


def _model_and_adam() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()  # Adam's state (step, exp_avg, exp_avg_sq) now exists
    return model, opt


def test_round_trip_restores_model_and_optimizer_bitwise() -> None:
    model, opt = _model_and_adam()
    rng = torch.get_rng_state()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"pos": 17, "name": "x", 3: (1.5, None)},
             "rng": rng, "flags": torch.tensor([True, False]), "half": torch.ones(3, dtype=torch.float16)}
    packed = pack(state)
    assert packed.buffer.dtype == torch.uint8 and "pickle" not in packed.skeleton
    json.loads(packed.skeleton)  # plain JSON
    got = unpack(packed.skeleton, packed.buffer.clone())
    model2 = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    model2.load_state_dict(got["model"])
    opt2.load_state_dict(got["optim"])
    assert got["extra"] == {"pos": 17, "name": "x", 3: (1.5, None)}
    assert torch.equal(got["rng"], rng) and got["flags"].tolist() == [True, False]
    assert state_hash({"m": model.state_dict(), "o": opt.state_dict()}) == \
        state_hash({"m": model2.state_dict(), "o": opt2.state_dict()})
    assert fingerprint(model.state_dict()) == fingerprint(model2.state_dict())


def test_fingerprint_and_hash_see_a_single_flipped_bit() -> None:
    model, _ = _model_and_adam()
    before_fp, before_hash = fingerprint(model.state_dict()), state_hash(model.state_dict())
    with torch.no_grad():
        w = model[0].weight.view(-1)
        w.view(torch.int32)[5] ^= 1  # the lowest mantissa bit of one weight
    assert fingerprint(model.state_dict()) != before_fp
    assert state_hash(model.state_dict()) != before_hash


def test_unsendable_values_are_refused_with_the_path() -> None:
    with pytest.raises(StateFormatError, match=r"state\.data\.sampler: a object"):
        pack({"data": {"sampler": object()}})
    with pytest.raises(StateFormatError, match="dict key"):
        pack({(1, 2): 3})


def test_corrupt_or_foreign_skeletons_are_rejected() -> None:
    packed = pack({"w": torch.arange(10.0)})
    with pytest.raises(StateFormatError, match="not JSON"):
        unpack("{nope", packed.buffer)
    with pytest.raises(StateFormatError, match="format"):
        unpack(json.dumps({"format": "other"}), packed.buffer)
    with pytest.raises(StateFormatError, match="bytes"):
        unpack(packed.skeleton, packed.buffer[:-8])
    doc = json.loads(packed.skeleton)
    doc["offsets"][0] = 10**9
    with pytest.raises(StateFormatError, match="outside"):
        unpack(json.dumps(doc), packed.buffer)
