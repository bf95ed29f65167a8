"""Gradient buckets (ftrun/worker/buckets.py): the layout every rank computes alike, and a
steady step over a real gloo group (two ranks on threads, a real TCPStore) that averages
like DDP, starts buckets during backward and copies no gradient in or out."""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftrun.protocol.rendezvous import Generation
from ftrun.worker.buckets import FIRST_BUCKET_BYTES, GradSync, bucket_groups
from ftrun.worker.comm import Group, Interrupt

STEP_TIMEOUT_S = 60  # a rank's thread ends well within this or the test fails


def floats(n: int, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(n, dtype=dtype))


def ids(groups: list[list[Any]]) -> list[list[int]]:
    return [[id(p) for p in g] for g in groups]


def test_the_first_bucket_is_small_and_the_rest_close_once_full() -> None:
    mib = 2**20 // 4  # float32 elements in a MiB
    a, b, c, d, e, f = (floats(n) for n in (mib, 10, 7 * mib // 2, mib // 2, mib // 2, mib // 2))
    groups = bucket_groups([a, b, c, d, e, f], 4 * 2**20)
    assert FIRST_BUCKET_BYTES == 2**20  # f and e fill it; d starts a 4 MiB bucket
    assert ids(groups) == ids([[f, e], [d, c], [b, a]])


def test_a_small_parameter_joins_its_large_neighbour_and_dtypes_do_not_mix() -> None:
    params = [floats(100), floats(100, torch.float64), floats(10**6), floats(100)]
    groups = bucket_groups(params, 2**20)
    # the bias (last) and the large weight share the first bucket; a dtype change closes one
    assert ids(groups) == ids([[params[3], params[2]], [params[1]], [params[0]]])


def test_the_layout_depends_only_on_the_shapes_so_every_rank_computes_the_same() -> None:
    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(300, 500), torch.nn.Linear(500, 300))

    a, b = model(), model()

    def shapes(groups: list[list[Any]]) -> list[list[tuple[int, ...]]]:
        return [[tuple(p.shape) for p in g] for g in groups]

    assert shapes(bucket_groups(list(a.parameters()), 2**19)) == \
        shapes(bucket_groups(list(b.parameters()), 2**19))


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank (built before the threads start:
    # the global generator is shared by threads)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    return [g for g in grads if g is not None]


def run_rank(rank: int, port: int, model: torch.nn.Module, results: dict[int, Any]) -> None:
    """Two steps of the full loop's gradient sync on one rank; what it saw goes in results."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=timedelta(seconds=STEP_TIMEOUT_S))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("buckets/", store), rank, 2,
                               timedelta(seconds=STEP_TIMEOUT_S))
    group = Group(Generation(1, (0, 1)), rank, pg)
    sync = GradSync(torch.device("cpu"), lambda: False, lambda: True, lambda: None)
    sync.add(list(model.parameters()), bucket_mb=0.0001)  # 3 buckets
    seen: dict[str, Any] = {"grads": [], "ids": [], "started_in_backward": []}
    for step in range(2):
        sync.next_step(group)
        x = torch.full((8, 16), float(rank + 1 + step))
        model(x).pow(2).sum().backward()
        seen["started_in_backward"].append(sum(b.started for b in sync._layout()))
        assert sync.finish(group, Interrupt()) is False  # nobody voted to switch
        seen["grads"].append([g.clone() for g in grads_of(model)])
        seen["ids"].append([id(g) for g in grads_of(model)])
        seen["views"] = all(g._base is not None for g in grads_of(model))
        sync.zero()  # what ft.commit() does
    seen["buckets"] = len(sync._layout())
    results[rank] = seen


def reference_grads(rank: int, step: int) -> list[torch.Tensor]:
    plain = model()
    plain(torch.full((8, 16), float(rank + 1 + step))).pow(2).sum().backward()
    return grads_of(plain)


def test_a_steady_step_averages_like_ddp_during_backward_and_copies_nothing() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=STEP_TIMEOUT_S))
    results: dict[int, Any] = {}
    threads = [threading.Thread(target=run_rank, args=(r, server.port, model(), results),
                                daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STEP_TIMEOUT_S)
    assert sorted(results) == [0, 1], "a rank failed or timed out"
    for step in range(2):
        mean = [(a + b) / 2 for a, b in zip(reference_grads(0, step), reference_grads(1, step),
                                            strict=True)]
        for rank in (0, 1):
            for got, want in zip(results[rank]["grads"][step], mean, strict=True):
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    for seen in results.values():
        assert seen["buckets"] > 2
        # every bucket but possibly the last one (its vote is added in finish) started while
        # backward ran
        assert all(n >= seen["buckets"] - 1 for n in seen["started_in_backward"])
        # the grads are views of the buckets and stay the same tensors: no copy in or out
        assert seen["views"] and seen["ids"][0] == seen["ids"][1]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
