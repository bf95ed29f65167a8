"""Silent corruption without processes (#53): a fingerprint sees every single-bit flip, in any
dtype and anywhere in a tensor; the majority names the replica that differs (and with two,
no one); a verified state is kept apart from the live one and a rollback restores it whole."""
from __future__ import annotations

import pytest
import torch

from ftrun.worker.verify import Verifier, blame, fingerprint, leaves_of

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1000, generator=gen), torch.randn(7, 3, generator=gen).half(),
            torch.randn(5, generator=gen).double(), torch.tensor([True, False]),
            torch.randint(0, 9, (4,), generator=gen), torch.randn(10, generator=gen).bfloat16(),
            torch.randn(3, generator=gen, dtype=torch.complex64), torch.empty(0)]


@pytest.mark.parametrize("index", range(7))
def test_every_single_bit_flip_changes_the_fingerprint(index: int) -> None:
    base = fingerprint(tensors(), "cpu")
    t = tensors()[index]
    width = min(t.element_size(), 8)
    words = t.numel() * t.element_size() // width
    for bit in range(8 * width):
        for pos in (0, words // 2, words - 1):
            flipped = tensors()
            view = flipped[index].reshape(-1).view(INT[width])
            view[pos] ^= torch.tensor(1, dtype=view.dtype) << bit if bit < 8 * width - 1 \
                else torch.tensor(-(1 << bit) if width > 1 else 1 << bit, dtype=view.dtype)
            assert not torch.equal(fingerprint(flipped, "cpu"), base), (index, bit, pos)


def test_equal_states_have_equal_fingerprints_and_order_matters_not_rounding() -> None:
    assert torch.equal(fingerprint(tensors(), "cpu"), fingerprint(tensors(), "cpu"))
    a = torch.tensor([1.0, 2.0])
    b = torch.tensor([1.0 + 2**-23, 2.0])  # the smallest change a float sum might round away
    assert not torch.equal(fingerprint([a], "cpu"), fingerprint([b], "cpu"))


def test_the_majority_names_the_replica_that_differs() -> None:
    names = ["model.w", "model.b", "optimizer.state.0.momentum_buffer"]
    good, bad = (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 9, 6)
    v = blame([good, bad, good], names)
    assert not v.equal and v.differing == (1,) and v.tensor == names[2]
    assert blame([good, good, good], names).equal
    two = blame([good, bad], names)  # two replicas: neither is trusted
    assert not two.equal and two.differing is None


def test_a_verified_state_is_a_copy_and_a_rollback_restores_it_whole() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    objects = {"model": model, "optimizer": opt}
    before = fingerprint([t for _, t in leaves_of(objects)], "cpu")
    v = Verifier(every=10)
    assert v.due(0) and v.due(10) and not v.due(5)  # the same boundaries on every member
    v.keep(10, objects)
    kept = v.last
    v.keep(10, objects)
    assert v.last is kept  # the same step is not copied twice
    with torch.no_grad():
        model.weight.view(-1).view(torch.int32)[3] ^= 1 << 30  # corrupt the live state
    opt.state[model.weight]["momentum_buffer"].add_(1.0)
    assert not torch.equal(fingerprint([t for _, t in leaves_of(objects)], "cpu"), before)
    assert v.rollback(objects) == 10
    assert torch.equal(fingerprint([t for _, t in leaves_of(objects)], "cpu"), before)
    with torch.no_grad():  # the kept copy is not the live tensors: a later flip leaves it
        model.weight.add_(1.0)
    assert v.rollback(objects) == 10
    assert torch.equal(fingerprint([t for _, t in leaves_of(objects)], "cpu"), before)


def test_a_rollback_fills_the_live_tensors_and_never_shares_the_kept_ones() -> None:
    """Restored in place: a parameter is the same tensor after the rollback (FSDP2's DTensors
    must stay on their mesh), and training on never reaches into the kept copy."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    objects = {"model": model, "optimizer": opt}
    verifier = Verifier(10)

    def train() -> None:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    train()
    verifier.keep(10, objects)
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    weight = model.weight
    train()
    assert verifier.rollback(objects) == 10
    assert model.weight is weight
    assert all(torch.equal(v, kept[k]) for k, v in model.state_dict().items())
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)
    train()  # the kept copy is untouched by the training that follows
    assert verifier.rollback(objects) == 10
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)


def test_a_gradient_outlier_is_repeated_then_told_or_the_state_compared() -> None:
    from types import SimpleNamespace

    from ftrun.protocol.rendezvous import Corruption, Generation
    from ftrun.worker.verify import COMPARE, GO, NO_GRADIENT, REPEAT, GradCheck, grad_outlier

    assert grad_outlier([float("nan")] * 3) is None  # the model's own divergence
    assert grad_outlier([0.0, float("inf"), 0.5]) == 1
    assert grad_outlier([NO_GRADIENT - 1, 0.0, 0.5]) is None  # a rank without data
    assert grad_outlier([0.0, 11.0, 0.5]) == 1 and grad_outlier([0.0, 9.0, 0.5]) is None
    sync = SimpleNamespace(norms=[0.0, 0.0, 20.0])
    posted: list[object] = []
    group = SimpleNamespace(rank=0, members=None, gen=Generation(3, (5, 6, 7)))
    check = GradCheck(sync, 5, posted.append)
    assert check.judge(10, group) == REPEAT
    sync.norms = [0.0, 0.1, 0.0]  # gone in the repeat: a corruption of the computation
    assert check.judge(10, group) == GO
    told, = posted
    assert isinstance(told, Corruption) and (told.step, told.blamed, told.found) == (
        10, "7", "gradient")
    sync.norms = [0.0, 0.0, 20.0]  # persisting: the state is compared before it is kept
    assert [check.judge(11, group), check.judge(11, group)] == [REPEAT, COMPARE]
    check.compared(11, True)
    assert check.judge(11, group) == GO and len(posted) == 1  # the data's, kept
    assert check.judge(12, group) == REPEAT  # a new step is judged anew
