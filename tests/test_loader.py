"""ft.loader: exactly-once data across faults, shrinks and grows; read-ahead in reader
processes that returns the same data and never outlives the training process."""
import gc
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import pid_alive, wait_for
from ports import free_port

from ftrun.core.errors import WorkerApiError
from ftrun.worker.loader import Loader, ReaderTraceback, dist_membership, share

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from gpt_data import VOCAB_SIZE, TokenDataset, decode  # noqa: E402


class Recording:
    """Item i is (i, {"i": i, "f": [i, -i]}); every read is logged."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.reads.append(i)
        pair = torch.tensor([i, -i], dtype=torch.float)
        return torch.tensor(i), {"i": torch.tensor(i), "f": pair}


class Failing(Recording):
    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        if i == 7:
            raise KeyError("item 7 is corrupt")
        return super().__getitem__(i)


def ids(batch) -> list[int]:  # type: ignore[no-untyped-def]
    return batch[0].tolist()


# ------------------------------------------------------------------------- index maps
def test_share_matches_batch_slice() -> None:
    for n in range(1, 30):
        for world in range(1, n + 1):
            parts = [share(n, r, world) for r in range(world)]
            assert [i for p in parts for i in range(n)[p]] == list(range(n))
            sizes = [p.stop - p.start for p in parts]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_epoch_order_is_seeded_and_drops_the_tail() -> None:
    loader = Loader(Recording(100), 12, seed=3, membership=lambda: (0, 1, 0))
    assert loader.steps_per_epoch == 8
    epochs = [[i for s in range(8 * e, 8 * e + 8) for i in loader.indices(s)] for e in (0, 1)]
    for order in epochs:
        assert len(order) == 96 and len(set(order)) == 96 and set(order) <= set(range(100))
    assert epochs[0] != epochs[1]
    again = Loader(Recording(100), 12, seed=3, membership=lambda: (0, 1, 0))
    assert [again.indices(s) for s in range(16)] == [loader.indices(s) for s in range(16)]
    other = Loader(Recording(100), 12, seed=4, membership=lambda: (0, 1, 0))
    assert [other.indices(s) for s in range(8)] != [loader.indices(s) for s in range(8)]
    plain = Loader(Recording(100), 12, shuffle=False, membership=lambda: (0, 1, 0))
    assert plain.indices(9) == list(range(12, 24)) and plain.epoch_of(9) == 1


def test_micro_batches_and_ranks_reassemble_the_global_batch() -> None:
    cell = [0, 1, 0]
    loader = Loader(Recording(100), 12, membership=lambda: tuple(cell))  # type: ignore[arg-type]
    for accum in (1, 2, 3, 4, 6):
        for world in range(1, 12 // accum + 1):
            for step in (0, 5, 13):
                got = []
                for micro in range(accum):
                    for rank in range(world):
                        cell[:] = [rank, world, 0]
                        got += ids(loader.batch(step, micro, accum))
                assert got == loader.indices(step), (accum, world, step)


# ------------------------------------------------------------ exactly once, simulated
def run_job(schedule: list[tuple[list[int], bool]], accum: int) -> tuple[dict, dict]:
    """Each entry: (members by rank, committed?). Workers keep their loader (and dataset)
    from the step they join; a failed attempt reads some micro-batches, then the step
    repeats. Returns {step: indices consumed by the committed attempt} and each worker's
    reads checked against what its batches returned."""
    loaders: dict[int, Loader] = {}
    members: list[int] = []
    committed: dict[int, list[int]] = {}
    step = 0

    def membership_of(worker: int):  # type: ignore[no-untyped-def]
        return lambda: (members.index(worker), len(members), 0)

    for new_members, ok in schedule:
        members[:] = new_members
        consumed: list[int] = []
        for worker in members:
            if worker not in loaders:  # a replacement or a grown member starts fresh
                loaders[worker] = Loader(Recording(100), 12, seed=1,
                                         membership=membership_of(worker))
            data = loaders[worker].dataset
            data.reads.clear()
            got: list[int] = []
            for micro in range(accum if ok else accum - 1):
                got += ids(loaders[worker].batch(step, micro, accum))
            assert data.reads == got  # a rank reads its own indices and nothing else
            consumed += got
        if ok:
            committed[step] = consumed
            step += 1
    return committed, loaders


def test_every_committed_step_consumes_its_global_batch_once() -> None:
    four, three = [0, 1, 2, 3], [0, 1, 3]
    schedule = ([(four, True)] * 3 + [(four, False)]  # step 3 breaks mid-accumulation
                + [(three, True)] * 3                 # shrink: step 3 repeats with 3 ranks
                + [([0, 1, 3, 4], True)]              # grow: worker 4 joins as rank 3
                + [([0, 5, 3, 4], False), ([0, 5, 3, 4], True)]  # replacement, a failed try
                + [([0, 5], True)] * 2 + [([5, 0, 3], True)] * 3)
    committed, loaders = run_job(schedule, accum=3)
    reference = loaders[0]
    assert sorted(committed) == list(range(13))
    for step, consumed in committed.items():
        assert Counter(consumed) == Counter(reference.indices(step)), step
    epoch0 = [i for s in range(8) for i in committed[s]]
    assert len(epoch0) == 96 and len(set(epoch0)) == 96


# --------------------------------------------------------------------- read-ahead
def test_read_ahead_returns_the_same_data_across_membership_changes() -> None:
    cell = [0, 2, 0]
    live = lambda: tuple(cell)  # noqa: E731
    ahead = Loader(Recording(100), 12, seed=2, num_workers=2, membership=live)  # type: ignore
    here = Loader(Recording(100), 12, seed=2, num_workers=0, membership=live)  # type: ignore
    calls = ([(s, m) for s in range(3) for m in range(2)]
             + [(2, 0), (2, 1)]                       # step 2 repeats after a failure
             + [(3, 0), ("gen", 1), (3, 1), (4, 0)]   # a replacement: same rank and world
             + [("world", (1, 3)), (4, 0), (4, 1)]    # a grow mid-step: the step repeats
             + [("world", (0, 1)), (5, 0), (5, 1), (6, 0), (6, 1), (7, 0), (7, 1), (8, 0)])
    with ahead:
        for a, b in calls:
            if a == "gen":
                cell[2] += 1
                discarded = ahead.stats["discarded"]
                continue
            if a == "world":
                cell[:2] = b
                continue
            before, was_here = len(ahead.dataset.reads), ahead.stats["read_here"]
            got, want = ahead.batch(a, b, 2), here.batch(a, b, 2)
            assert ids(got) == ids(want) == ahead.share_of(a, b, 2, cell[0], cell[1])
            assert torch.equal(got[1]["f"], want[1]["f"])
            # read here: exactly its own items; read ahead: nothing in this process
            read_here = ahead.stats["read_here"] > was_here
            assert ahead.dataset.reads[before:] == (ids(got) if read_here else [])
            if (a, b) == (3, 1):  # a generation change alone discards nothing
                assert ahead.stats["discarded"] == discarded and not read_here
        # read here: the first call, the repeated step 2, and the two membership changes
        assert ahead.stats["read_here"] == 4
        assert ahead.stats["read_ahead"] == len(calls) - 4 - 3 and ahead.stats["discarded"] > 0


def test_reader_exceptions_reach_the_caller() -> None:
    # shuffle=False, 5 steps an epoch: item 7 is in steps 0 and 5 only
    here = Loader(Failing(40), 8, shuffle=False, membership=lambda: (0, 1, 0))
    with pytest.raises(KeyError, match="corrupt"):
        here.batch(0)
    with Loader(Failing(40), 8, shuffle=False, num_workers=2,
                membership=lambda: (0, 1, 0)) as ahead:
        ahead.batch(4)  # steps 5 and 6 are read ahead; step 5 fails in a reader
        with pytest.raises(KeyError, match="corrupt") as info:
            ahead.batch(5)
        assert isinstance(info.value.__cause__, ReaderTraceback)
        assert "__getitem__" in str(info.value.__cause__)
        assert ids(ahead.batch(6)) == list(range(8, 16))  # the loader goes on
        assert ahead.stats["read_ahead"] == 1


def test_a_dead_reader_is_replaced_by_reading_here(capsys: pytest.CaptureFixture[str]) -> None:
    with Loader(Recording(100), 10, shuffle=False, num_workers=1,
                membership=lambda: (0, 1, 0)) as loader:
        loader.batch(0)
        os.kill(loader.worker_pids()[0], signal.SIGKILL)
        for step in range(1, 5):
            assert ids(loader.batch(step)) == loader.indices(step)
        assert "loader reader process" in capsys.readouterr().err


# ----------------------------------------------------------------------- no orphans
def test_readers_end_with_close_and_with_garbage_collection() -> None:
    loader = Loader(Recording(50), 10, num_workers=2, membership=lambda: (0, 1, 0))
    loader.batch(0)
    pids = loader.worker_pids()
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    loader.close()
    loader.close()
    assert not any(pid_alive(p) for p in pids)  # close() reaps them before it returns
    assert ids(loader.batch(1)) == loader.indices(1)  # a closed loader reads here
    dropped = Loader(Recording(50), 10, num_workers=2, membership=lambda: (0, 1, 0))
    dropped.batch(0)
    pids = dropped.worker_pids()
    del dropped
    gc.collect()
    assert not any(pid_alive(p) for p in pids)


CHILD = """
import os, sys, time, torch
sys.path.insert(0, {root!r})
from ftrun.worker.loader import Loader
loader = Loader([torch.tensor(i) for i in range(40)], 8, num_workers=2)
loader.batch(0)
print(*loader.worker_pids(), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
elif sys.argv[1] == "os_exit":  # how an ftrun worker leaves (ftrun/_exit.py)
    os._exit(0)
"""


@pytest.mark.parametrize("how", ["sigkill", "os_exit", "return"])
def test_readers_never_outlive_the_training_process(how: str) -> None:
    code = textwrap.dedent(CHILD.format(root=str(ROOT)))
    proc = subprocess.Popen([sys.executable, "-c", code, "sleep" if how == "sigkill" else how],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    if how == "sigkill":
        proc.kill()
    proc.wait(timeout=30)
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "loader readers to end")


# ---------------------------------------------------------------- errors, outside ftrun
@pytest.mark.parametrize("make,words", [
    (lambda: Loader(Recording(5), 8), "fewer than one global batch"),
    (lambda: Loader(object(), 8), "len()"),
    (lambda: Loader(Recording(50), 0), "global_batch_size must be >= 1"),
    (lambda: Loader(Recording(50), 12, membership=lambda: (0, 1, 0)).batch(0, 0, 5),
     "does not divide"),
    (lambda: Loader(Recording(50), 12, membership=lambda: (0, 1, 0)).batch(0, 3, 3),
     "out of range"),
    (lambda: Loader(Recording(50), 12, membership=lambda: (0, 8, 0)).batch(0, 0, 3),
     "leaves some of 8 ranks"),
    (lambda: Loader(Recording(50), 12, membership=lambda: (0, 1, 0)).batch(-1), "step"),
    (lambda: Loader(Recording(50), 12).load_state_dict({"seed": 1}), "seed"),
])
def test_errors_are_one_line(make, words: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(WorkerApiError) as info:
        make()
    assert words in info.value.one_line() and "\n" not in info.value.one_line()


def test_state_dict_round_trips() -> None:
    """What a healed replica receives: the loader's shape, checked against its own."""
    a, b = Loader(Recording(50), 12, seed=5), Loader(Recording(50), 12, seed=5)
    state = a.state_dict()
    assert state == {"seed": 5, "shuffle": True, "global_batch_size": 12, "dataset_len": 50}
    b.load_state_dict(state)
    assert b.state_dict() == state
    for i in range(3):  # the same loader reads the same data
        assert torch.equal(b.batch(i, 0, 2)[0], a.batch(i, 0, 2)[0])
    for other, field in ((Loader(Recording(50), 12, seed=6), "seed"),
                         (Loader(Recording(50), 12, seed=5, shuffle=False), "shuffle"),
                         (Loader(Recording(50), 6, seed=5), "global_batch_size"),
                         (Loader(Recording(49), 12, seed=5), "dataset_len")):
        with pytest.raises(WorkerApiError, match=f"ft.loader: {field} is "):
            other.load_state_dict(state)


def test_outside_ftrun_membership_follows_torch_distributed() -> None:
    assert dist_membership() == (0, 1, 0)
    code = textwrap.dedent(f"""
        import os, sys, torch, torch.distributed as dist
        sys.path.insert(0, {str(ROOT)!r})
        from ftrun.worker.loader import Loader
        dist.init_process_group("gloo")
        loader = Loader([torch.tensor(i) for i in range(40)], 8, shuffle=False)
        print(loader.batch(1, 1, 2).tolist(), flush=True)
        dist.barrier()  # a rank that left right after init could close the mesh on a slower peer
        dist.destroy_process_group()
    """)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r)}) for r in range(2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outs == ["[12, 13]", "[14, 15]"]


def test_importing_the_loader_pulls_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, ftrun.worker.loader; print('torch' in "
                          "sys.modules)"], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------- token dataset
def test_token_dataset_windows_are_shifted_bytes() -> None:
    data = TokenDataset.from_text(block_size=32)
    text = (ROOT / "examples" / "data" / "tiny_corpus.txt").read_bytes()
    assert 20_000 <= len(text) <= 40_000 and len(data) == (len(text) - 33) // 32 + 1
    x, y = data[len(data) - 1]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (32,)
    assert torch.equal(x[1:], y[:-1]) and int(x.max()) < VOCAB_SIZE
    assert decode(torch.cat([x, y[-1:]])).encode() in text
    with pytest.raises(IndexError):
        data[len(data)]
    train, val = data.split(0.1)
    assert len(train) + len(val) <= len(data) and len(val) > 0
    loader = Loader(train, 16, num_workers=0, membership=lambda: (1, 2, 0))
    xb, yb = loader.batch(3, 1, 2)
    assert xb.shape == yb.shape == (4, 32)
    assert torch.equal(xb, Loader(train, 16, membership=lambda: (1, 2, 0)).batch(3, 1, 2)[0])
