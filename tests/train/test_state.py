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


def test_in_place_targets_match_by_path_dtype_and_shape() -> None:
    from ftc10d.train.state import in_place_targets

    src_model, src_opt = _model_and_adam()
    packed = pack({"model": src_model.state_dict(), "optim": src_opt.state_dict()})
    joiner = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))  # fresh: no Adam state yet
    fresh_opt = torch.optim.Adam(joiner.parameters(), lr=1e-3)
    local = {"model": joiner.state_dict(), "optim": fresh_opt.state_dict()}
    into = in_place_targets(packed.skeleton, local)
    # every model tensor has a home on the joiner; the optimizer's state does not exist there yet
    assert sorted(t.data_ptr() for t in into.values()) == sorted(p.data_ptr() for p in joiner.parameters())
    # a different shape or dtype at the same path is never a target
    other = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))  # only "2.bias" ([3]) still fits
    assert [t.data_ptr() for t in in_place_targets(packed.skeleton, {"model": other.state_dict()}).values()] == \
        [other[2].bias.data_ptr()]
    assert in_place_targets(packed.skeleton, {"model": joiner.double().state_dict()}) == {}
    # received tensors stand in for their views; the rest still come from the buffer
    state = unpack(packed.skeleton, packed.buffer, into)
    assert all(any(v is t for t in into.values()) for v in state["model"].values())
    assert torch.equal(state["optim"]["state"][0]["exp_avg"], src_opt.state_dict()["state"][0]["exp_avg"])
